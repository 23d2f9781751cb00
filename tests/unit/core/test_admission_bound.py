"""The fit at the admission-cost bound (perf_model.ADMIT_BOUND_S), and decide() acting on the
gain that holds under it too.

- The bound's parameters round-trip through the state's calibration mapping, and the
  calibration at the bound has no bound of its own.
- On windows of several loads the fit at the bound explains the window within the tolerance
  (its residuals are checked here, independently of the code that gates them), and none is
  made when the free fit already pays the bound.
- The knobs `decide._between` adds lie between the two bests on every axis, on the search's
  grains, and are legal proposals.
- decide() acts on the candidate whose smallest gain over every fit is the largest, and says
  so when the bound moved the choice.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.core.shared_model import SharedModel
from tests.unit.core.test_decide import (
    CTX,
    KNOBS,
    NOW,
    make_policy,
    make_snapshot,
    ready_pods,
    violating_snapshot,
)
from vllm_autotuner.core import perf_model as pm
from vllm_autotuner.core.calibration_mean import robust_gain
from vllm_autotuner.core.decide import _between, decide
from vllm_autotuner.core.perf_model import ADMIT_BOUND_S, AnalyticModel, Calibration, Workload
from vllm_autotuner.core.search import MNBT_GRAIN, MNS_GRAIN, allowed
from vllm_autotuner.core.snapshot import Observation
from vllm_autotuner.core.tuning_types import Knobs, TuningState


def test_the_bound_round_trips_and_has_no_bound_of_its_own() -> None:
    cal = Calibration(
        bandwidth=0.9,
        compute=0.8,
        admit_s=0.0005,
        api_s=0.01,
        fitted=True,
        bound_bandwidth=0.88,
        bound_compute=0.95,
        bound_jitter=0.06,
        bound_api_s=0.008,
    )
    assert Calibration.from_dict(cal.to_dict()) == cal
    at = cal.at_admission_bound()
    assert at is not None
    assert (at.bandwidth, at.compute, at.jitter, at.api_s) == (0.88, 0.95, 0.06, 0.008)
    assert at.admit_s == ADMIT_BOUND_S
    assert at.at_admission_bound() is None
    assert replace(cal, bound_compute=None).at_admission_bound() is None


def _problem(rate: float) -> tuple[pm.FitProblem, tuple[float, ...]]:
    snap = violating_snapshot(KNOBS, rate=rate) if rate > 3 else make_snapshot(KNOBS, rate=rate)
    policy, model = make_policy(), AnalyticModel()
    w = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
    model.bind(CTX)
    problem = model._problem(snap, KNOBS, w, model._kv(KNOBS, Calibration()), None)
    assert problem is not None
    return problem, pm._fit_step_times(problem)[0]


@pytest.mark.parametrize("rate", [1.0, 4.0, 6.0])
def test_the_fit_at_the_bound_explains_the_window_within_the_tolerance(rate: float) -> None:
    problem, x = _problem(rate)
    y = pm._fit_at_admission(problem, x)
    assert y is not None, "these windows cannot tell admission from compute"
    assert y[2] == pytest.approx(ADMIT_BOUND_S * 1000.0)
    residuals = partial(pm._residuals, problem)
    data = len(residuals(x)) - 4
    ratio, slack = pm._BOUND_TOLERANCE
    assert pm._sq(residuals(y)[:data]) <= ratio * pm._sq(residuals(x)[:data]) + slack
    # What it trades: the admission cost for compute (the same prefill work per request).
    assert math.exp(y[1]) > math.exp(x[1]) * 0.98


def test_no_bound_when_the_fit_already_pays_it() -> None:
    problem, x = _problem(4.0)
    paid = (x[0], x[1], ADMIT_BOUND_S * 1000.0 + 0.5, x[3])
    assert pm._fit_at_admission(problem, paid) is None


def test_no_bound_when_the_window_must_be_explained_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate is the tolerance: with none, a refit that explains the window any worse than
    the free fit is no bound."""
    problem, x = _problem(6.0)
    pm._fit_at_admission.cache_clear()
    monkeypatch.setattr(pm, "_BOUND_TOLERANCE", (0.0, 0.0))
    assert pm._fit_at_admission(problem, x) is None
    pm._fit_at_admission.cache_clear()


knobs_in_bounds = st.builds(
    Knobs,
    max_num_batched_tokens=st.integers(256, 16384),
    max_num_seqs=st.integers(16, 1024),
    gpu_memory_utilization=st.floats(0.80, 0.97).map(lambda v: round(v, 2)),
)


