"""A reconcile from a copy of the VLLMDeployment older than our own last status write decides
from that write, not from the older state (an index or kopf body can lag the watch)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any, cast

from tests.support.cluster_api import CR, POLICY
from vllm_autotuner.adapters.kube import KubeClient
from vllm_autotuner.controller import Controller


class ApiServerKube:
    """Stands in for KubeClient: keeps the CR, bumps resourceVersion on every write and answers
    a status patch with the whole object, as kube-apiserver does."""

    def __init__(self, cr: dict[str, Any]) -> None:
        self.cr = copy.deepcopy(cr)
        self.cr["metadata"].update(
            namespace="default", uid="u-1", resourceVersion="5", generation=1
        )
        self.patches: list[dict[str, Any]] = []

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.cr)

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return manifest

    async def get(self, path: str) -> dict[str, Any] | None:
        return None  # no object of that name exists yet

    async def merge_patch(
        self, path: str, body: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        assert subresource == "status"
        self.patches.append(copy.deepcopy(body))
        status = self.cr.setdefault("status", {})
        status.update(copy.deepcopy(body["status"]))
        rv = int(self.cr["metadata"]["resourceVersion"]) + 1
        self.cr["metadata"]["resourceVersion"] = str(rv)
        return self.snapshot()


NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


async def _reconcile(controller: Controller, body: dict[str, Any]) -> None:
    await controller.reconcile(
        body,
        policies={"default": copy.deepcopy(POLICY["spec"])},
        namespace_labels={},
        children={"Deployment": None, "Service": None},
    )


async def _second_patch(second_body_is_stale: bool) -> tuple[dict[str, Any] | None, Controller]:
    """Reconcile, then reconcile again from the old copy or from the object after our write;
    return what the second reconcile patched."""
    kube = ApiServerKube(CR)
    controller = Controller(cast(KubeClient, kube), clock=lambda: NOW)
    before = kube.snapshot()  # what an index holds until the watch delivers our write
    await _reconcile(controller, before)
    assert kube.patches, "the first reconcile writes status"
    count = len(kube.patches)
    await _reconcile(controller, before if second_body_is_stale else kube.snapshot())
    return (kube.patches[-1] if len(kube.patches) > count else None), controller


async def test_a_stale_copy_decides_exactly_as_the_object_after_our_write() -> None:
    """Deciding from the state before our write would, mid-trial, repeat or undo a step (the
    soak at 12 deployments re-applied trials it had just rolled back)."""
    from_fresh, _ = await _second_patch(second_body_is_stale=False)
    from_stale, controller = await _second_patch(second_body_is_stale=True)
    assert from_stale == from_fresh
    # The controller still holds its copy: the watch has not caught up in this story.
    assert ("default", CR["metadata"]["name"]) in controller._written


async def test_our_copy_is_let_go_once_the_watch_catches_up() -> None:
    kube = ApiServerKube(CR)
    controller = Controller(cast(KubeClient, kube), clock=lambda: NOW)
    await _reconcile(controller, kube.snapshot())
    key = ("default", CR["metadata"]["name"])
    assert key in controller._written
    caught_up = kube.snapshot()
    assert controller._freshest_self(*key, caught_up) is caught_up
    assert key not in controller._written


async def test_without_a_write_the_given_body_is_used_as_is() -> None:
    kube = ApiServerKube(CR)
    controller = Controller(cast(KubeClient, kube))
    body = kube.snapshot()
    assert controller._freshest_self("default", CR["metadata"]["name"], body) is body
