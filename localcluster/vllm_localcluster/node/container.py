"""One container of one pod as a local process: command mapping, spawning, stopping, exit reasons.

A pod template says `vllm serve MODEL --port 8000 ...`; on this machine that becomes
`python -m vllm_sim.cli serve MODEL --host <pod IP> --port 8000 ...`. Every pod gets its own
address in 127.0.0.0/8 (Linux routes the whole block to the loopback interface), so pods keep
the ports their spec declares, as in a cluster where each pod has its own IP, and EndpointSlices
carry addresses that reach them. Each process gets its own session (process group), so stopping
a pod also stops anything it spawned, and nothing outlives the node agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The simulator's entry point; a different one (real vLLM, a stand-in) can be configured.
SIM_COMMAND: tuple[str, ...] = (sys.executable, "-m", "vllm_sim.cli", "serve")

# Markers of a CUDA OOM in vLLM's (and vllm-sim's) log: a run-time OOM kills the engine process.
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory")
# ... but an OOM while the engine initialises (the model does not fit) is a configuration error
# that vLLM reports and exits 1 on: the kubelet calls that "Error", and so do we.
STARTUP_FAILURE_MARKERS = ("Engine core initialization failed", "EngineCore failed to start")
# 128 + SIGKILL: what the kernel OOM killer leaves as the container's exit code.
OOM_EXIT_CODE = 137


class UnsupportedCommand(ValueError):
    """The container does not run `vllm serve`, the only program the node agent starts unless
    it is configured to run any command."""


DEFAULT_VLLM_PORT = 8000


def pod_ip_of(loopback: str) -> str:
    """The pod IP the API sees for a process listening on 127.a.b.c: 10.a.b.c.

    The API server refuses loopback addresses in EndpointSlices, so pods get addresses in
    10.128.0.0/9 (clear of the Service range 10.96.0.0/16), and whoever connects here (the
    Service proxy, the Prometheus targets) reaches pod 10.a.b.c at 127.a.b.c.
    """
    return "10." + loopback.split(".", 1)[1]


def loopback_of(pod_ip: str) -> str:
    """Where pod 10.a.b.c listens on this machine: 127.a.b.c."""
    return "127." + pod_ip.split(".", 1)[1]


def allocate_pod_ip(port: int, taken: set[str]) -> str:
    """A random 127.a.b.c (a >= 128) whose `port` is free now: random, so that two clusters on
    one machine (parallel test runs) rarely meet. A pod keeps its address for life, as in
    Kubernetes (the API server refuses a second IP of one family)."""
    for _ in range(100):
        ip = f"127.{random.randint(128, 254)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        if ip in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((ip, port))
            except OSError:
                continue
        return ip
    raise OSError(f"no free loopback address for port {port}")


def _is_vllm(program: str) -> bool:
    return os.path.basename(program) in ("vllm", "vllm-sim")


def serve_args(command: Sequence[str], args: Sequence[str]) -> list[str]:
    """The arguments after `serve` (model first) of a container that runs vLLM's server.

    Accepts `vllm serve ...` (what the operator renders), `vllm-sim serve ...`, and the older
    `python -m vllm.entrypoints.openai.api_server --model M ...` form.
    """
    argv = [*command, *args]
    if len(argv) >= 2 and _is_vllm(argv[0]) and argv[1] == "serve":
        return argv[2:]
    for module in ("vllm.entrypoints.openai.api_server", "vllm_sim.cli"):
        if module in argv:
            rest = argv[argv.index(module) + 1 :]
            return rest[1:] if rest[:1] == ["serve"] else rest
    raise UnsupportedCommand(f"the node agent only runs `vllm serve`, not {argv[:3]!r}")


def port_of(args: Sequence[str], default: int = DEFAULT_VLLM_PORT) -> int:
    """The --port the server will listen on (vLLM's default 8000)."""
    for i, arg in enumerate(args):
        if arg == "--port" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    return default


def with_pod_address(args: Sequence[str], ip: str, port: int) -> list[str]:
    """Listen on the pod's own address: drop --host/--port and set both."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in ("--port", "--host"):
            skip = True
            continue
        if arg.startswith(("--port=", "--host=")):
            continue
        out.append(arg)
    return [*out, "--host", ip, "--port", str(port)]


def container_env(container: Mapping[str, Any]) -> dict[str, str]:
    """Plain `value` entries of the container's env; valueFrom needs an API the node agent lacks."""
    env: dict[str, str] = {}
    for entry in container.get("env") or []:
        if isinstance(entry, Mapping) and "name" in entry and "valueFrom" not in entry:
            env[str(entry["name"])] = str(entry.get("value", ""))
    return env


# The GPU Feature Discovery label a node selector pins the GPU model with, e.g. NVIDIA-H200 or
# NVIDIA-A100-SXM4-80GB; this machine plays whichever node the pod asks for.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


def gpu_for_node_selector(selector: Mapping[str, Any] | None) -> str | None:
    """The simulator's GPU catalog name for a pod pinned to a GPU product, if it names one."""
    product = str((selector or {}).get(GPU_PRODUCT_LABEL, "")).upper()
    for name in ("B200", "H200", "H100", "L40S"):
        if name in product:
            return name
    if "A100" in product:
        return "A100-80GB" if "80G" in product else "A100-40GB"
    return None


def termination_reason(exit_code: int, log_tail: str) -> str:
    """The kubelet's lastState.terminated.reason for an exit: a SIGKILL exit code, or a CUDA OOM
    after the engine had started, is OOMKilled (what the operator treats as an infeasible
    gpu_memory_utilization); any other failure is Error."""
    if exit_code == OOM_EXIT_CODE:
        return "OOMKilled"
    run_time_oom = any(m in log_tail for m in OOM_MARKERS) and not any(
        m in log_tail for m in STARTUP_FAILURE_MARKERS
    )
    if exit_code != 0 and run_time_oom:
        return "OOMKilled"
    return "Completed" if exit_code == 0 else "Error"


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:1024] if lines else ""


