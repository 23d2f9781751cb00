"""Rollout guards (cooldown, daily budget, maintenance windows), pod failures and the verdict."""

from __future__ import annotations

import math
from datetime import UTC, datetime, time, timedelta

import pytest

from tests.unit.core.test_decide import KNOBS, SLO_DEFAULT, make_snapshot
from vllm_autotuner.core.perf_model import Prediction
from vllm_autotuner.core.rollout import (
    judge_before_after,
    pod_failure,
    roll_day,
    rollout_blocker,
    rollout_progress,
)
from vllm_autotuner.core.tuning_types import (
    Knobs,
    MaintenanceWindow,
    PodHealth,
    RolloutRules,
    TuningState,
)

# Wednesday 2 December 2026, 12:00 UTC.
NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
NIGHTS = MaintenanceWindow(frozenset({0, 1, 2, 3, 4}), time(22, 0), time(6, 0))  # Mon-Fri nights
LUNCH_BERLIN = MaintenanceWindow(frozenset({2}), time(12, 30), time(13, 30), "Europe/Berlin")


def state(**kw: object) -> TuningState:
    return TuningState(applied=KNOBS, last_good=KNOBS, rollout_day="2026-12-02", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("st", "rules", "now", "blocked_by"),
    [
        (state(), RolloutRules(), NOW, None),
        (
            state(last_rollout_at=NOW - timedelta(minutes=10)),
            RolloutRules(min_interval_s=1800),
            NOW,
            "cooldown",
        ),
        (
            state(last_rollout_at=NOW - timedelta(minutes=31)),
            RolloutRules(min_interval_s=1800),
            NOW,
            None,
        ),
        (state(rollouts_today=4), RolloutRules(max_per_day=4), NOW, "daily budget"),
        (state(rollouts_today=3), RolloutRules(max_per_day=4), NOW, None),
        (state(), RolloutRules(max_per_day=0), NOW, "daily budget"),
        (state(), RolloutRules(maintenance_windows=(NIGHTS,)), NOW, "maintenance window"),
        (state(), RolloutRules(maintenance_windows=(NIGHTS,)), NOW.replace(hour=23), None),
        # 05:00 on Thursday is still Wednesday night's window; Saturday 05:00 is Friday's.
        (state(), RolloutRules(maintenance_windows=(NIGHTS,)), NOW + timedelta(hours=17), None),
        (
            state(),
            RolloutRules(maintenance_windows=(NIGHTS,)),
            datetime(2026, 12, 6, 5, 0, tzinfo=UTC),
            "maintenance window",
        ),  # Sunday
        # 11:45 UTC is 12:45 in Berlin (CET, UTC+1).
        (
            state(),
            RolloutRules(maintenance_windows=(LUNCH_BERLIN,)),
            NOW - timedelta(minutes=15),
            None,
        ),
        (
            state(),
            RolloutRules(maintenance_windows=(LUNCH_BERLIN,)),
            NOW + timedelta(minutes=45),
            "maintenance window",
        ),
    ],
)
def test_rollout_blocker(
    st: TuningState, rules: RolloutRules, now: datetime, blocked_by: str | None
) -> None:
    why = rollout_blocker(roll_day(st, now), rules, now)
    if blocked_by is None:
        assert why is None
    else:
        assert why is not None and blocked_by in why


def test_the_daily_budget_resets_at_utc_midnight() -> None:
    spent = state(rollouts_today=4)
    assert roll_day(spent, NOW + timedelta(hours=11)).rollouts_today == 4
    assert roll_day(spent, NOW + timedelta(hours=12)).rollouts_today == 0


CAND = Knobs(4096, 512, 0.94)


@pytest.mark.parametrize(
    ("pods", "outcome"),
    [
        ((PodHealth(ready=True, revision_knobs=CAND),), None),
        (
            (
                PodHealth(
                    ready=False, waiting_reason="CrashLoopBackOff", restarts=3, revision_knobs=CAND
                ),
            ),
            "Crashed",
        ),
        (
            (PodHealth(ready=False, last_termination_reason="OOMKilled", revision_knobs=CAND),),
            "OOMKilled",
        ),
        # Unknown revision: assume the pod runs the new knobs.
        ((PodHealth(ready=False, waiting_reason="CrashLoopBackOff"),), "Crashed"),
        # An old pod crashing is not the candidate's fault.
        (
            (PodHealth(ready=False, waiting_reason="CrashLoopBackOff", revision_knobs=KNOBS),),
            None,
        ),
    ],
)
def test_pod_failure(pods: tuple[PodHealth, ...], outcome: str | None) -> None:
    f = pod_failure(pods, CAND)
    assert (None if f is None else f.outcome) == outcome
    if f is not None:
        assert "maxNumBatchedTokens=4096" in f.reason


def test_rollout_progress_waits_for_every_replica_and_no_old_pod() -> None:
    new, old = (
        PodHealth(ready=True, revision_knobs=CAND),
        PodHealth(ready=True, revision_knobs=KNOBS),
    )
    assert rollout_progress((new, old), CAND, 2) == (1, False)
    assert rollout_progress((new, new), CAND, 2) == (2, True)
    assert rollout_progress((new,), CAND, 2) == (1, False)


def pred(capacity: float, ratio: float) -> Prediction:
    """A prediction with this capacity and worst SLO ratio at the window's load."""
    inf = math.inf
    meets = ratio <= 1.0
    return Prediction(400.0, 50.0 * ratio, inf, None, 0.0, meets, capacity, meets, "", ratio)


@pytest.mark.parametrize(
    ("snap_kw", "candidate", "baseline_here", "keep"),
    [
        # SLO met where the previous knobs would miss it at this load: kept.
        ({"itl_p95": 40.0}, pred(6.0, 0.8), pred(3.0, 1.3), True),
        # SLO met, the previous knobs would meet it too: the gain must be measured.
        ({"itl_p95": 40.0}, pred(6.0, 0.8), pred(5.0, 0.9), True),
        ({"itl_p95": 40.0}, pred(5.0, 0.8), pred(5.0, 0.7), False),
        # Missed here: kept only if the previous knobs would miss it by more at this load.
        ({"itl_p95": 70.0}, pred(3.0, 1.4), pred(2.0, 2.0), True),
        ({"itl_p95": 70.0}, pred(3.0, 1.4), pred(2.0, 1.3), False),
        # A load the baseline never saw changes nothing: the model says what it would do.
        ({"itl_p95": 70.0, "rate": 10.0}, pred(3.0, 1.4), pred(2.0, 1.45), False),
    ],
)
def test_judge_before_after(
    snap_kw: dict[str, float], candidate: Prediction, baseline_here: Prediction, keep: bool
) -> None:
    v = judge_before_after(
        make_snapshot(**snap_kw),  # type: ignore[arg-type]
        SLO_DEFAULT,
        candidate,
        baseline_here,
        min_gain_pct=5.0,
    )
    assert v.keep is keep, v.reason
    assert any(ch.isdigit() for ch in v.reason)
