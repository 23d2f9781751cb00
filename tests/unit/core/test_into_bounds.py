"""A move into a tightened policy's bounds is never judged against the knobs it replaced.

The previous knobs are no longer allowed, so "no gain over them" (or a loss) is no reason to
go back: the operator would run what the platform team forbade, then move into the bounds
again at the next reconcile, one restart per round until the daily budget is spent (seen in
tests/integration/reliability/test_policy_changes.py). A crash still rolls it back.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from tests.unit.core.test_decide import BOUNDS, KNOBS, NOW, make_policy, make_snapshot, run
from vllm_autotuner.core.tuning_types import Bounds, KnobBounds, Knobs, PodHealth, TuningState

TIGHT = replace(BOUNDS, mnbt=KnobBounds(256, 2048, 7168))


def moving_inside() -> tuple[TuningState, Knobs]:
    """KNOBS (8192 batched tokens) run; the policy now allows at most 2048: the move."""
    start = run(TuningState.initial(KNOBS), make_snapshot(), make_policy(bounds=TIGHT))
    assert start.action == "rollout", start.reason
    assert "outside the policy's bounds" in start.reason
    assert start.knobs_to_apply is not None
    cand = start.knobs_to_apply
    assert cand.max_num_batched_tokens == 2048
    return replace(start.new_state, phase="Verifying", verify_until=NOW), cand


def ready(knobs: Knobs) -> tuple[PodHealth, ...]:
    return (PodHealth(ready=True, revision_knobs=knobs, name="p0"),)


@pytest.mark.parametrize(("bounds", "action"), [(TIGHT, "commit"), (BOUNDS, "rollback")])
def test_a_worse_move_is_kept_only_when_the_previous_knobs_are_forbidden(
    bounds: Bounds, action: str
) -> None:
    state, cand = moving_inside()
    later = NOW + timedelta(seconds=1)
    # The candidate's window: an ITL far over its SLO, six times the threshold; calibrated on
    # it, the model puts the replaced knobs at about half of that at the same load (at 120 ms,
    # 2.4x, it put the replaced 8192-token budget's longer chunks at 2.95x: a gain to keep).
    worse = make_snapshot(cand, itl_p95=300.0, itl_mean=150.0)
    d = run(state, worse, make_policy(bounds=bounds), later, ready(cand))
    assert d.action == action, d.reason
    if action == "commit":
        assert d.new_state.applied == cand == d.new_state.last_good
        assert "outside the policy's bounds" in d.reason
        assert d.new_state.trials[-1].outcome == "Committed"


def test_a_crashing_move_still_goes_back() -> None:
    state, cand = moving_inside()
    crash = (
        PodHealth(
            ready=False,
            restarts=4,
            waiting_reason="CrashLoopBackOff",
            last_termination_reason="Error",
            revision_knobs=cand,
        ),
    )
    d = run(state, make_snapshot(cand), make_policy(bounds=TIGHT), NOW, crash)
    assert (d.action, d.new_state.trials[-1].outcome) == ("rollback", "Crashed"), d.reason
