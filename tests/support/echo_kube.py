"""An in-memory stand-in for KubeClient for controller unit tests that need no API server.

Applies are echoed and remembered (a later `get` of the same object finds it); status patches
are merged into `status`, which the test feeds back as the next reconcile's body; `conditions`
keeps each condition's latest status. The controller's behaviour against the real
kube-apiserver is covered by tests/integration.
"""

from __future__ import annotations

import copy
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from vllm_autotuner.adapters.kube import object_path


class EchoKube:
    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []
        self.status: dict[str, Any] = {}
        self.conditions: dict[str, str] = {}
        self.objects: dict[str, dict[str, Any]] = {}
        self.deleted: list[str] = []

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Echoes the manifest, with the uid the API server would give it (kept across
        applies of the same object)."""
        path = object_path(manifest)
        old = self.objects.get(path)
        live = copy.deepcopy(manifest)
        uid = old["metadata"]["uid"] if old is not None else str(uuid.uuid4())
        live["metadata"]["uid"] = uid
        self.applied.append(live)
        self.objects[path] = live
        return copy.deepcopy(live)

    async def get(self, path: str) -> dict[str, Any] | None:
        found = self.objects.get(path)
        return copy.deepcopy(found) if found is not None else None

    async def delete(self, path: str) -> bool:
        self.deleted.append(path)
        return self.objects.pop(path, None) is not None

    async def merge_patch(
        self, path: str, body: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        self.status = merge_patch(self.status, body["status"])
        for cond in body["status"].get("conditions") or []:
            self.conditions[cond["type"]] = cond["status"]
        return {}


def merge_patch(target: Any, patch: Any) -> Any:
    """JSON merge patch (RFC 7386), as the API server applies it: objects merge key by key,
    null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _controller_ref(owner: dict[str, Any], kind: str) -> dict[str, Any]:
    meta = owner["metadata"]
    return {"apiVersion": "apps/v1", "kind": kind, "name": meta["name"], "uid": meta["uid"],
            "controller": True}  # fmt: skip


def ready_pod(deployment: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pod of `deployment`, ready for an hour, and the ReplicaSet that controls it (the
    controller counts only pods a ReplicaSet of its Deployments controls)."""
    template = deployment["spec"]["template"]["metadata"]
    replicaset = {
        "metadata": {
            "name": f"{deployment['metadata']['name']}-rs",
            "namespace": "default",
            "uid": str(uuid.uuid4()),
            "ownerReferences": [_controller_ref(deployment, "Deployment")],
        }
    }
    ready = (datetime.now(tz=UTC) - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    pod = {
        "metadata": {
            "name": "pod-1",
            "namespace": "default",
            "labels": dict(template["labels"]),
            "annotations": dict(template["annotations"]),
            "ownerReferences": [_controller_ref(replicaset, "ReplicaSet")],
        },
        "status": {
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": ready}],
            "containerStatuses": [{"name": "vllm", "ready": True, "restartCount": 0}],
        },
    }
    return pod, replicaset
