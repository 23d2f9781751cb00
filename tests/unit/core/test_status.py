"""Status rules: Ready follows serving availability; unchanged status produces no patch."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from vllm_autotuner.core.conditions import ConditionUpdate
from vllm_autotuner.core.status import ChildState, compute_status, readiness, status_patch

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def child(replicas: int, available: int, updated: int | None = None, **status: Any) -> ChildState:
    return ChildState.from_manifest(
        {
            "metadata": {"generation": 2},
            "spec": {"replicas": replicas},
            "status": {
                "observedGeneration": 2,
                "replicas": replicas,
                "availableReplicas": available,
                "readyReplicas": available,
                "updatedReplicas": replicas if updated is None else updated,
                **status,
            },
        }
    )


def test_missing_child_is_not_ready() -> None:
    assert readiness(ChildState(exists=False)).status == "False"


def test_all_available_is_ready() -> None:
    r = readiness(child(2, 2))
    assert (r.status, r.reason) == ("True", "Available")
    assert "2/2" in r.message


def test_rolling_update_keeps_ready_while_deployment_is_available() -> None:
    available = [{"type": "Available", "status": "True"}]
    r = readiness(child(3, 2, updated=1, conditions=available))
    assert r.status == "True" and "rollout in progress" in r.message


def test_nothing_available_is_not_ready() -> None:
    r = readiness(child(1, 0, conditions=[{"type": "Available", "status": "False"}]))
    assert (r.status, r.reason) == ("False", "Progressing")


def test_progress_deadline_is_reported() -> None:
    conds = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "x",
        }
    ]
    assert readiness(child(1, 0, conditions=conds)).reason == "ProgressDeadlineExceeded"


def test_status_patch_is_empty_when_nothing_changed() -> None:
    updates = [ConditionUpdate("Ready", "True", "Available", "1/1")]
    first = compute_status(None, generation=1, now=NOW, updates=updates, fields={"mode": "Auto"})
    again = compute_status(first, generation=1, now=NOW, updates=updates, fields={"mode": "Auto"})
    assert status_patch(first, again) == {}
    changed = compute_status(first, generation=2, now=NOW, updates=updates, fields={"mode": "Off"})
    patch = status_patch(first, changed)
    assert patch["mode"] == "Off" and patch["observedGeneration"] == 2


def test_status_patch_removes_vanished_keys() -> None:
    assert status_patch({"a": 1, "b": 2}, {"a": 1}) == {"b": None}
