"""metav1.Condition semantics: transition time moves only with the status."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from vllm_autotuner.core.conditions import ConditionUpdate, find, is_true, set_conditions

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def test_new_condition_gets_the_current_time_and_generation() -> None:
    conds = set_conditions(
        None, [ConditionUpdate("Ready", "False", "Deploying")], generation=3, now=T0
    )
    assert conds == [
        {
            "type": "Ready",
            "status": "False",
            "reason": "Deploying",
            "message": "",
            "lastTransitionTime": "2026-12-01T12:00:00Z",
            "observedGeneration": 3,
        }
    ]


def test_same_status_keeps_transition_time_but_updates_reason_and_message() -> None:
    first = set_conditions(
        None, [ConditionUpdate("Ready", "True", "Available", "1/1")], generation=1, now=T0
    )
    later = T0 + timedelta(minutes=5)
    second = set_conditions(
        first, [ConditionUpdate("Ready", "True", "Available", "2/2")], generation=2, now=later
    )
    cond = find(second, "Ready")
    assert cond is not None
    assert cond["lastTransitionTime"] == "2026-12-01T12:00:00Z"
    assert cond["message"] == "2/2"
    assert cond["observedGeneration"] == 2


def test_status_change_moves_transition_time() -> None:
    first = set_conditions(
        None, [ConditionUpdate("Ready", "True", "Available")], generation=1, now=T0
    )
    later = T0 + timedelta(minutes=5)
    second = set_conditions(
        first, [ConditionUpdate("Ready", "False", "Progressing")], generation=1, now=later
    )
    cond = find(second, "Ready")
    assert cond is not None and cond["lastTransitionTime"] == "2026-12-01T12:05:00Z"
    assert not is_true(second, "Ready")


def test_unmentioned_conditions_are_kept_and_order_is_stable() -> None:
    first = set_conditions(
        None,
        [
            ConditionUpdate("Degraded", "False", "AsExpected"),
            ConditionUpdate("Ready", "True", "Available"),
        ],
        generation=1,
        now=T0,
    )
    second = set_conditions(
        first, [ConditionUpdate("Tuning", "True", "Verifying")], generation=1, now=T0
    )
    assert [c["type"] for c in second] == ["Ready", "Tuning", "Degraded"]
    assert is_true(second, "Ready") and is_true(second, "Tuning")


def test_rewriting_identical_conditions_is_a_fixed_point() -> None:
    updates = [ConditionUpdate("Ready", "True", "Available", "1/1")]
    first = set_conditions(None, updates, generation=1, now=T0)
    again = set_conditions(first, updates, generation=1, now=T0 + timedelta(hours=1))
    assert again == first
