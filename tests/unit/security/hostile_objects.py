"""Shared pieces of the hostile-tenant corpora (issue classes 1-10): base objects, editing,
and a recording stand-in for the Kubernetes client."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, cast

from tests.unit.security.corpus import DEPLOYMENT, POLICY
from vllm_autotuner.adapters.kube import KubeClient, KubeError
from vllm_autotuner.controller import Controller, Outcome

DELETE = object()
NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


def edited(base: Mapping[str, Any], changes: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """A deep copy of `base` with (dotted path, value) changes; `[n]` indexes a list."""
    obj = copy.deepcopy(dict(base))
    for path, value in changes:
        node: Any = obj
        parts = path.split(".")
        for part in parts[:-1]:
            node = _step(node, part)
        leaf = parts[-1]
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value  # not copied: deep values are built per case and never shared
    return obj


def _step(node: Any, part: str) -> Any:
    if part.endswith("]"):
        name, index = part[:-1].split("[")
        return node.setdefault(name, [{}])[int(index)]
    return node.setdefault(part, {})


def deployment(*changes: tuple[str, Any]) -> dict[str, Any]:
    return edited(DEPLOYMENT, changes)


def policy(*changes: tuple[str, Any]) -> dict[str, Any]:
    return edited(POLICY, changes)


class RecordingKube:
    """Stands in for KubeClient: records writes, serves `objects` on GET, can refuse applies."""

    def __init__(
        self,
        objects: Mapping[str, Mapping[str, Any]] | None = None,
        refuse_apply: KubeError | None = None,
    ) -> None:
        self.objects = {k: dict(v) for k, v in (objects or {}).items()}
        self.refuse_apply = refuse_apply
        self.applied: list[dict[str, Any]] = []
        self.apply_attempts = 0
        self.patches: list[dict[str, Any]] = []
        self.gets: list[str] = []

    async def apply(self, manifest: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        self.apply_attempts += 1
        if self.refuse_apply is not None:
            raise self.refuse_apply
        self.applied.append(copy.deepcopy(manifest))
        return manifest

    async def get(self, path: str) -> dict[str, Any] | None:
        self.gets.append(path)
        found = self.objects.get(path)
        return dict(found) if found is not None else None

    async def merge_patch(
        self, path: str, body: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        self.patches.append(copy.deepcopy(body))
        return body


class Clock:
    """A clock a test moves by hand."""

    def __init__(self, now: datetime = NOW) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def controller(kube: RecordingKube, clock: Clock | None = None) -> Controller:
    return Controller(cast(KubeClient, kube), clock=clock or Clock())


def reconcile(
    obj: Mapping[str, Any],
    *,
    kube: RecordingKube | None = None,
    policies: Mapping[str, Mapping[str, Any]] | None = None,
    namespace_labels: Mapping[str, str] | None = None,
    children: Mapping[str, Mapping[str, Any] | None] | None = None,
    ctl: Controller | None = None,
    **extra: Any,
) -> tuple[RecordingKube, Outcome]:
    kube = kube or RecordingKube()
    ctl = ctl or controller(kube)
    outcome = asyncio.run(
        ctl.reconcile(
            obj,
            policies={"default": POLICY["spec"]} if policies is None else policies,
            namespace_labels=namespace_labels or {},
            children=children or {"Deployment": None, "Service": None},
            **extra,
        )
    )
    return kube, outcome


def last_status(kube: RecordingKube) -> dict[str, Any]:
    assert kube.patches, "the operator wrote no status"
    status: dict[str, Any] = {}
    for patch in kube.patches:
        status.update(patch["status"])
    return status


def conditions(kube: RecordingKube) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in last_status(kube).get("conditions", [])}
