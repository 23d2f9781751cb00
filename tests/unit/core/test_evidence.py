"""Trial evidence: what finished trials measured corrects the search's predictions near them."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.core.test_decide import KNOBS, make_snapshot
from tests.unit.core.test_search import run_search
from vllm_autotuner.core.evidence import (
    MAX_RESIDUAL,
    SHRINK,
    TrialEvidence,
    correction,
    evidence_of,
    paired_residual,
    residual,
)
from vllm_autotuner.core.search import SearchResult
from vllm_autotuner.core.tuning_types import Knobs, Measured, Trial, TuningState

T0 = datetime(2026, 12, 1, tzinfo=UTC)

knobs_st = st.builds(
    Knobs,
    st.integers(64, 16384),
    st.integers(8, 1024),
    st.floats(0.8, 0.97).map(lambda g: round(g, 2)),
)
residual_st = st.floats(-MAX_RESIDUAL, MAX_RESIDUAL)
observations_st = st.lists(st.tuples(knobs_st, residual_st), max_size=6)


@settings(max_examples=200, deadline=None)
@given(k=knobs_st, applied=knobs_st, obs=observations_st)
def test_the_correction_is_a_shrunk_mean_of_the_residuals(
    k: Knobs, applied: Knobs, obs: list[tuple[Knobs, float]]
) -> None:
    """Never beyond the residuals it comes from, and of their sign when they agree."""
    c = correction(k, applied, obs)
    if not obs:
        assert c == 0.0
        return
    rs = [r for _, r in obs]
    assert min(min(rs), 0.0) - 1e-12 <= c <= max(max(rs), 0.0) + 1e-12
    # Shrunk: n observations weigh at most n against SHRINK's zero.
    n = len(rs)
    assert abs(c) <= max(abs(r) for r in rs) * n / (n + SHRINK) + 1e-12


@settings(max_examples=100, deadline=None)
@given(trial=knobs_st, r=residual_st)
def test_a_trial_corrects_its_own_knobs_most_and_the_applied_knobs_least(
    trial: Knobs, r: float
) -> None:
    # `far` is at least 8 token-budget length scales away: its weight is nil at the trial.
    far = Knobs(16384 if trial.max_num_batched_tokens < 2048 else 64, 8, 0.8)
    on_it = correction(trial, far, [(trial, r)])
    assert math.isclose(on_it, r / (1.0 + SHRINK), rel_tol=1e-6, abs_tol=1e-12)
    at_applied = correction(far, far, [(trial, r)])
    assert abs(at_applied) <= 1e-9


def test_residuals_are_bounded_and_need_a_prediction() -> None:
    assert residual(10.0, 0.0) is None
    assert residual(0.0, 10.0) is None
    assert residual(100.0, 1.0) == MAX_RESIDUAL
    assert residual(1.0, 100.0) == -MAX_RESIDUAL
    assert residual(25.0, 34.0) == math.log(25.0 / 34.0)


def _trial(i: int, knobs: Knobs, outcome: str, cap: float | None) -> Trial:
    measured = None if cap is None else Measured(request_rate=10.0, capacity_rps=cap)
    return Trial(i, knobs, T0, T0 + timedelta(minutes=15), outcome, "", measured)  # type: ignore[arg-type]


def test_evidence_is_the_finished_trials_that_measured_a_capacity_elsewhere() -> None:
    applied = Knobs(512, 512, 0.92)
    trials = (
        _trial(1, applied, "Committed", 27.0),  # the knobs that run now: their window is newer
        _trial(2, Knobs(896, 512, 0.92), "RolledBack", 25.2),
        _trial(3, Knobs(896, 256, 0.87), "RolledBack", None),  # judged without a capacity
        _trial(4, Knobs(2048, 512, 0.92), "OOMKilled", 30.0),  # never served within a window
        _trial(5, Knobs(704, 512, 0.92), "Pending", 28.0),
    )
    state = replace(TuningState.initial(applied), trials=trials)
    assert evidence_of(state) == (TrialEvidence(Knobs(896, 512, 0.92), 25.2),)


def _search(evidence: tuple[TrialEvidence, ...]) -> SearchResult:
    return run_search(make_snapshot(itl_p95=80.0, itl_mean=25.0), evidence=evidence)


def test_a_trial_that_measured_far_less_moves_the_search_away_from_it() -> None:
    """The search's best, measured at a third of its prediction, is no longer the best, and
    what is proposed instead says it was corrected whenever the correction reaches it (the
    kernel may have moved the search out of the trial's neighbourhood altogether)."""
    free = _search(())
    assert free.best is not None and free.prediction is not None, free.reason
    measured = free.prediction.capacity_rps / 3.0
    told = _search((TrialEvidence(free.best, measured),))
    assert told.best is not None and told.prediction is not None, told.reason
    assert not told.best.same_as(free.best)
    assert told.prediction.capacity_rps < free.prediction.capacity_rps
    reached = correction(told.best, KNOBS, [(free.best, math.log(1.0 / 3.0))])
    assert ("earlier trials measured" in told.reason) == (abs(reached) >= 0.01), told.reason


def test_a_canary_trial_is_evidence_with_its_baseline() -> None:
    applied = Knobs(512, 512, 0.92)
    base = Measured(request_rate=10.0, capacity_rps=24.0)
    paired = replace(
        _trial(2, Knobs(896, 512, 0.92), "RolledBack", 25.2),
        baseline=base,
        baseline_knobs=applied,
    )
    # A baseline that measured no capacity leaves the absolute measurement.
    unpaired = replace(
        _trial(3, Knobs(704, 512, 0.92), "RolledBack", 26.0),
        baseline=Measured(request_rate=10.0),
        baseline_knobs=applied,
    )
    state = replace(TuningState.initial(applied), trials=(paired, unpaired))
    assert evidence_of(state) == (
        TrialEvidence(Knobs(896, 512, 0.92), 25.2, applied, 24.0),
        TrialEvidence(Knobs(704, 512, 0.92), 26.0),
    )
    assert TuningState.from_dict(state.to_dict()).trials == state.trials


positive_st = st.floats(0.01, 1000.0)


@settings(max_examples=200, deadline=None)
@given(m=positive_st, mb=positive_st, p=positive_st, pb=positive_st, scale=positive_st)
def test_a_paired_residual_is_the_canarys_measured_gain_over_the_predicted_one(
    m: float, mb: float, p: float, pb: float, scale: float
) -> None:
    """What the window's level was does not matter, only the canary against its baseline;
    where the model put the baseline right, it is the plain residual."""
    r = paired_residual(m, mb, p, pb)
    assert r is not None
    assert math.isclose(r, paired_residual(m * scale, mb * scale, p, pb) or 0.0, abs_tol=1e-9)
    assert math.isclose(paired_residual(m, pb, p, pb) or 0.0, residual(m, p) or 0.0, abs_tol=1e-9)
    expected = math.log((m / mb) / (p / pb))
    assert math.isclose(r, max(-MAX_RESIDUAL, min(MAX_RESIDUAL, expected)), abs_tol=1e-9)
    assert paired_residual(m, 0.0, p, pb) is None and paired_residual(m, mb, p, 0.0) is None


def test_a_canary_no_better_than_its_baseline_lowers_its_knobs_even_above_their_prediction() -> (
    None
):
    """code-70b-h200-tp4's case: the canary measured what its baseline did (no gain), both
    above what today's window predicts. Its knobs' predicted gain must fall, not rise."""
    free = _search(())
    assert free.best is not None and free.prediction is not None, free.reason
    high = free.prediction.capacity_rps * 1.2
    paired = TrialEvidence(free.best, high, KNOBS, high)
    told = _search((paired,))
    assert told.prediction is not None, told.reason
    assert told.prediction.capacity_rps < free.prediction.capacity_rps
    absolute = _search((TrialEvidence(free.best, high),))
    assert absolute.prediction is not None
    assert absolute.prediction.capacity_rps > free.prediction.capacity_rps