@dataclass
class Process:
    """A started container process and where its output goes."""

    popen: subprocess.Popen[bytes]
    log_path: Path
    log_offset: int
    started_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        """None while running; a killed process reports 128 + signal, as container runtimes do."""
        code = self.popen.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code

    def log_since_start(self, limit: int = 16384) -> str:
        try:
            with self.log_path.open("rb") as log:
                size = log.seek(0, os.SEEK_END)
                log.seek(max(self.log_offset, size - limit))
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def signal_group(self, sig: int) -> None:
        # Once reaped, the process id (and so the group id) may belong to someone else.
        if self.popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    async def stop(self, grace_s: float, on_kill: Callable[[], None] | None = None) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period, reap the process."""
        if self.popen.poll() is None:
            self.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.popen.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        if self.popen.poll() is None:
            if on_kill is not None:
                on_kill()
            self.signal_group(signal.SIGKILL)
            await asyncio.get_running_loop().run_in_executor(None, self.popen.wait)

    def kill_now(self) -> None:
        """Synchronous last resort (interpreter exit, an agent that lost its loop)."""
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)


def _orphan_guard() -> list[str]:
    """`setpriv --pdeathsig KILL` (util-linux) makes the kernel kill a pod's process when the
    thread that started it dies, so even a SIGKILLed agent leaves no simulator behind. The
    signal survives exec; without setpriv, stop() and the atexit hook are the only guards."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> Process:
    """Start argv in its own session, output appended to the pod's log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full = [*_orphan_guard(), *argv]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    with log_path.open("ab") as log:
        offset = log.tell()
        log.write(f"--- {time.strftime('%H:%M:%S')} starting: {' '.join(full)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            full,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            close_fds=True,
        )
    return Process(popen=popen, log_path=log_path, log_offset=offset)


def pre_stop_delay(container: Mapping[str, Any]) -> float | None:
    """Seconds the container's preStop hook waits, or None when there is no hook we can honour.

    Kubernetes' native `lifecycle.preStop.sleep.seconds` (GA in 1.32), and the two exec forms
    charts use for the same purpose, `["sleep", "N"]` and `["/bin/sh", "-c", "sleep N"]`, are a
    delay of N seconds: the time endpoints need to drop the pod before it gets SIGTERM. Any other
    hook (httpGet, other commands) is not run here; the caller says so in the pod's log.
    """
    hook = (container.get("lifecycle") or {}).get("preStop") or {}
    if not hook:
        return 0.0
    if "sleep" in hook:
        return float((hook["sleep"] or {}).get("seconds", 0))
    command = [str(part) for part in ((hook.get("exec") or {}).get("command") or [])]
    if len(command) == 2 and os.path.basename(command[0]) == "sleep":
        return _seconds(command[1])
    if len(command) == 3 and command[1] == "-c" and os.path.basename(command[0]) in ("sh", "bash"):
        words = command[2].split()
        if len(words) == 2 and words[0] == "sleep":
            return _seconds(words[1])
    return None


def _seconds(text: str) -> float | None:
    try:
        return float(text.rstrip("s"))
    except ValueError:
        return None
