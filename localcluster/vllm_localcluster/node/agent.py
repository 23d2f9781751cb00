"""The node agent: our code plays only the nodes of the cluster, in the manner of KWOK.

It registers Nodes (ready, with GPUs to schedule on), and every tick (0.3 s) lists the pods
the scheduler bound to them, runs each as a process (kubelet.py), probes readiness, honours
deletion as the kubelet does, and writes pod status when it changed. Everything else is the
real control plane: the Deployment and ReplicaSet controllers create and delete the pods,
kube-scheduler binds them, the EndpointSlice controller publishes their endpoints, the garbage
collector follows owner references.

A relist rather than a watch: the agent must poll processes and readiness endpoints anyway,
a list of the pods on its nodes from the API server's watch cache (resourceVersion=0) is cheap,
and a missed event can never leave a pod stuck.

The nodes: `localcluster` without a GPU product label (pods that pin none land there) and one
node per GPU the simulator knows, labelled with NVIDIA GPU Feature Discovery's
`nvidia.com/gpu.product` value, so a pod's nodeSelector picks the simulated GPU as it would
pick a node in a cluster. Those carry a PreferNoSchedule taint, so that a pod pinning no GPU
lands on `localcluster` and runs the simulator's default GPU.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_localcluster.kubeapi import ApiError, AsyncApi, Endpoint
from vllm_localcluster.node.kubelet import Container, Kubelet, KubeletConfig, iso

log = logging.getLogger(__name__)

KUBELET_VERSION = "v1.33.13"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class NodeSpec:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # what every pod here gets
    gpus: int = 16
    taints: tuple[dict[str, str], ...] = ()


def default_nodes() -> list[NodeSpec]:
    products = {
        "NVIDIA-H100-80GB-HBM3": "H100",
        "NVIDIA-H200": "H200",
        "NVIDIA-A100-SXM4-80GB": "A100-80GB",
        "NVIDIA-A100-SXM4-40GB": "A100-40GB",
        "NVIDIA-L40S": "L40S",
        "NVIDIA-B200": "B200",
    }
    nodes = [NodeSpec("localcluster")]
    for product, gpu in products.items():
        name = f"localcluster-{gpu.lower()}"
        taint = {"key": "vllm-localcluster/gpu-product", "value": gpu, "effect": "PreferNoSchedule"}
        labels = {"nvidia.com/gpu.product": product}
        nodes.append(NodeSpec(name, labels, {"VLLM_SIM_GPU": gpu}, taints=(taint,)))
    return nodes


def node_object(spec: NodeSpec) -> dict[str, Any]:
    labels = {
        "kubernetes.io/hostname": spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "vllm-localcluster",
        **spec.labels,
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": spec.name, "labels": labels},
        "spec": {},
    }


def node_status(spec: NodeSpec) -> dict[str, Any]:
    now = iso(time.time())
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU_RESOURCE: str(spec.gpus)}
    return {
        "capacity": capacity,
        "allocatable": capacity,
        "addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"},
            {"type": "Hostname", "address": spec.name},
        ],
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "vllm-localcluster node agent is posting ready status",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
        ],
        "nodeInfo": {
            "kubeletVersion": KUBELET_VERSION,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
            "containerRuntimeVersion": "vllm-localcluster://1",
            "osImage": "vllm-localcluster",
            "kernelVersion": "",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        },
    }


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


class NodeAgent:
    """Runs until stopped; `start_in_thread()`/`stop()`, or `await run()` in a loop."""

    def __init__(
        self,
        endpoint: Endpoint,
        config: KubeletConfig,
        nodes: Sequence[NodeSpec] | None = None,
        poll_interval_s: float = 0.3,
    ) -> None:
        self.endpoint = endpoint
        self.config = config
        self.nodes = list(nodes or default_nodes())
        self.node_names = {n.name for n in self.nodes}
        self.poll_interval_s = poll_interval_s
        self.kubelet = Kubelet(config, {n.name: n.env for n in self.nodes})
        self._written: dict[str, Any] = {}  # pod uid -> last status written
        self._targets: list[dict[str, Any]] | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._running = threading.Event()
        self._failed: BaseException | None = None
        self.ticks = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ what callers use

    def pids(self) -> set[int]:
        """Every process id this agent has started (running or not), for leak checks."""
        with self.kubelet.lock:
            return set(self.kubelet.pids)

    def container(self, namespace: str, pod: str) -> Container | None:
        for container in list(self.kubelet.containers.values()):
            if (container.namespace, container.pod) == (namespace, pod):
                return container
        return None

    # ------------------------------------------------------------------ lifecycle

    def start_in_thread(self, timeout: float = 30.0) -> NodeAgent:
        self._thread = threading.Thread(target=self._thread_main, name="node-agent", daemon=True)
        self._thread.start()
        if not self._running.wait(timeout):
            raise RuntimeError(f"the node agent did not start: {self._failed or 'timeout'}")
        atexit.register(self.kubelet.kill_all_now)
        return self

    def _thread_main(self) -> None:
        try:
            asyncio.run(self.run())
        except BaseException as exc:
            self._failed = exc
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop, stop every process (SIGTERM, then SIGKILL), and wait for both."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.kubelet.kill_all_now()
        atexit.unregister(self.kubelet.kill_all_now)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        api = AsyncApi(self.endpoint)
        await self.kubelet.open()
        try:
            await self.register(api)
            self._running.set()
            while not self._stop.is_set():
                try:
                    await self.tick(api)
                    self.last_error = None
                except Exception as exc:  # the API may be down for a moment; retry next tick
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("node agent tick failed: %s", self.last_error)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.poll_interval_s)
        finally:
            await self.kubelet.close()
            await api.close()
            self._running.clear()

    async def register(self, api: AsyncApi) -> None:
        for spec in self.nodes:
            try:
                await api.request("POST", "/api/v1/nodes", node_object(spec))
            except ApiError as exc:
                if exc.status != 409:
                    raise
            await api.request(
                "PATCH",
                f"/api/v1/nodes/{spec.name}/status",
                {"status": node_status(spec)},
                content_type="application/strategic-merge-patch+json",
            )
            # The API server's TaintNodesByCondition admission gives a new node the
            # not-ready taint; in a cluster the node lifecycle controller lifts it once the
            # kubelet reports Ready. That controller also evicts pods from nodes whose
            # heartbeats stop, which a node that lives and dies with this process does not
            # need: it is not run, and the agent lifts the taint itself.
            taints = [dict(t) for t in spec.taints] or None
            await api.merge_patch(f"/api/v1/nodes/{spec.name}", {"spec": {"taints": taints}})

    # ------------------------------------------------------------------ one tick

    async def tick(self, api: AsyncApi) -> None:
        pods = await api.list("/api/v1/pods", fieldSelector="spec.nodeName!=", resourceVersion="0")
        mine = [p for p in pods if (p.get("spec") or {}).get("nodeName") in self.node_names]
        self.ticks += 1
        seen: set[str] = set()
        for pod in mine:
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            await self._sync_pod(api, pod)
        for uid in [u for u in self.kubelet.containers if u not in seen]:
            # Gone from the API without us (a force delete): the process goes too.
            gone = self.kubelet.forget(uid)
            if gone is not None and gone.process is not None:
                gone.process.kill_now()
            self._written.pop(uid, None)
        alive = [c for c in self.kubelet.containers.values() if c.alive()]
        await asyncio.gather(*(self.kubelet.probe(c) for c in alive))
        for pod in mine:
            container = self.kubelet.containers.get(pod["metadata"]["uid"])
            if container is not None:
                await self._write_status(api, pod, container)
        self._publish()

    async def _sync_pod(self, api: AsyncApi, pod: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        container = self.kubelet.containers.get(meta["uid"])
        if meta.get("deletionTimestamp"):
            if container is None or container.process is None:
                await self._remove(api, pod)
                return
            self.kubelet.begin_termination(container, pod)
            if container.terminated is not None:
                await self._write_status(api, pod, container)
                await self._remove(api, pod)
            return
        if container is None:
            container = self.kubelet.admit(pod)
        self.kubelet.drive(container)

    async def _remove(self, api: AsyncApi, pod: Mapping[str, Any]) -> None:
        """The kubelet's last word on a pod: delete it with grace 0 once nothing runs."""
        meta = pod["metadata"]
        self.kubelet.forget(meta["uid"])
        self._written.pop(meta["uid"], None)
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
        with contextlib.suppress(ApiError):
            await api.request("DELETE", pod_path(meta["namespace"], meta["name"]), body)

    async def _write_status(
        self, api: AsyncApi, pod: Mapping[str, Any], container: Container
    ) -> None:
        status = self.kubelet.pod_status(container)
        if self._written.get(container.uid) == status:
            return
        meta = pod["metadata"]
        try:
            await api.request(
                "PATCH",
                pod_path(meta["namespace"], meta["name"]) + "/status",
                {"status": status},
                content_type="application/strategic-merge-patch+json",
            )
        except ApiError as exc:
            if exc.status != 404:
                raise
        self._written[container.uid] = status

    def _publish(self) -> None:
        targets = self.kubelet.targets()
        if targets != self._targets:
            self._targets = targets
            if self.config.on_targets is not None:
                self.config.on_targets(targets)
