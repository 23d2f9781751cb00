"""The kubelet part of the node agent: pods bound to our nodes become processes, and their state
becomes pod status.

Kubelet behaviour the operator depends on, kept here: restartPolicy Always with the crash
back-off (first restart at once, then 10 s doubling to 5 min, forgotten after 10 min of good
running), CrashLoopBackOff while waiting, restartCount, lastState.terminated with reason
OOMKilled, Error or Completed and the last log line as message, Ready only after the readiness
endpoint answers 200 (failureThreshold respected).

Termination, as the kubelet does it (Kubernetes docs, "Termination of Pods"): when the API
server marks a pod for deletion, the kubelet runs the preStop hook, then sends SIGTERM, and
sends SIGKILL when the grace period, counted from the deletion, has run out (with a one-off
2 s extension when the hook used it all up); once the process has exited it removes the pod
object (a delete with grace 0). The EndpointSlice controller marks the pod's endpoint not
ready from the moment of deletion, which is what the Service proxy reads.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from vllm_localcluster.node.container import (
    Process,
    UnsupportedCommand,
    allocate_pod_ip,
    container_env,
    gpu_for_node_selector,
    last_line,
    pod_ip_of,
    port_of,
    pre_stop_delay,
    serve_args,
    spawn,
    termination_reason,
    with_pod_address,
)

log = logging.getLogger(__name__)

# The kubelet's crash back-off: 10 s doubling to 5 min, forgotten after 10 min of good running.
BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0
BACKOFF_RESET_S = 600.0
# The kubelet's one-off extension when the preStop hook used the whole grace period.
PRE_STOP_EXTENSION_S = 2.0

TargetGroups = list[dict[str, Any]]


def iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass
class KubeletConfig:
    """`launcher` runs `vllm serve` containers (the simulator by default); `env` is added to every
    container (container env wins); `backoff_scale` divides the crash back-off, so tests and
    demos need not wait minutes; `run_any_command` runs containers that are not `vllm serve`
    as their own command (tests use plain processes); `max_grace_s` caps grace periods.
    `env_by_labels` adds env to the pods whose labels include a selector's (a fault on some
    pods only, e.g. a slow GPU under a canary); it wins over `env` and the node's, the
    container's own env wins over it."""

    workdir: Path
    launcher: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    env_by_labels: tuple[tuple[Mapping[str, str], Mapping[str, str]], ...] = ()
    backoff_scale: float = 1.0
    health_interval_s: float = 1.0
    run_any_command: bool = False
    max_grace_s: float | None = None
    on_targets: Callable[[TargetGroups], None] | None = None


@dataclass
class Container:
    """The kubelet's memory of one pod's (first) container across restarts."""

    namespace: str
    pod: str
    uid: str
    name: str
    image: str
    ip: str  # where the process listens: 127.a.b.c (the API shows 10.a.b.c, pod_ip_of)
    port: int
    grace_s: float
    log_path: Path
    argv: list[str] = field(default_factory=list)  # without the address (set at start)
    serves_vllm: bool = True
    env: dict[str, str] = field(default_factory=dict)
    probe_path: str | None = "/health"
    readiness_threshold: int = 3
    pre_stop_s: float | None = 0.0
    process: Process | None = None
    error: tuple[str, str] | None = None  # (waiting reason, message): it cannot be started
    backoff_s: float = 0.0
    restart_count: int = 0
    failures: int = 0  # consecutive crashes, for the back-off
    restart_at: float | None = None  # monotonic time of the next start while backing off
    ready: bool = False
    started: bool = False
    health_failures: int = 0
    last_health: float = 0.0
    last_terminated: dict[str, Any] | None = None
    start_time: float = field(default_factory=time.time)
    conditions_since: dict[str, tuple[bool, float]] = field(default_factory=dict)
    terminating: asyncio.Task[None] | None = None
    terminated: dict[str, Any] | None = None  # the final state once termination finished
    events: list[str] = field(default_factory=list)  # SIGTERM/SIGKILL times, for tests

    def alive(self) -> bool:
        return self.process is not None and self.process.exit_code() is None


