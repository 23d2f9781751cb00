"""What the controller keeps of children between reconciles: enough, and no more.

At a thousand deployments every kilobyte kept per child is a megabyte (docs/scale.md), so the
copies drop the server's bookkeeping and our own apply's answer is let go once the watch has
delivered something at least as new.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_autotuner.controller import APPLIED_GRACE_S, Controller, child_copy

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
