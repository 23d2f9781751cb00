"""What the controller keeps of children between reconciles: enough, and no more.

At a thousand deployments every kilobyte kept per child is a megabyte (docs/scale.md), so the
copies drop the server's bookkeeping and our own apply's answer is let go once the watch has
delivered something at least as new.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import time
from typing import Any

from vllm_autotuner.controller import (
    APPLIED_GRACE_S,
    Controller,
    PackedChild,
    child_copy,
    packed_copy,
)

DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {
        "name": "llm",
        "namespace": "team",
        "resourceVersion": "7",
        "labels": {"app": "llm"},
        "managedFields": [{"manager": "vllm-autotuner", "fieldsV1": {"f:spec": {}}}],
    },
    "spec": {"replicas": 1},
    "status": {"availableReplicas": 1},
}


def test_a_child_copy_drops_managed_fields_and_keeps_what_the_controller_reads() -> None:
    copy = child_copy(DEPLOYMENT)
    assert "managedFields" not in copy["metadata"]
    assert copy["metadata"]["labels"] == {"app": "llm"}
    assert copy["metadata"]["resourceVersion"] == "7"
    assert copy["spec"] == {"replicas": 1} and copy["status"] == {"availableReplicas": 1}
    pod = child_copy(DEPLOYMENT, keep_spec=False)
    assert "spec" not in pod and pod["status"] == {"availableReplicas": 1}
    # The original is untouched (kopf still owns it).
    assert "managedFields" in DEPLOYMENT["metadata"]


def _with_version(version: int) -> dict[str, Any]:
    return {**DEPLOYMENT, "metadata": {**DEPLOYMENT["metadata"], "resourceVersion": str(version)}}


def test_our_apply_stands_in_until_the_watch_catches_up_then_is_let_go() -> None:
    controller = Controller(kube=None)  # type: ignore[arg-type]  # no API call is made here
    key = ("team", "llm", "Deployment")
    ours = child_copy(_with_version(9))
    controller._applied[key] = (time.monotonic(), ours)

    # The index still shows version 7: our newer answer is used and kept.
    merged = controller._freshest("team", "llm", {"Deployment": _with_version(7)})
    assert merged["Deployment"] is ours and key in controller._applied
    # The watch delivered version 9: the index's copy is used and ours is dropped.
    live = _with_version(9)
    merged = controller._freshest("team", "llm", {"Deployment": live})
    assert merged["Deployment"] is live and key not in controller._applied


def test_an_absent_child_is_bridged_only_for_the_grace_period() -> None:
    controller = Controller(kube=None)  # type: ignore[arg-type]
    key = ("team", "llm", "Deployment")
    ours = child_copy(_with_version(3))
    controller._applied[key] = (time.monotonic(), ours)
    assert controller._freshest("team", "llm", {"Deployment": None})["Deployment"] is ours
    controller._applied[key] = (time.monotonic() - APPLIED_GRACE_S - 1, ours)
    assert controller._freshest("team", "llm", {"Deployment": None})["Deployment"] is None
    assert key not in controller._applied


def _deep_size(obj: Any) -> int:
    """Bytes of Python objects in a decoded JSON tree (dicts, lists, strings, numbers)."""
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(_deep_size(k) + _deep_size(v) for k, v in obj.items())
    elif isinstance(obj, list):
        size += sum(_deep_size(v) for v in obj)
    return size


def test_a_packed_child_is_the_child_copy_in_a_quarter_of_the_memory() -> None:
    """The indexes keep children packed: the same copy back, for far fewer bytes (a thousand
    deployments' children were 47 MiB decoded)."""
    rendered = render_deployment()
    packed = packed_copy(rendered)
    assert packed.unpack() == child_copy(rendered)
    assert packed.unpack() is not packed.unpack()  # each reader gets its own to change
    assert sys.getsizeof(packed.text) * 3 < _deep_size(child_copy(rendered))
    pod = packed_copy(rendered, keep_spec=False).unpack()
    assert "spec" not in pod and pod["metadata"] == child_copy(rendered)["metadata"]


def test_the_operator_indexes_children_packed_and_reads_them_unpacked() -> None:
    from vllm_autotuner.adapters.kube import KubeCredentials
    from vllm_autotuner.operator import OperatorConfig, _all, _first, build_registry

    config = OperatorConfig(credentials=KubeCredentials.for_server("http://127.0.0.1:1"))
    registry, _ = build_registry(config)
    handlers = {h.id: h.fn for h in registry._indexing.get_all_handlers()}
    body = render_deployment()
    meta = body["metadata"]
    for index in ("deployment_index", "service_index", "vllm_index"):
        stored = asyncio.run(
            handlers[index](namespace=meta["namespace"], name=meta["name"], body=body)
        )
        ((key, value),) = stored.items()
        assert isinstance(value, PackedChild)
        assert _first({key: [value]}, key) == child_copy(body)
        assert _all({key: [value, value]}, key) == [child_copy(body)] * 2
    # Small indexes (policies, namespace labels) keep plain dicts, read as they are.
    assert _first({"ns": [{"team": "a"}]}, "ns") == {"team": "a"}


def render_deployment() -> dict[str, Any]:
    """A Deployment as the operator renders it for a VLLMDeployment, with the server's
    bookkeeping added (what a watch delivers)."""
    from tests.support.cluster_api import CR
    from vllm_autotuner.api.deployment import VLLMDeploymentSpec
    from vllm_autotuner.core import render
    from vllm_autotuner.core.tuning_types import Knobs

    spec = VLLMDeploymentSpec.model_validate(CR["spec"])
    owner = render.Owner(name="llm", namespace="team", uid="u-1")
    manifest = render.render_deployment(spec, Knobs(8192, 256, 0.92), owner)
    manifest["metadata"]["managedFields"] = [{"manager": "vllm-autotuner", "fieldsV1": {}}]
    manifest["metadata"]["resourceVersion"] = "7"
    manifest["status"] = {"replicas": 1, "availableReplicas": 1, "observedGeneration": 1}
    return copy.deepcopy(manifest)
