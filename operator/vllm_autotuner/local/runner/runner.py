"""The pod runner: a Deployment controller, a ReplicaSet controller and a kubelet in one loop.

It talks to the API server only over HTTP with the operator's own client, like the real
controllers do, so it also documents what the operator needs from any cluster: Deployments that
roll out through ReplicaSets (pod-template-hash, revision annotations), pods with container
statuses (restartCount, CrashLoopBackOff, lastState.terminated.reason OOMKilled/Error) and
Deployment status with Available/Progressing conditions.

Level-triggered: every tick (0.3 s) lists Deployments, ReplicaSets and Pods in all namespaces,
moves the world one step towards the desired state and writes status only when it changed. A
relist rather than a watch, because the kubelet half must poll processes and /health anyway,
processes take a second to start, and a missed event can never leave the cluster stuck;
measured cost: about 1.5% of one core with three pods (emulator included).

Local differences, on purpose: every pod listens on 127.0.0.1 on its own port (annotation
`vllm.autotuner.io/local-port`); a Deployment without `strategy.rollingUpdate` rolls out
surge-free (maxSurge 0, maxUnavailable 1: the safe choice on full GPU nodes) instead of 25%/25%;
a pod an old revision loses is stopped before the next one starts (no overlap even while
terminating); only the first container of a pod runs; probes are the pod's /health, polled every
0.3 s until ready and every second after, and liveness and startup probes never kill (the
simulator does not hang); a pod pinned with `nodeSelector: nvidia.com/gpu.product` gets that GPU
as VLLM_SIM_GPU, as if scheduled on such a node; a pod whose port was taken gets a new one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from vllm_autotuner import GROUP
from vllm_autotuner.adapters.kube import Conflict, KubeClient, KubeCredentials, NotFound
from vllm_autotuner.local.runner.container import (
    SIM_COMMAND,
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
from vllm_autotuner.local.runner.workloads import (
    DEFAULT_PROGRESS_DEADLINE_S,
    REVISION_ANNOTATION,
    TEMPLATE_HASH_LABEL,
    RevisionCounts,
    condition,
    random_suffix,
    rolling_targets,
    strategy_of,
    template_hash,
)

log = logging.getLogger(__name__)

PORT_ANNOTATION = f"{GROUP}/local-port"
PODS = "/api/v1/pods"
REPLICASETS = "/apis/apps/v1/replicasets"
DEPLOYMENTS = "/apis/apps/v1/deployments"
# The kubelet's crash back-off: 10 s doubling to 5 min, forgotten after 10 min of good running.
BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0
BACKOFF_RESET_S = 600.0
# What vllm-sim and vLLM (uvicorn's OSError) print when the port is already in use.
PORT_TAKEN_MARKERS = ("cannot listen on port", "Address already in use")

TargetGroups = list[dict[str, Any]]


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ns_path(base: str, namespace: str, plural: str, name: str | None = None) -> str:
    path = f"{base}/namespaces/{namespace}/{plural}"
    return path if name is None else f"{path}/{name}"


def _pod_path(namespace: str, name: str) -> str:
    return _ns_path("/api/v1", namespace, "pods", name)


def _rs_path(namespace: str, name: str) -> str:
    return _ns_path("/apis/apps/v1", namespace, "replicasets", name)


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _controller_kind(obj: Mapping[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("kind"))
    return None


def _revision(rs: Mapping[str, Any]) -> int:
    return int((rs["metadata"].get("annotations") or {}).get(REVISION_ANNOTATION, 0))


def _owner_ref(obj: Mapping[str, Any], kind: str) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


@dataclass
class RunnerConfig:
    """How pods become processes here. `backoff_scale` and `deadline_scale` divide the kubelet's
    crash back-off and the Deployment's progress deadline, so tests and demos need not wait
    minutes; `env` is added to every container (container env wins), e.g. VLLM_SIM_TIME_SCALE."""

    workdir: Path
    launcher: tuple[str, ...] = SIM_COMMAND
    env: dict[str, str] = field(default_factory=dict)
    backoff_scale: float = 1.0
    deadline_scale: float = 1.0
    poll_interval_s: float = 0.3
    health_interval_s: float = 1.0
    max_grace_s: float = 10.0
    on_targets: Callable[[TargetGroups], None] | None = None


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


class PodRunner:
    """Runs until stopped; use `start_in_thread()`/`stop()` or `await run()` in a loop."""

    def __init__(self, credentials: KubeCredentials, config: RunnerConfig) -> None:
        self.credentials = credentials
        self.config = config
        self._containers: dict[str, Container] = {}  # by pod uid
        self._written: dict[str, Any] = {}  # last status written, by object uid
        self._progress: dict[str, tuple[Any, float]] = {}  # deployment uid -> (signature, time)
        self._targets: TargetGroups | None = None
        self._lock = threading.Lock()
        self._endpoints: dict[tuple[str, str], list[tuple[str, str]]] = {}
        self._pids: set[int] = set()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._running = threading.Event()
        self._http: aiohttp.ClientSession | None = None
        self.ticks = 0
        self.last_error: str | None = None

    @classmethod
    def for_url(cls, url: str, config: RunnerConfig) -> PodRunner:
        return cls(KubeCredentials(server=url.rstrip("/")), config)

    # ------------------------------------------------------------------ in-process queries

    def endpoints(self, namespace: str, deployment: str) -> list[tuple[str, str]]:
        """(pod, base URL) of the Deployment's ready pods, like a Service's endpoints."""
        with self._lock:
            return list(self._endpoints.get((namespace, deployment), []))

    def pids(self) -> set[int]:
        """Every process id this runner has started (running or not), for leak checks."""
        with self._lock:
            return set(self._pids)

    # ------------------------------------------------------------------ lifecycle

    def start_in_thread(self, timeout: float = 10.0) -> PodRunner:
        self._thread = threading.Thread(target=self._thread_main, name="pod-runner", daemon=True)
        self._thread.start()
        if not self._running.wait(timeout):
            raise RuntimeError("the pod runner did not start")
        atexit.register(self.kill_all_now)
        return self

    def _thread_main(self) -> None:
        asyncio.run(self.run())

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop, stop every process (SIGTERM, then SIGKILL), and wait for both."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.kill_all_now()
        atexit.unregister(self.kill_all_now)

    def kill_all_now(self) -> None:
        for container in list(self._containers.values()):
            if container.process is not None:
                container.process.kill_now()

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        client = KubeClient(self.credentials, timeout_s=10.0)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))
        self._running.set()
        try:
            while not self._stop.is_set():
                try:
                    await self.tick(client)
                    self.last_error = None
                except Exception as exc:  # the API may be down for a moment; retry next tick
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("pod runner tick failed: %s", self.last_error)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.config.poll_interval_s)
        finally:
            await asyncio.gather(
                *(self._stop_process(c) for c in list(self._containers.values())),
                return_exceptions=True,
            )
            await self._http.close()
            await client.close()
            self._running.clear()

    # ------------------------------------------------------------------ one step

    async def tick(self, client: KubeClient) -> None:
        deployments = await client.list(DEPLOYMENTS)
        replicasets = await client.list(REPLICASETS)
        pods = await client.list(PODS)
        self.ticks += 1
        present = {o["metadata"]["uid"] for o in (*deployments, *replicasets, *pods)}
        for memo in (self._written, self._progress):
            for gone in [uid for uid in memo if uid not in present]:
                del memo[gone]
        deployment_uids = {d["metadata"]["uid"]: d for d in deployments}
        # ReplicaSets whose Deployment is gone (the garbage collector may be slower than us).
        live_rs: list[dict[str, Any]] = []
        for rs in replicasets:
            owner = _controller_uid(rs)
            if (
                owner is not None
                and owner not in deployment_uids
                and _controller_kind(rs) == ("Deployment")
            ):
                await self._delete(
                    client, _rs_path(rs["metadata"]["namespace"], rs["metadata"]["name"])
                )
            else:
                live_rs.append(rs)
        rs_uids = {rs["metadata"]["uid"]: rs for rs in live_rs}
        live_pods: list[dict[str, Any]] = []
        for pod in pods:
            owner = _controller_uid(pod)
            if owner is not None and owner not in rs_uids and self._owned_by_rs(pod):
                await self._delete_pod(client, pod)
            else:
                live_pods.append(pod)
        try:
            # The kubelet first: stop what is gone, notice exits, probe health.
            await self._sync_kubelet(client, live_pods, rs_uids)
            for deployment in deployments:
                await self._sync_deployment(client, deployment, live_rs, live_pods)
            # Standalone ReplicaSets are reconciled too (a Deployment's are done above).
            for rs in live_rs:
                if _controller_uid(rs) is None:
                    desired = int(rs["spec"].get("replicas", 1))
                    await self._sync_replicaset(client, rs, live_pods, desired)
        finally:
            self._publish()

    @staticmethod
    def _owned_by_rs(pod: Mapping[str, Any]) -> bool:
        return _controller_kind(pod) == "ReplicaSet"

    async def _delete(self, client: KubeClient, path: str) -> None:
        with contextlib.suppress(NotFound):
            await client.request("DELETE", path)

    async def _delete_pod(self, client: KubeClient, pod: Mapping[str, Any]) -> None:
        """Delete through the API and stop the process before returning, so a surge-free
        rollout never has two pods of one Deployment running at once."""
        meta = pod["metadata"]
        await self._delete(client, _pod_path(meta["namespace"], meta["name"]))
        container = self._containers.pop(meta["uid"], None)
        if container is not None:
            await self._stop_process(container)

    async def _stop_process(self, container: Container) -> None:
        if container.process is not None:
            await container.process.stop(container.grace_s)
        container.ready = False

    # ------------------------------------------------------------------ controllers

    async def _sync_deployment(
        self,
        client: KubeClient,
        deployment: dict[str, Any],
        replicasets: list[dict[str, Any]],
        pods: list[dict[str, Any]],
    ) -> None:
        meta, spec = deployment["metadata"], deployment["spec"]
        if meta.get("deletionTimestamp"):
            return
        namespace, uid = meta["namespace"], meta["uid"]
        replicas = int(spec.get("replicas", 1))
        strategy = strategy_of(spec, replicas)
        pod_hash = template_hash(spec.get("template") or {})
        owned = [rs for rs in replicasets if _controller_uid(rs) == uid]
        new = next(
            (
                rs
                for rs in owned
                if rs["metadata"].get("labels", {}).get(TEMPLATE_HASH_LABEL) == pod_hash
            ),
            None,
        )
        top = max((_revision(rs) for rs in owned), default=0)
        if new is None:
            new = await self._create_replicaset(
                client, deployment, pod_hash, top + 1, 0 if owned else replicas
            )
        elif _revision(new) < top:
            # Going back to an earlier template re-uses its ReplicaSet as the newest revision.
            new = await client.merge_patch(
                _rs_path(namespace, new["metadata"]["name"]),
                {"metadata": {"annotations": {REVISION_ANNOTATION: str(top + 1)}}},
            )
        old = [rs for rs in owned if rs["metadata"]["uid"] != new["metadata"]["uid"]]

        def counts(rs: dict[str, Any]) -> RevisionCounts:
            mine = [p for p in pods if _controller_uid(p) == rs["metadata"]["uid"]]
            ready = sum(1 for p in mine if self._is_ready(p))
            return RevisionCounts(
                rs["metadata"]["name"], int(rs["spec"].get("replicas", 0)), len(mine), ready
            )

        new_target, old_targets = rolling_targets(
            replicas, strategy, counts(new), [counts(rs) for rs in old]
        )
        # Scale old revisions down first (their processes are stopped), then the new one up.
        old_counts = []
        for rs in old:
            target = old_targets[rs["metadata"]["name"]]
            scaled = await self._scale(client, rs, target)
            old_counts.append(await self._sync_replicaset(client, scaled, pods, target))
        new = await self._scale(client, new, new_target)
        new_counts = await self._sync_replicaset(client, new, pods, new_target)
        await self._prune_history(client, spec, old, old_targets, old_counts)
        await self._write_deployment_status(
            client,
            deployment,
            new["metadata"]["name"],
            new_counts,
            old_counts,
            0 if strategy.recreate else strategy.max_unavailable,  # as deploymentutil does
        )

    async def _prune_history(
        self,
        client: KubeClient,
        spec: Mapping[str, Any],
        old: list[dict[str, Any]],
        targets: Mapping[str, int],
        counts: list[tuple[int, int]],
    ) -> None:
        """Keep spec.revisionHistoryLimit (default 10) scaled-down old ReplicaSets, for rollback
        by `kubectl rollout undo`; the operator's many trials would otherwise pile them up."""
        limit = int(spec.get("revisionHistoryLimit", 10))
        idle = [
            rs
            for rs, (pods, _) in zip(old, counts, strict=True)
            if targets[rs["metadata"]["name"]] == 0 and pods == 0
        ]
        idle.sort(key=_revision)
        for rs in idle[: max(len(idle) - limit, 0)]:
            await self._delete(
                client, _rs_path(rs["metadata"]["namespace"], rs["metadata"]["name"])
            )

    async def _create_replicaset(
        self,
        client: KubeClient,
        deployment: dict[str, Any],
        pod_hash: str,
        revision: int,
        replicas: int,
    ) -> dict[str, Any]:
        meta, spec = deployment["metadata"], deployment["spec"]
        template = dict(spec.get("template") or {})
        template_meta = dict(template.get("metadata") or {})
        labels = {**(template_meta.get("labels") or {}), TEMPLATE_HASH_LABEL: pod_hash}
        template["metadata"] = {**template_meta, "labels": labels}
        selector = dict(spec.get("selector") or {})
        selector["matchLabels"] = {
            **(selector.get("matchLabels") or {}),
            TEMPLATE_HASH_LABEL: pod_hash,
        }
        rs_name = f"{meta['name']}-{pod_hash}"
        body: dict[str, Any] = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": rs_name,
                "namespace": meta["namespace"],
                "labels": labels,
                "annotations": {
                    REVISION_ANNOTATION: str(revision),
                    "deployment.kubernetes.io/desired-replicas": str(spec.get("replicas", 1)),
                },
                "ownerReferences": [_owner_ref(deployment, "Deployment")],
            },
            "spec": {"replicas": replicas, "selector": selector, "template": template},
        }
        path = _ns_path("/apis/apps/v1", meta["namespace"], "replicasets")
        try:
            return dict(await client.request("POST", path, body=body))
        except Conflict:  # created in an earlier tick whose list we did not see yet
            found = await client.get(_rs_path(meta["namespace"], rs_name))
            if found is None:
                raise
            return found

    async def _scale(self, client: KubeClient, rs: dict[str, Any], target: int) -> dict[str, Any]:
        if int(rs["spec"].get("replicas", 0)) == target:
            return rs
        meta = rs["metadata"]
        return await client.merge_patch(
            _rs_path(meta["namespace"], meta["name"]), {"spec": {"replicas": target}}
        )

    async def _sync_replicaset(
        self, client: KubeClient, rs: dict[str, Any], pods: list[dict[str, Any]], desired: int
    ) -> tuple[int, int]:
        """Create or delete pods until `desired` exist; returns (pods, ready pods)."""
        meta = rs["metadata"]
        mine = [
            p
            for p in pods
            if _controller_uid(p) == meta["uid"] and not p["metadata"].get("deletionTimestamp")
        ]
        if len(mine) > desired:
            # Not-ready pods go first, then the youngest (as the ReplicaSet controller ranks them).
            mine.sort(
                key=lambda p: (self._is_ready(p), p["metadata"].get("creationTimestamp", "")),
                reverse=True,
            )
            for pod in mine[desired:]:
                await self._delete_pod(client, pod)
            mine = mine[:desired]
        for _ in range(desired - len(mine)):
            mine.append(await self._create_pod(client, rs))
        ready = sum(1 for p in mine if self._is_ready(p))
        status = {
            "replicas": len(mine),
            "fullyLabeledReplicas": len(mine),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "observedGeneration": meta.get("generation", 1),
        }
        await self._write_status(
            client, _rs_path(meta["namespace"], meta["name"]), meta["uid"], status
        )
        return len(mine), ready

    async def _create_pod(self, client: KubeClient, rs: dict[str, Any]) -> dict[str, Any]:
        meta = rs["metadata"]
        template = rs["spec"].get("template") or {}
        template_meta = template.get("metadata") or {}
        for _ in range(5):
            body = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{meta['name']}-{random_suffix()}",
                    "namespace": meta["namespace"],
                    "labels": dict(template_meta.get("labels") or {}),
                    "annotations": dict(template_meta.get("annotations") or {}),
                    "ownerReferences": [_owner_ref(rs, "ReplicaSet")],
                },
                "spec": {**(template.get("spec") or {}), "nodeName": "local"},
            }
            try:
                created = dict(
                    await client.request(
                        "POST", _ns_path("/api/v1", meta["namespace"], "pods"), body=body
                    )
                )
            except Conflict:
                continue
            return created
        raise RuntimeError(f"could not name a pod for {meta['name']}")

    async def _write_deployment_status(
        self,
        client: KubeClient,
        deployment: dict[str, Any],
        rs_name: str,
        new_counts: tuple[int, int],
        old_counts: list[tuple[int, int]],
        max_unavailable: int,
    ) -> None:
        meta, spec = deployment["metadata"], deployment["spec"]
        uid = meta["uid"]
        replicas = int(spec.get("replicas", 1))
        updated, new_ready = new_counts
        total = updated + sum(c[0] for c in old_counts)
        ready = new_ready + sum(c[1] for c in old_counts)
        now = time.time()
        signature = (rs_name, updated, new_ready, total, replicas)
        previous = self._progress.get(uid)
        if previous is None or previous[0] != signature:
            self._progress[uid] = (signature, now)
        progress_time = self._progress[uid][1]
        status_now = deployment.get("status") or {}
        old_conditions = {c.get("type"): c for c in status_now.get("conditions") or []}
        stamp = _iso(now)
        available_ok = ready >= replicas - max_unavailable
        available = condition(
            "Available",
            available_ok,
            "MinimumReplicasAvailable" if available_ok else "MinimumReplicasUnavailable",
            "Deployment has minimum availability."
            if available_ok
            else "Deployment does not have minimum availability.",
            stamp,
            old_conditions.get("Available"),
        )
        deadline = float(spec.get("progressDeadlineSeconds", DEFAULT_PROGRESS_DEADLINE_S))
        if updated == replicas and total == replicas and new_ready == replicas:
            state = (True, "NewReplicaSetAvailable", "has successfully progressed")
        elif now - progress_time > deadline / self.config.deadline_scale:
            state = (False, "ProgressDeadlineExceeded", "has timed out progressing")
        else:
            state = (True, "ReplicaSetUpdated", "is progressing")
        progressing = condition(
            "Progressing",
            state[0],
            state[1],
            f'ReplicaSet "{rs_name}" {state[2]}.',
            stamp,
            old_conditions.get("Progressing"),
        )
        progressing["lastUpdateTime"] = _iso(progress_time)
        available["lastUpdateTime"] = available["lastTransitionTime"]
        status = {
            "observedGeneration": meta.get("generation", 1),
            "replicas": total,
            "updatedReplicas": updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(replicas - ready, 0),
            "conditions": [available, progressing],
        }
        path = _ns_path("/apis/apps/v1", meta["namespace"], "deployments", meta["name"])
        await self._write_status(client, path, uid, status)

    async def _write_status(
        self, client: KubeClient, path: str, uid: str, status: dict[str, Any]
    ) -> None:
        """Write only on change: the operator watches these objects and every write wakes it."""
        if self._written.get(uid) == status:
            return
        with contextlib.suppress(NotFound):
            await client.merge_patch(path, {"status": status}, subresource="status")
            self._written[uid] = status

    def _is_ready(self, pod: Mapping[str, Any]) -> bool:
        container = self._containers.get(pod["metadata"]["uid"])
        return container is not None and container.ready

    # ------------------------------------------------------------------ kubelet

    async def _sync_kubelet(
        self, client: KubeClient, pods: list[dict[str, Any]], replicasets: dict[str, Any]
    ) -> None:
        seen: set[str] = set()
        active: list[tuple[dict[str, Any], Container]] = []
        for pod in pods:
            meta = pod["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            if meta.get("deletionTimestamp"):
                gone = self._containers.pop(uid, None)
                if gone is not None:
                    await self._stop_process(gone)
                if not meta.get("finalizers"):
                    with contextlib.suppress(NotFound):
                        await client.request(
                            "DELETE",
                            _pod_path(meta["namespace"], meta["name"]),
                            body={"gracePeriodSeconds": 0},
                        )
                continue
            container = self._containers.get(uid)
            if container is None:
                container = self._admit(pod, replicasets)
                self._containers[uid] = container
            self._drive(container)
            if container.published_port != container.port:
                with contextlib.suppress(NotFound):
                    await client.merge_patch(
                        _pod_path(container.namespace, container.pod),
                        {"metadata": {"annotations": {PORT_ANNOTATION: str(container.port)}}},
                    )
                container.published_port = container.port
            active.append((pod, container))
        for uid in [u for u in self._containers if u not in seen]:
            await self._stop_process(self._containers.pop(uid))
        await asyncio.gather(*(self._probe(c) for _, c in active if c.alive()))
        for pod, container in active:
            meta = pod["metadata"]
            await self._write_status(
                client,
                _pod_path(meta["namespace"], meta["name"]),
                meta["uid"],
                self._pod_status(container),
            )

    def _admit(self, pod: dict[str, Any], replicasets: Mapping[str, Any]) -> Container:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        first: dict[str, Any] = (spec.get("containers") or [{}])[0]
        owner: str | None = None
        rs = replicasets.get(_controller_uid(pod) or "")
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
        with self._lock:
            self._pids.add(process.pid)
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
                "startedAt": _iso(process.started_at),
                "finishedAt": _iso(finished),
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
                "lastTransitionTime": _iso(since[1]),
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
            state = {"running": {"startedAt": _iso(process.started_at)}}
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
            "startTime": _iso(container.start_time),
            "containerStatuses": [status],
        }

    def _publish(self) -> None:
        groups: TargetGroups = []
        endpoints: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for container in sorted(self._containers.values(), key=lambda c: (c.namespace, c.pod)):
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
        with self._lock:
            self._endpoints = endpoints
        if groups != self._targets:
            self._targets = groups
            if self.config.on_targets is not None:
                self.config.on_targets(groups)
