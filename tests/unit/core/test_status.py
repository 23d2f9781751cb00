"""Status rules: Ready follows serving availability; unchanged status produces no patch."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

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


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies application/merge-patch+json."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


def test_a_field_gone_from_status_tuning_is_removed_by_the_patch() -> None:
    during = {
        "tuning": {
            "phase": "Verifying",
            "candidate": {"maxNumBatchedTokens": 1024},
            "analysis": {"since": "2026-12-03T12:00:00Z", "verdict": "Pending"},
            "trials": [{"id": 1}],
        },
        "mode": "Auto",
    }
    after = {"tuning": {"phase": "Committed", "trials": [{"id": 1}]}, "mode": "Auto"}
    patch = status_patch(during, after)
    assert patch == {"tuning": {"phase": "Committed", "candidate": None, "analysis": None}}
    assert apply_merge_patch(during, patch) == after


_leaf = st.one_of(st.integers(0, 3), st.text("ab", max_size=2), st.lists(st.integers(0, 2)))
_tree = st.recursive(
    _leaf, lambda inner: st.dictionaries(st.sampled_from("abcd"), inner, max_size=4), max_leaves=12
)
_status = st.dictionaries(st.sampled_from(["tuning", "observed", "mode", "paused"]), _tree)


@given(_status, _status)
def test_the_patch_takes_the_stored_status_exactly_to_the_new_one(
    old: dict[str, Any], new: dict[str, Any]
) -> None:
    patch = status_patch(old, new)
    assert apply_merge_patch(old, patch) == new
    assert (patch == {}) == (old == new)
