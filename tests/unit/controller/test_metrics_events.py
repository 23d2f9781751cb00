"""Losing metrics, and getting them back, is announced with an Event; a new revision warming up
(after every rollout) is not."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_autotuner.controller import metrics_transition
from vllm_autotuner.core.conditions import ConditionUpdate


def status(cond_status: str | None, reason: str = "") -> dict[str, Any]:
    if cond_status is None:
        return {}
    return {"conditions": [{"type": "MetricsAvailable", "status": cond_status, "reason": reason}]}


def update(cond_status: str, reason: str, message: str = "why") -> list[ConditionUpdate]:
    return [
        ConditionUpdate("Tuning", "False", "Observing", "x"),
        ConditionUpdate("MetricsAvailable", cond_status, reason, message),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("reason", ["MetricsUnavailable", "MetricsInvalid"])
def test_metrics_lost_after_being_available_is_a_warning(reason: str) -> None:
    events = metrics_transition(status("True", "MetricsFresh"), update("False", reason, "503"))
    assert [(e.type, e.reason) for e in events] == [("Warning", reason)]
    assert "503" in events[0].message and "holds" in events[0].message


@pytest.mark.parametrize("reason", ["MetricsUnavailable", "MetricsInvalid"])
def test_metrics_back_after_a_loss_is_announced(reason: str) -> None:
    events = metrics_transition(status("False", reason), update("True", "MetricsFresh", "ok"))
    assert [(e.type, e.reason) for e in events] == [("Normal", "MetricsRecovered")]


@pytest.mark.parametrize(
    ("before", "after"),
    [
        # A new revision warming up, and its end: after every rollout, not news.
        (status("True", "MetricsFresh"), update("False", "WaitingForRevision")),
        (status("False", "WaitingForRevision"), update("True", "MetricsFresh")),
        # The first reconcile has no metrics yet; nothing was lost.
        (status(None), update("False", "MetricsUnavailable")),
        (status(None), update("True", "MetricsFresh")),
        # No change.
        (status("True", "MetricsFresh"), update("True", "MetricsFresh")),
        (status("False", "MetricsUnavailable"), update("False", "MetricsUnavailable")),
        # Mode Off.
        (status("True", "MetricsFresh"), update("Unknown", "TuningOff")),
    ],
)
def test_no_event_without_a_real_loss_or_recovery(
    before: dict[str, Any], after: list[ConditionUpdate]
) -> None:
    assert metrics_transition(before, after) == []
