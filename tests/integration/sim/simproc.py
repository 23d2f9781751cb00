"""Start `vllm-sim serve` as a real process on a free 127.0.0.1 port, the way a pod runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.support.waiting import wait_for
from vllm_localcluster.prometheus import free_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass
class SimProcess:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"vllm-sim exited with {self.process.returncode}:\n{self.log()}")
        try:
            return requests.get(f"{self.url}/health", timeout=1).status_code == 200
        except requests.ConnectionError:
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        wait_for(self.healthy, timeout=timeout, interval=0.05, message="vllm-sim /health == 200")

    def wait_exit(self, timeout: float = 15.0) -> int:
        return self.process.wait(timeout=timeout)


def start_sim(
    workdir: Path,
    *args: str,
    model: str = MODEL,
    env: Mapping[str, str] | None = None,
    load_time: float = 0.1,
) -> SimProcess:
    port = free_port()
    log_path = workdir / f"vllm-sim-{port}.log"
    command = [
        sys.executable, "-m", "vllm_sim.cli", "serve", model,
        "--host", "127.0.0.1", "--port", str(port), "--sim-load-time", str(load_time), *args,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    return SimProcess(process, port, log_path)


def stop_sim(sim: SimProcess) -> None:
    if sim.process.poll() is None:
        sim.process.send_signal(signal.SIGTERM)
        try:
            sim.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            sim.process.kill()
            sim.process.wait(timeout=10)


@contextmanager
def running_sim(
    workdir: Path, *args: str, model: str = MODEL, wait: bool = True, load_time: float = 0.1
) -> Iterator[SimProcess]:
    """A started server (healthy unless `wait=False`), always stopped on exit."""
    sim = start_sim(workdir, *args, model=model, load_time=load_time)
    try:
        if wait:
            sim.wait_healthy()
        yield sim
    finally:
        stop_sim(sim)