def labelled_env(
    rules: Sequence[tuple[Mapping[str, str], Mapping[str, str]]], labels: Mapping[str, str]
) -> dict[str, str]:
    """The env of every (selector, env) rule whose selector the labels match, in order."""
    env: dict[str, str] = {}
    for selector, extra in rules:
        if all(labels.get(k) == v for k, v in selector.items()):
            env.update(extra)
    return env


class Kubelet:
    """Runs the pods bound to the agent's nodes on this machine."""

    def __init__(self, config: KubeletConfig, node_env: Mapping[str, Mapping[str, str]]) -> None:
        self.config = config
        self.node_env = node_env  # node name -> env every pod there gets (its GPU)
        self.containers: dict[str, Container] = {}  # by pod uid
        self.pids: set[int] = set()  # every process started, for leak checks
        self.lock = threading.Lock()  # pids are read from other threads
        self._http: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))

    async def close(self, grace_cap_s: float = 5.0) -> None:
        """Stop every process at once (the node is going away): SIGTERM, SIGKILL after a cap."""
        await asyncio.gather(
            *(self._stop_process(c, min(c.grace_s, grace_cap_s)) for c in self.containers.values()),
            return_exceptions=True,
        )
        if self._http is not None:
            await self._http.close()

    # ------------------------------------------------------------------ admission

    def admit(self, pod: Mapping[str, Any]) -> Container:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        first: dict[str, Any] = (spec.get("containers") or [{}])[0]
        grace = float(spec.get("terminationGracePeriodSeconds", 30))
        if self.config.max_grace_s is not None:
            grace = min(grace, self.config.max_grace_s)
        probe = first.get("readinessProbe") or {}
        gpu = gpu_for_node_selector(spec.get("nodeSelector"))
        env = {
            **self.config.env,
            **self.node_env.get(str(spec.get("nodeName")), {}),
            **({"VLLM_SIM_GPU": gpu} if gpu else {}),
            **labelled_env(self.config.env_by_labels, meta.get("labels") or {}),
            **container_env(first),
        }
        command, args = first.get("command") or [], first.get("args") or []
        container = Container(
            namespace=meta["namespace"],
            pod=meta["name"],
            uid=meta["uid"],
            name=str(first.get("name", "main")),
            image=str(first.get("image", "")),
            ip="",
            port=0,
            grace_s=grace,
            log_path=self.config.workdir / "pods" / meta["namespace"] / f"{meta['name']}.log",
            env=env,
            probe_path=(probe.get("httpGet") or {}).get("path") if probe else None,
            readiness_threshold=int(probe.get("failureThreshold", 3)),
            pre_stop_s=pre_stop_delay(first),
        )
        try:
            serve = serve_args(command, args)
            container.argv = [*self.config.launcher, *serve]
            container.port = port_of(serve)
            container.probe_path = container.probe_path or "/health"
        except UnsupportedCommand as exc:
            if self.config.run_any_command and command:
                container.argv = [*command, *args]
                container.serves_vllm = False
                ports = first.get("ports") or [{}]
                container.port = int(ports[0].get("containerPort", 8000))
            else:
                container.error = ("CreateContainerError", str(exc))
        taken = {c.ip for c in self.containers.values()}
        container.ip = allocate_pod_ip(container.port or 8000, taken)
        self.containers[container.uid] = container
        return container

    # ------------------------------------------------------------------ running

    def _start(self, container: Container) -> None:
        argv = container.argv
        if container.serves_vllm:
            argv = with_pod_address(argv, container.ip, container.port)
        # POD_IP is where the process listens here (127.a.b.c; the API shows 10.a.b.c).
        env = {**container.env, "POD_IP": container.ip, "POD_NAME": container.pod}
        try:
            process = spawn(argv, env, container.log_path)
        except OSError as exc:
            container.error = ("RunContainerError", str(exc))
            return
        container.process = process
        container.ready = container.started = False
        container.health_failures = 0
        container.last_health = 0.0
        with self.lock:
            self.pids.add(process.pid)
        log.info("started %s/%s on %s:%d (pid %d)", container.namespace, container.pod,
                 container.ip, container.port, process.pid)  # fmt: skip

    def drive(self, container: Container) -> None:
        """Start, notice exits, restart after the back-off (restartPolicy Always)."""
        if container.error is not None or container.terminating is not None:
            return
        if container.process is None:
            self._start(container)
            return
        now = time.monotonic()
        code = container.process.exit_code()
        if code is not None and container.restart_at is None:
            self._record_exit(container, code)
            # The first restart is immediate; then 10 s, 20 s, ... up to 5 min (kubelet).
            delay = 0.0
            if container.failures > 0:
                delay = min(BACKOFF_INITIAL_S * 2 ** (container.failures - 1), BACKOFF_MAX_S)
            container.failures += 1
            container.backoff_s = delay
            container.restart_at = now + delay / self.config.backoff_scale
            container.ready = container.started = False
        if container.restart_at is not None and now >= container.restart_at:
            container.restart_at = None
            container.restart_count += 1
            self._start(container)

    def _record_exit(self, container: Container, code: int) -> dict[str, Any]:
        process = container.process
        assert process is not None
        tail = process.log_since_start()
        finished = time.time()
        if finished - process.started_at > BACKOFF_RESET_S / self.config.backoff_scale:
            container.failures = 0
        container.last_terminated = {
            "exitCode": code,
            "reason": termination_reason(code, tail),
            "message": last_line(tail),
            "startedAt": iso(process.started_at),
            "finishedAt": iso(finished),
            "containerID": f"local://{process.pid}",
        }
        log.info("%s/%s exited with %d (%s)", container.namespace, container.pod, code,
                 container.last_terminated["reason"])  # fmt: skip
        return container.last_terminated

    async def probe(self, container: Container) -> None:
        if not container.alive() or container.terminating is not None:
            container.ready = container.ready and container.alive()
            return
        now = time.monotonic()
        if container.ready and now - container.last_health < self.config.health_interval_s:
            return
        container.last_health = now
        assert self._http is not None
        url = f"http://{container.ip}:{container.port}{container.probe_path or '/'}"
        healthy = container.probe_path is None
        if not healthy:
            try:
                async with self._http.get(url) as response:
                    healthy = response.status == 200
            except (aiohttp.ClientError, TimeoutError, OSError):
                healthy = False
        if not container.alive():
            container.ready = False
        elif healthy:
            container.ready = container.started = True
            container.health_failures = 0
        else:
            container.health_failures += 1
            if container.health_failures >= container.readiness_threshold:
                container.ready = False

    # ------------------------------------------------------------------ termination

    def begin_termination(self, container: Container, pod: Mapping[str, Any]) -> None:
        """The pod was marked for deletion: preStop, SIGTERM, SIGKILL at the deadline."""
        if container.terminating is not None:
            return
        meta = pod["metadata"]
        # deletionTimestamp = time of the delete call + the grace period: the SIGKILL deadline.
        deadline = parse_time(meta["deletionTimestamp"])
        if self.config.max_grace_s is not None:
            deadline = min(deadline, time.time() + self.config.max_grace_s)
        container.restart_at = None
        container.terminating = asyncio.get_running_loop().create_task(
            self._terminate(container, deadline)
        )

    async def _terminate(self, container: Container, deadline: float) -> None:
        if container.alive():
            delay = container.pre_stop_s
            if delay is None:
                self._note(container, "preStop hook not supported here: skipped")
                delay = 0.0
            remaining = deadline - time.time()
            if delay > 0:
                self._note(container, f"preStop: sleeping {delay:g} s")
                await asyncio.sleep(max(0.0, min(delay, remaining)))
                if delay >= remaining:
                    deadline = time.time() + PRE_STOP_EXTENSION_S
            await self._stop_process(container, max(0.0, deadline - time.time()))
        container.ready = False
        code = container.process.exit_code() if container.process is not None else None
        if code is not None:
            self._record_exit(container, code)
            container.terminated = container.last_terminated
        else:
            container.terminated = {"exitCode": 0, "reason": "Completed"}

    def _note(self, container: Container, text: str) -> None:
        container.events.append(f"{time.time():.3f} {text}")
        try:
            with container.log_path.open("a") as out:
                out.write(f"--- {time.strftime('%H:%M:%S')} {text}\n")
        except OSError:
            pass

    async def _stop_process(self, container: Container, grace_s: float) -> None:
        process = container.process
        if process is None:
            return
        if process.exit_code() is None:
            self._note(container, f"SIGTERM (grace {grace_s:.1f} s)")
        await process.stop(grace_s, on_kill=lambda: self._note(container, "SIGKILL"))
        container.ready = False

    def forget(self, uid: str) -> Container | None:
        return self.containers.pop(uid, None)

    def kill_all_now(self) -> None:
        for container in list(self.containers.values()):
            if container.process is not None:
                container.process.kill_now()

    # ------------------------------------------------------------------ status

    def targets(self) -> TargetGroups:
        """File-SD target groups of running pods (namespace, pod, container and job labels, as
        Kubernetes service discovery with a PodMonitor gives)."""
        groups: TargetGroups = []
        for container in sorted(self.containers.values(), key=lambda c: (c.namespace, c.pod)):
            if container.alive() and container.serves_vllm:
                labels = {
                    "namespace": container.namespace,
                    "pod": container.pod,
                    "container": container.name,
                    "job": "vllm",
                }
                groups.append({"targets": [f"{container.ip}:{container.port}"], "labels": labels})
        return groups

    def pod_status(self, container: Container) -> dict[str, Any]:
        conditions = []
        for kind, value in (
            ("Initialized", True),
            ("ContainersReady", container.ready),
            ("Ready", container.ready),
        ):
            since = container.conditions_since.get(kind)
            if since is None or since[0] != value:
                since = container.conditions_since[kind] = (value, time.time())
            entry: dict[str, Any] = {
                "type": kind,
                "status": "True" if value else "False",
                "lastTransitionTime": iso(since[1]),
            }
            if not value:
                entry["reason"] = "ContainersNotReady"
                entry["message"] = f"containers with unready status: [{container.name}]"
            conditions.append(entry)
        status: dict[str, Any] = {
            "name": container.name,
            "image": container.image,
            "imageID": "",
            "ready": container.ready,
            "restartCount": container.restart_count,
            "started": container.started,
            "state": self._state(container),
            "lastState": (
                {"terminated": container.last_terminated}
                if container.last_terminated and container.terminated is None
                else {}
            ),
        }
        if container.process is not None:
            status["containerID"] = f"local://{container.process.pid}"
        return {
            "phase": "Running" if container.process is not None else "Pending",
            "conditions": conditions,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": pod_ip_of(container.ip),
            "podIPs": [{"ip": pod_ip_of(container.ip)}],
            "startTime": iso(container.start_time),
            "containerStatuses": [status],
        }

    @staticmethod
    def _state(container: Container) -> dict[str, Any]:
        process = container.process
        if container.terminated is not None:
            return {"terminated": container.terminated}
        if container.error is not None:
            return {"waiting": {"reason": container.error[0], "message": container.error[1]}}
        if process is not None and container.alive():
            return {"running": {"startedAt": iso(process.started_at)}}
        if container.restart_at is not None:
            message = (
                f"back-off {container.backoff_s:g}s restarting failed container="
                f"{container.name} pod={container.pod}_{container.namespace}({container.uid})"
            )
            return {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
        return {"waiting": {"reason": "ContainerCreating"}}