@settings(max_examples=300, deadline=None)
@given(a=knobs_in_bounds, b=knobs_in_bounds)
def test_between_lies_between_on_grains_and_is_legal(a: Knobs, b: Knobs) -> None:
    state, policy = TuningState.initial(KNOBS), make_policy()
    out = _between(a, b, state, policy)
    for k in out:
        for get in (
            lambda z: z.max_num_batched_tokens,
            lambda z: z.max_num_seqs,
            lambda z: z.gpu_memory_utilization,
        ):
            lo, hi = sorted((get(a), get(b)))
            grain = 0.0 if isinstance(get(k), float) else float(max(MNBT_GRAIN, MNS_GRAIN))
            assert lo - grain - 0.006 <= get(k) <= hi + grain + 0.006
        assert not k.same_as(a) and not k.same_as(b)
        assert k.max_num_batched_tokens % MNBT_GRAIN == 0 or k.max_num_batched_tokens in (
            a.max_num_batched_tokens,
            b.max_num_batched_tokens,
        )
        assert k.max_num_seqs % MNS_GRAIN == 0 or k.max_num_seqs in (a.max_num_seqs, b.max_num_seqs)
        why = allowed(
            k, state.applied, policy.bounds, state.memory(), policy.gmu_rise_step, state.infeasible
        )
        assert why is None, why
    assert len(
        {(k.max_num_batched_tokens, k.max_num_seqs, k.gpu_memory_utilization) for k in out}
    ) == len(out)


def test_the_candidate_acted_on_gains_most_under_every_fit() -> None:
    """On the decide tests' windows, the bound moves the window's own best to one whose
    smallest gain over every fit is larger, and the reason names the bound."""
    moved = 0
    for snap in (violating_snapshot(KNOBS, rate=4.0), make_snapshot(KNOBS, rate=6.0)):
        obs, policy = Observation(snap, ready_pods(KNOBS)), make_policy("Recommend")
        model = SharedModel()
        d = decide(TuningState.initial(KNOBS), obs, policy, CTX, NOW, model)
        assert d.new_state.recommendation is not None, d.reason
        (_, current), (chosen, acted) = d.predictions
        marker = "this window's fit alone chose "
        if marker not in d.reason:
            continue
        own = _knobs_in(d.reason.split(marker, 1)[1])
        assert not own.same_as(chosen)
        cal = Calibration.from_dict(d.new_state.calibration)
        w = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
        theirs = robust_gain(
            model, KNOBS, own, w, cal, None, current.capacity_rps,
            model.predict(own, w, cal).capacity_rps,
        )  # fmt: skip
        assert theirs.bound_binds
        assert acted.capacity_rps > theirs.best_rps
        assert "admission cost per request, which this window cannot rule out" in d.reason
        moved += 1
    assert moved > 0, "the bound moved no choice: the test shows nothing"


def _knobs_in(text: str) -> Knobs:
    fields = dict(part.split("=") for part in text.split(")")[0].split())
    return Knobs(
        int(fields["maxNumBatchedTokens"]),
        int(fields["maxNumSeqs"]),
        float(fields["gpuMemoryUtilization"]),
    )


def test_a_violated_window_is_not_judged_by_the_bound() -> None:
    """With the SLO violated the proposal's gain is the lead fit's and the second's only: the
    same window's calibration carries a bound, and the bound would have lowered the gain."""
    snap = violating_snapshot(KNOBS, rate=4.0)
    obs, policy = Observation(snap, ready_pods(KNOBS)), make_policy("Recommend")
    model = SharedModel()
    d = decide(TuningState.initial(KNOBS), obs, policy, CTX, NOW, model)
    assert d.diagnosis is not None and d.diagnosis.violates_slo
    assert d.new_state.recommendation is not None, d.reason
    assert "admission cost" not in d.reason
    (_, current), (chosen, acted) = d.predictions
    cal = Calibration.from_dict(d.new_state.calibration)
    assert cal.at_admission_bound() is not None
    w = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
    own = model.predict(chosen, w, cal).capacity_rps
    assert acted.capacity_rps == pytest.approx(own)
    with_bound = robust_gain(model, KNOBS, chosen, w, cal, None, current.capacity_rps, own)
    assert with_bound.bound_binds and with_bound.best_rps < acted.capacity_rps
