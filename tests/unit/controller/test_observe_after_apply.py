"""The observer is told what to read next only once the reconcile's applies went through.

A rollout whose apply the API server refused never ran; asking Prometheus for its window made
the next reconcile see "no ready pods" and hold, so every other retry of the rollout was lost
(tests/integration/reliability/test_api_faults.py counted too few retries).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, cast

import pytest

from tests.support.cluster_api import CR, POLICY
from tests.unit.core.test_decide import make_snapshot
from vllm_autotuner.adapters.kube import KubeClient, KubeError
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.controller import Controller
from vllm_autotuner.core.snapshot import Snapshot
from vllm_autotuner.observer import Observer


class Kube:
    """Stands in for KubeClient; `apply` fails with `apply_status` when it is set."""

    def __init__(self, apply_status: int | None) -> None:
        self.apply_status = apply_status

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        if self.apply_status is not None:
            raise KubeError(self.apply_status, "injected")
        return manifest

    async def get(self, path: str) -> dict[str, Any] | None:
        return None

    async def merge_patch(
        self, path: str, body: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": "6"}, **body}


NAME = "llama"


def body() -> dict[str, Any]:
    cr: dict[str, Any] = copy.deepcopy(dict(CR))
    cr["metadata"].update(namespace="default", uid="u-1", resourceVersion="5", generation=1)
    return cr


async def reconcile(apply_status: int | None, observer: Observer) -> None:
    controller = Controller(cast(KubeClient, Kube(apply_status)), observer=observer)
    await controller.reconcile(
        body(),
        policies={"default": cast(dict[str, Any], copy.deepcopy(POLICY["spec"]))},
        namespace_labels={},
        children={"Deployment": None, "Service": None},
    )


async def test_a_reconcile_that_applied_asks_for_the_next_window() -> None:
    observer = Observer(None)
    await reconcile(None, observer)
    assert ("default", NAME) in observer._targets


async def test_a_failed_apply_leaves_the_observer_as_it_was() -> None:
    observer = Observer(None)
    with pytest.raises(KubeError):
        await reconcile(500, observer)
    assert observer._targets == {}


class WholeObjectKube(Kube):
    """Its status writes return the whole object, as the API server does (the controller
    reconciles the next time from what the write returned)."""

    async def merge_patch(
        self, path: str, patch: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        whole = {**body(), **patch}
        whole["metadata"]["resourceVersion"] = "6"
        return whole


class Windows:
    """A snapshot source that answers each target with a window of `completed` requests."""

    def __init__(self, completed: int) -> None:
        self.completed = completed

    async def snapshots(
        self, targets: Sequence[SnapshotTarget], now: datetime
    ) -> dict[tuple[str, str], Snapshot]:
        return {
            t.key: replace(make_snapshot(completed=self.completed), time=now, window_s=t.window_s)
            for t in targets
        }


@pytest.mark.parametrize(("completed", "window_s"), [(1200, 300.0), (126, 600.0), (3, 1800.0)])
async def test_a_quiet_deployment_is_asked_for_a_longer_window(
    completed: int, window_s: float
) -> None:
    """Fewer requests in a window than the policy's minRequestsPerWindow (200) is no
    decision: the next window reads back far enough to count them (evidence_window_s)."""
    observer = Observer(Windows(completed))
    controller = Controller(cast(KubeClient, WholeObjectKube(None)), observer=observer)

    async def once() -> None:
        await controller.reconcile(
            body(),
            policies={"default": cast(dict[str, Any], copy.deepcopy(POLICY["spec"]))},
            namespace_labels={},
            children={"Deployment": None, "Service": None},
        )

    await once()
    assert observer._targets[("default", NAME)].window_s == 300.0  # nothing seen yet
    await observer.refresh()
    await once()
    assert observer._targets[("default", NAME)].window_s == window_s
