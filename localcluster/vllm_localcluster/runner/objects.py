"""Paths, owner references and status writes: the small vocabulary both halves of the runner
(controllers and kubelet) use to talk to the API server."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_autotuner.adapters.kube import KubeClient, NotFound
from vllm_localcluster.runner.container import SIM_COMMAND
from vllm_localcluster.runner.workloads import REVISION_ANNOTATION

PODS = "/api/v1/pods"
REPLICASETS = "/apis/apps/v1/replicasets"
DEPLOYMENTS = "/apis/apps/v1/deployments"

TargetGroups = list[dict[str, Any]]


@dataclass
class RunnerConfig:
    """How pods become processes here. `backoff_scale` and `deadline_scale` divide the kubelet's
    crash back-off and the Deployment's progress deadline, so tests and demos need not wait
    minutes; `env` is added to every container (container env wins), e.g. VLLM_SIM_TIME_SCALE;
    `on_targets` receives the file-SD target groups whenever they change."""

    workdir: Path
    launcher: tuple[str, ...] = SIM_COMMAND
    env: dict[str, str] = field(default_factory=dict)
    backoff_scale: float = 1.0
    deadline_scale: float = 1.0
    poll_interval_s: float = 0.3
    health_interval_s: float = 1.0
    max_grace_s: float = 10.0
    on_targets: Callable[[TargetGroups], None] | None = None


def iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ns_path(base: str, namespace: str, plural: str, name: str | None = None) -> str:
    path = f"{base}/namespaces/{namespace}/{plural}"
    return path if name is None else f"{path}/{name}"


def pod_path(namespace: str, name: str) -> str:
    return ns_path("/api/v1", namespace, "pods", name)


def rs_path(namespace: str, name: str) -> str:
    return ns_path("/apis/apps/v1", namespace, "replicasets", name)


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def controller_kind(obj: Mapping[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("kind"))
    return None


def revision(rs: Mapping[str, Any]) -> int:
    return int((rs["metadata"].get("annotations") or {}).get(REVISION_ANNOTATION, 0))


def owner_ref(obj: Mapping[str, Any], kind: str) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


class StatusWriter:
    """Writes status only on change: the operator watches these objects and every write wakes
    it. Remembers the last status written per object uid."""

    def __init__(self) -> None:
        self._written: dict[str, Any] = {}

    async def write(self, client: KubeClient, path: str, uid: str, status: dict[str, Any]) -> None:
        if self._written.get(uid) == status:
            return
        with contextlib.suppress(NotFound):
            await client.merge_patch(path, {"status": status}, subresource="status")
            self._written[uid] = status

    def keep_only(self, present: set[str]) -> None:
        for gone in [uid for uid in self._written if uid not in present]:
            del self._written[gone]
