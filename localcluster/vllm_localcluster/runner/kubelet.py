"""The kubelet half of the runner: pods become processes, and their state becomes pod status.

Real kubelet behaviour the operator depends on: restartPolicy Always with the crash back-off
(first restart at once, then 10 s doubling to 5 min, forgotten after 10 min of good running),
CrashLoopBackOff while waiting, restartCount, lastState.terminated with reason OOMKilled, Error
or Completed and the last log line as message, Ready only after /health answers 200 (readiness
failureThreshold respected), SIGTERM then SIGKILL after the grace period on deletion.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from vllm_autotuner import GROUP
from vllm_autotuner.adapters.kube import KubeClient, NotFound
from vllm_localcluster.runner.container import (
    Process,
    UnsupportedCommand,
    container_env,
    free_port,
    gpu_for_node_selector,
    last_line,
    serve_args,
    spawn,
    termination_reason,
)
from vllm_localcluster.runner.objects import (
    RunnerConfig,
    StatusWriter,
    TargetGroups,
    controller_uid,
    iso,
    pod_path,
)

log = logging.getLogger(__name__)

PORT_ANNOTATION = f"{GROUP}/local-port"
# The kubelet's crash back-off: 10 s doubling to 5 min, forgotten after 10 min of good running.
BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0
BACKOFF_RESET_S = 600.0
# What vllm-sim and vLLM (uvicorn's OSError) print when the port is already in use.
PORT_TAKEN_MARKERS = ("cannot listen on port", "Address already in use")


@dataclass
class Container:
    """The kubelet's memory of one pod's (single) container across restarts."""

    namespace: str
    pod: str
    uid: str
    name: str
    image: str
    port: int
    grace_s: float
    log_path: Path
    owner: str | None = None  # the Deployment's name, when a ReplicaSet of one owns the pod
    serve: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    readiness_threshold: int = 3
    process: Process | None = None
    error: tuple[str, str] | None = None  # (waiting reason, message): it cannot be started
    backoff_s: float = 0.0
    published_port: int | None = None  # the port in the pod's annotation
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

    def alive(self) -> bool:
        return self.process is not None and self.process.exit_code() is None


class Kubelet:
    """Runs every pod in the cluster on this machine (one node, 127.0.0.1, a port per pod)."""

    def __init__(self, config: RunnerConfig, status: StatusWriter) -> None:
        self.config = config
        self.status = status
        self.containers: dict[str, Container] = {}  # by pod uid
        self.pids: set[int] = set()  # every process started, for leak checks
        self.lock = threading.Lock()  # pids are read from other threads
        self._http: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))

    async def close(self) -> None:
        """Stop every process (concurrently: each may use its grace period)."""
        await asyncio.gather(
            *(self.stop_process(c) for c in list(self.containers.values())),
            return_exceptions=True,
        )
        if self._http is not None:
            await self._http.close()

    async def forget(self, uid: str) -> None:
        """The pod is gone from the API: stop its process before returning."""
        container = self.containers.pop(uid, None)
        if container is not None:
            await self.stop_process(container)

    def targets_and_endpoints(
        self,
    ) -> tuple[TargetGroups, dict[tuple[str, str], list[tuple[str, str]]]]:
        """File-SD target groups of running pods (namespace, pod, container, job labels, as
        Kubernetes service discovery with a PodMonitor gives), and ready pods per Deployment."""
        groups: TargetGroups = []
        endpoints: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for container in sorted(self.containers.values(), key=lambda c: (c.namespace, c.pod)):
            if container.alive():
                labels = {
                    "namespace": container.namespace,
                    "pod": container.pod,
                    "container": container.name,
                    "job": "vllm",
                }
                groups.append({"targets": [f"127.0.0.1:{container.port}"], "labels": labels})
            if container.ready and container.owner is not None:
                url = f"http://127.0.0.1:{container.port}"
                endpoints.setdefault((container.namespace, container.owner), []).append(
                    (container.pod, url)
                )
        return groups, endpoints

    async def sync(
        self, client: KubeClient, pods: list[dict[str, Any]], replicasets: dict[str, Any]
    ) -> None:
        seen: set[str] = set()
        active: list[tuple[dict[str, Any], Container]] = []
        for pod in pods:
            meta = pod["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            if meta.get("deletionTimestamp"):
                gone = self.containers.pop(uid, None)
                if gone is not None:
                    await self.stop_process(gone)
                if not meta.get("finalizers"):
                    with contextlib.suppress(NotFound):
                        await client.request(
                            "DELETE",
                            pod_path(meta["namespace"], meta["name"]),
                            body={"gracePeriodSeconds": 0},
                        )
                continue
            container = self.containers.get(uid)
            if container is None:
                container = self._admit(pod, replicasets)
                self.containers[uid] = container
            self._drive(container)
            if container.published_port != container.port:
                with contextlib.suppress(NotFound):
                    await client.merge_patch(
                        pod_path(container.namespace, container.pod),
                        {"metadata": {"annotations": {PORT_ANNOTATION: str(container.port)}}},
                    )
                container.published_port = container.port
            active.append((pod, container))
        for uid in [u for u in self.containers if u not in seen]:
            await self.stop_process(self.containers.pop(uid))
        await asyncio.gather(*(self._probe(c) for _, c in active if c.alive()))
        for pod, container in active:
            meta = pod["metadata"]
            await self.status.write(
                client,
                pod_path(meta["namespace"], meta["name"]),
                meta["uid"],
                self._pod_status(container),
            )

    def _admit(self, pod: dict[str, Any], replicasets: Mapping[str, Any]) -> Container:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        first: dict[str, Any] = (spec.get("containers") or [{}])[0]
        owner: str | None = None
        rs = replicasets.get(controller_uid(pod) or "")
        if rs is not None:
            refs = rs["metadata"].get("ownerReferences") or []
            owner = next((r["name"] for r in refs if r.get("kind") == "Deployment"), None)
        grace = float(spec.get("terminationGracePeriodSeconds", 30))
        probe = first.get("readinessProbe") or {}
        gpu = gpu_for_node_selector(spec.get("nodeSelector"))
        node_gpu = {"VLLM_SIM_GPU": gpu} if gpu else {}
        container = Container(
            namespace=meta["namespace"],
            pod=meta["name"],
            uid=meta["uid"],
            name=str(first.get("name", "main")),
            image=str(first.get("image", "")),
            port=free_port(),
            grace_s=min(grace, self.config.max_grace_s),
            log_path=self.config.workdir / "pods" / meta["namespace"] / f"{meta['name']}.log",
            owner=owner,
            env={**self.config.env, **node_gpu, **container_env(first)},
            readiness_threshold=int(probe.get("failureThreshold", 3)),
        )
        try:
            container.serve = serve_args(first.get("command") or [], first.get("args") or [])
        except UnsupportedCommand as exc:
            container.error = ("CreateContainerError", str(exc))
        return container

    def _start(self, container: Container) -> None:
        try:
            process = spawn(
                self.config.launcher,
                container.serve,
                container.port,
                container.env,
                container.log_path,
            )
        except OSError as exc:
            container.error = ("RunContainerError", str(exc))
            return
        container.process = process
        container.ready = container.started = False
        container.health_failures = 0
        container.last_health = 0.0
        with self.lock:
            self.pids.add(process.pid)
        log.info("started %s/%s on port %d (pid %d)", container.namespace, container.pod,
                 container.port, process.pid)  # fmt: skip

    def _drive(self, container: Container) -> None:
        """Start, notice exits, restart after the back-off (restartPolicy Always)."""
        if container.error is not None:
            return
        if container.process is None:
            self._start(container)
            return
        now = time.monotonic()
        code = container.process.exit_code()
        if code is not None and container.restart_at is None:
            process = container.process
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
            # The first restart is immediate; then 10 s, 20 s, ... up to 5 min (kubelet).
            delay = 0.0
            if container.failures > 0:
                delay = min(BACKOFF_INITIAL_S * 2 ** (container.failures - 1), BACKOFF_MAX_S)
            container.failures += 1
            container.backoff_s = delay
            if any(marker in tail for marker in PORT_TAKEN_MARKERS):
                # Another process took the free port between probing and binding: pick again.
                container.port = free_port()
            container.restart_at = now + delay / self.config.backoff_scale
            container.ready = container.started = False
            log.info("%s/%s exited with %d (%s)", container.namespace, container.pod, code,
                     container.last_terminated["reason"])  # fmt: skip
        if container.restart_at is not None and now >= container.restart_at:
            container.restart_at = None
            container.restart_count += 1
            self._start(container)

    async def _probe(self, container: Container) -> None:
        now = time.monotonic()
        if container.ready and now - container.last_health < self.config.health_interval_s:
            return
        container.last_health = now
        assert self._http is not None
        try:
            async with self._http.get(f"http://127.0.0.1:{container.port}/health") as response:
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

    def _pod_status(self, container: Container) -> dict[str, Any]:
        conditions = []
        for kind, value in (
            ("PodScheduled", True),
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
        state: dict[str, Any]
        process = container.process
        if container.error is not None:
            state = {"waiting": {"reason": container.error[0], "message": container.error[1]}}
        elif process is not None and container.alive():
            state = {"running": {"startedAt": iso(process.started_at)}}
        elif container.restart_at is not None:
            message = (
                f"back-off {container.backoff_s:g}s restarting failed container="
                f"{container.name} pod={container.pod}_{container.namespace}({container.uid})"
            )
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        status: dict[str, Any] = {
            "name": container.name,
            "image": container.image,
            "imageID": "",
            "ready": container.ready,
            "restartCount": container.restart_count,
            "started": container.started,
            "state": state,
            "lastState": (
                {"terminated": container.last_terminated} if container.last_terminated else {}
            ),
        }
        if process is not None:
            status["containerID"] = f"local://{process.pid}"
        return {
            "phase": "Running" if process is not None else "Pending",
            "conditions": conditions,
            "hostIP": "127.0.0.1",
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "startTime": iso(container.start_time),
            "containerStatuses": [status],
        }

    async def stop_process(self, container: Container) -> None:
        if container.process is not None:
            await container.process.stop(container.grace_s)
        container.ready = False

    def is_ready(self, pod: Mapping[str, Any]) -> bool:
        container = self.containers.get(pod["metadata"]["uid"])
        return container is not None and container.ready

    def kill_all_now(self) -> None:
        for container in list(self.containers.values()):
            if container.process is not None:
                container.process.kill_now()
