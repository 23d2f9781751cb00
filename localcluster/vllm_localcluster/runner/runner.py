"""The pod runner: Deployment and ReplicaSet controllers here, a kubelet (kubelet.py), one loop.

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
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from vllm_autotuner.adapters.kube import Conflict, KubeClient, KubeCredentials, NotFound
from vllm_localcluster.runner.kubelet import Kubelet
from vllm_localcluster.runner.objects import (
    DEPLOYMENTS,
    PODS,
    REPLICASETS,
    RunnerConfig,
    StatusWriter,
    TargetGroups,
    controller_kind,
    controller_uid,
    iso,
    ns_path,
    owner_ref,
    pod_path,
    revision,
    rs_path,
)
from vllm_localcluster.runner.workloads import (
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


class PodRunner:
    """Runs until stopped; use `start_in_thread()`/`stop()` or `await run()` in a loop.

    The Deployment and ReplicaSet controllers live here; the kubelet in `kubelet.py`."""

    def __init__(self, credentials: KubeCredentials, config: RunnerConfig) -> None:
        self.credentials = credentials
        self.config = config
        self.status = StatusWriter()
        self.kubelet = Kubelet(config, self.status)
        self._progress: dict[str, tuple[Any, float]] = {}  # deployment uid -> (signature, time)
        self._targets: TargetGroups | None = None
        self._lock = threading.Lock()
        self._endpoints: dict[tuple[str, str], list[tuple[str, str]]] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._running = threading.Event()
        self.ticks = 0
        self.last_error: str | None = None

    @classmethod
    def for_url(cls, url: str, config: RunnerConfig) -> PodRunner:
        return cls(KubeCredentials.for_server(url.rstrip("/")), config)

    def endpoints(self, namespace: str, deployment: str) -> list[tuple[str, str]]:
        """(pod, base URL) of the Deployment's ready pods, like a Service's endpoints."""
        with self._lock:
            return list(self._endpoints.get((namespace, deployment), []))

    def pids(self) -> set[int]:
        """Every process id this runner has started (running or not), for leak checks."""
        with self.kubelet.lock:
            return set(self.kubelet.pids)

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
        self.kubelet.kill_all_now()

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        client = KubeClient(self.credentials, timeout_s=10.0)
        await self.kubelet.open()
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
            await self.kubelet.close()
            await client.close()
            self._running.clear()

    async def tick(self, client: KubeClient) -> None:
        deployments = await client.list(DEPLOYMENTS)
        replicasets = await client.list(REPLICASETS)
        pods = await client.list(PODS)
        self.ticks += 1
        present = {o["metadata"]["uid"] for o in (*deployments, *replicasets, *pods)}
        self.status.keep_only(present)
        for gone in [uid for uid in self._progress if uid not in present]:
            del self._progress[gone]
        deployment_uids = {d["metadata"]["uid"]: d for d in deployments}
        # ReplicaSets whose Deployment is gone (the garbage collector may be slower than us).
        live_rs: list[dict[str, Any]] = []
        for rs in replicasets:
            owner = controller_uid(rs)
            if (
                owner is not None
                and owner not in deployment_uids
                and controller_kind(rs) == ("Deployment")
            ):
                await self._delete(
                    client, rs_path(rs["metadata"]["namespace"], rs["metadata"]["name"])
                )
            else:
                live_rs.append(rs)
        rs_uids = {rs["metadata"]["uid"]: rs for rs in live_rs}
        live_pods: list[dict[str, Any]] = []
        for pod in pods:
            owner = controller_uid(pod)
            if owner is not None and owner not in rs_uids and self._owned_by_rs(pod):
                await self._delete_pod(client, pod)
            else:
                live_pods.append(pod)
        try:
            # The kubelet first: stop what is gone, notice exits, probe health.
            await self.kubelet.sync(client, live_pods, rs_uids)
            for deployment in deployments:
                await self._sync_deployment(client, deployment, live_rs, live_pods)
            # Standalone ReplicaSets are reconciled too (a Deployment's are done above).
            for rs in live_rs:
                if controller_uid(rs) is None:
                    desired = int(rs["spec"].get("replicas", 1))
                    await self._sync_replicaset(client, rs, live_pods, desired)
        finally:
            self._publish()

    @staticmethod
    def _owned_by_rs(pod: Mapping[str, Any]) -> bool:
        return controller_kind(pod) == "ReplicaSet"

    async def _delete(self, client: KubeClient, path: str) -> None:
        with contextlib.suppress(NotFound):
            await client.request("DELETE", path)

    async def _delete_pod(self, client: KubeClient, pod: Mapping[str, Any]) -> None:
        """Delete through the API and stop the process before returning, so a surge-free
        rollout never has two pods of one Deployment running at once."""
        meta = pod["metadata"]
        await self._delete(client, pod_path(meta["namespace"], meta["name"]))
        await self.kubelet.forget(meta["uid"])

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
        owned = [rs for rs in replicasets if controller_uid(rs) == uid]
        new = next(
            (
                rs
                for rs in owned
                if rs["metadata"].get("labels", {}).get(TEMPLATE_HASH_LABEL) == pod_hash
            ),
            None,
        )
        top = max((revision(rs) for rs in owned), default=0)
        if new is None:
            new = await self._create_replicaset(
                client, deployment, pod_hash, top + 1, 0 if owned else replicas
            )
        elif revision(new) < top:
            # Going back to an earlier template re-uses its ReplicaSet as the newest revision.
            new = await client.merge_patch(
                rs_path(namespace, new["metadata"]["name"]),
                {"metadata": {"annotations": {REVISION_ANNOTATION: str(top + 1)}}},
            )
        old = [rs for rs in owned if rs["metadata"]["uid"] != new["metadata"]["uid"]]

        def counts(rs: dict[str, Any]) -> RevisionCounts:
            mine = [p for p in pods if controller_uid(p) == rs["metadata"]["uid"]]
            ready = sum(1 for p in mine if self.kubelet.is_ready(p))
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
        idle.sort(key=revision)
        for rs in idle[: max(len(idle) - limit, 0)]:
            await self._delete(client, rs_path(rs["metadata"]["namespace"], rs["metadata"]["name"]))

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
                "ownerReferences": [owner_ref(deployment, "Deployment")],
            },
            "spec": {"replicas": replicas, "selector": selector, "template": template},
        }
        path = ns_path("/apis/apps/v1", meta["namespace"], "replicasets")
        try:
            return dict(await client.request("POST", path, body=body))
        except Conflict:  # created in an earlier tick whose list we did not see yet
            found = await client.get(rs_path(meta["namespace"], rs_name))
            if found is None:
                raise
            return found

    async def _scale(self, client: KubeClient, rs: dict[str, Any], target: int) -> dict[str, Any]:
        if int(rs["spec"].get("replicas", 0)) == target:
            return rs
        meta = rs["metadata"]
        return await client.merge_patch(
            rs_path(meta["namespace"], meta["name"]), {"spec": {"replicas": target}}
        )

    async def _sync_replicaset(
        self, client: KubeClient, rs: dict[str, Any], pods: list[dict[str, Any]], desired: int
    ) -> tuple[int, int]:
        """Create or delete pods until `desired` exist; returns (pods, ready pods)."""
        meta = rs["metadata"]
        mine = [
            p
            for p in pods
            if controller_uid(p) == meta["uid"] and not p["metadata"].get("deletionTimestamp")
        ]
        if len(mine) > desired:
            # Keep ready and older pods; not-ready, then the youngest, go first (as the
            # ReplicaSet controller ranks them).
            def rank(pod: dict[str, Any]) -> tuple[bool, str]:
                return (
                    not self.kubelet.is_ready(pod),
                    pod["metadata"].get("creationTimestamp", ""),
                )

            mine.sort(key=rank)
            for pod in mine[desired:]:
                await self._delete_pod(client, pod)
            mine = mine[:desired]
        for _ in range(desired - len(mine)):
            mine.append(await self._create_pod(client, rs))
        ready = sum(1 for p in mine if self.kubelet.is_ready(p))
        status = {
            "replicas": len(mine),
            "fullyLabeledReplicas": len(mine),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "observedGeneration": meta.get("generation", 1),
        }
        await self.status.write(
            client, rs_path(meta["namespace"], meta["name"]), meta["uid"], status
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
                    "ownerReferences": [owner_ref(rs, "ReplicaSet")],
                },
                "spec": {**(template.get("spec") or {}), "nodeName": "local"},
            }
            try:
                created = dict(
                    await client.request(
                        "POST", ns_path("/api/v1", meta["namespace"], "pods"), body=body
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
        stamp = iso(now)
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
        progressing["lastUpdateTime"] = iso(progress_time)
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
        path = ns_path("/apis/apps/v1", meta["namespace"], "deployments", meta["name"])
        await self.status.write(client, path, uid, status)

    def _publish(self) -> None:
        groups, endpoints = self.kubelet.targets_and_endpoints()
        with self._lock:
            self._endpoints = endpoints
        if groups != self._targets:
            self._targets = groups
            if self.config.on_targets is not None:
                self.config.on_targets(groups)
