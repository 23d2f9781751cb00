"""The recent windows' mean fit (core/calibration_mean.py), and decide() acting on the smaller
of its gain and this window's."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from datetime import timedelta
from typing import Any

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
from vllm_autotuner.core.calibration_mean import (
    MEAN_WINDOWS,
    Fits,
    ParamMean,
    robust_gain,
    updated,
)
from vllm_autotuner.core.decide import decide
from vllm_autotuner.core.perf_model import Calibration, Workload, prediction_agrees
from vllm_autotuner.core.snapshot import Observation, Snapshot
from vllm_autotuner.core.tuning_types import Knobs, TuningState

WINDOW_S = 300.0
T0 = 1_800_000_000.0


def fit(bandwidth: float = 0.9, compute: float = 0.8, budget: float = 8192.0) -> Calibration:
    return Calibration(
        bandwidth=bandwidth,
        compute=compute,
        admit_s=0.001,
        jitter=0.06,
        fitted=True,
        fitted_budget=budget,
        fitted_seqs=1024.0,
    )


def stored(cal: Calibration, mean: ParamMean | None) -> dict[str, float]:
    return {**cal.to_dict(), **(mean.to_dict() if mean is not None else {})}


def test_the_mean_round_trips_through_the_state_and_refuses_nonsense() -> None:
    m = ParamMean(0.9, 0.8, 0.001, 0.06, T0 + 60, T0)
    assert ParamMean.from_dict(m.to_dict()) == m
    assert ParamMean.from_dict(fit().to_dict()) is None  # a calibration without a mean
    for key, bad in (("mean_compute", 0.0), ("mean_jitter", -1.0), ("mean_admit_s", -0.1)):
        assert ParamMean.from_dict({**m.to_dict(), key: bad}) is None
    # The mean never becomes part of a Calibration (a key of the prediction memo).
    assert Calibration.from_dict(stored(fit(), m)) == Calibration.from_dict(fit().to_dict())


def test_the_mean_starts_continues_and_restarts() -> None:
    assert updated({}, replace(fit(), fitted=False), T0, WINDOW_S) is None
    first = updated({}, fit(), T0, WINDOW_S)
    assert first == ParamMean.start(fit(), T0)
    later = updated(stored(fit(), first), fit(compute=1.6), T0 + WINDOW_S, WINDOW_S)
    assert later is not None and later.since == T0 and later.at == T0 + WINDOW_S
    # One window later the new fit has weight 1 - exp(-1/MEAN_WINDOWS), in log units.
    a = 1.0 - math.exp(-1.0 / MEAN_WINDOWS)
    assert later.compute == pytest.approx(math.exp(math.log(0.8) + a * math.log(2.0)))
    assert later.bandwidth == pytest.approx(0.9)
    # The same fit again is no news: the mean, and so the status, stays as it was.
    assert updated(stored(fit(compute=1.6), later), fit(compute=1.6), T0 + 900, WINDOW_S) == later
    # Other knobs: their fits carry other biases of the model, so the mean starts again.
    other = updated(stored(fit(), later), fit(budget=512.0), T0 + 2 * WINDOW_S, WINDOW_S)
    assert other == ParamMean.start(fit(budget=512.0), T0 + 2 * WINDOW_S)
    # A clock that went back starts it again too.
    back = updated(stored(fit(), later), fit(compute=1.6), T0 - 10, WINDOW_S)
    assert back == ParamMean.start(fit(compute=1.6), T0 - 10)


finite = st.floats(0.2, 3.0)


@settings(max_examples=200, deadline=None)
@given(
    fits=st.lists(st.tuples(finite, finite, st.floats(1.0, 900.0)), min_size=1, max_size=12),
)
def test_the_mean_stays_inside_what_the_fits_said(
    fits: list[tuple[float, float, float]],
) -> None:
    """A weighted mean: never outside the range of the fits it has seen."""
    state: dict[str, float] = {}
    t = T0
    for bw, ce, dt in fits:
        t += dt
        cal = fit(bandwidth=bw, compute=ce)
        m = updated(state, cal, t, WINDOW_S)
        assert m is not None
        state = stored(cal, m)
    assert m is not None
    bws, ces = [f[0] for f in fits], [f[1] for f in fits]
    assert min(bws) * (1 - 1e-9) <= m.bandwidth <= max(bws) * (1 + 1e-9)
    assert min(ces) * (1 - 1e-9) <= m.compute <= max(ces) * (1 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(first=finite, second=finite, a=st.floats(1.0, 600.0), b=st.floats(1.0, 600.0))
def test_a_new_fit_weighs_by_the_time_since_the_last_and_a_repeat_weighs_nothing(
    first: float, second: float, a: float, b: float
) -> None:
    """A new fit `a` seconds after the last moves the mean by 1 - exp(-a / tau) of the way
    in log units (tau: MEAN_WINDOWS evaluation windows), whatever the reconcile period; the
    same fit seen again `b` seconds later is no news and moves nothing."""
    start = stored(fit(compute=first), updated({}, fit(compute=first), T0, WINDOW_S))
    new = fit(compute=second)
    moved = updated(start, new, T0 + a, WINDOW_S)
    assert moved is not None
    w = 1.0 - math.exp(-a / (MEAN_WINDOWS * WINDOW_S))
    expected = math.exp(math.log(first) + w * (math.log(second) - math.log(first)))
    assert moved.compute == pytest.approx(expected, rel=1e-9)
    again = updated(stored(new, moved), new, T0 + a + b, WINDOW_S)
    assert again == moved


def _calibrated() -> tuple[SharedModel, Workload, Calibration, float, float, Knobs]:
    snap = violating_snapshot(KNOBS, rate=4.0)
    policy, model = make_policy(), SharedModel()
    w = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
    cal = model.calibrate(snap, KNOBS, CTX, w, None)
    best = Knobs(1408, 1024, 0.92)
    now_rps = model.predict(KNOBS, w, cal).capacity_rps
    best_rps = model.predict(best, w, cal).capacity_rps
    assert best_rps > now_rps > 0
    return model, w, cal, now_rps, best_rps, best


class MeanOnly(SharedModel):
    """The model without the fit at the admission-cost bound: the mean fit alone against
    this window's (the bound has its own tests below)."""

    def calibrate(self, *args: Any, **kwargs: Any) -> Calibration:
        return super().calibrate(*args, **kwargs).without_bound()


def test_the_smaller_gain_is_the_one_acted_on() -> None:
    model, w, cal, now_rps, best_rps, best = _calibrated()
    cal = cal.without_bound()
    g = robust_gain(model, KNOBS, best, w, cal, cal, now_rps, best_rps)
    assert not g.second_binds and g.best_rps == best_rps
    assert g.second_ratio == pytest.approx(best_rps / now_rps)
    slower = replace(cal, compute=cal.compute * 0.5)
    g = robust_gain(model, KNOBS, best, w, cal, slower, now_rps, best_rps)
    assert g.second_binds and g.second_ratio is not None
    assert g.best_rps == pytest.approx(now_rps * g.second_ratio) and g.best_rps < best_rps
    # No second fit (a mean younger than one window, `Fits`): the lead's gain stands.
    g = robust_gain(model, KNOBS, best, w, cal, None, now_rps, best_rps)
    assert not g.second_binds and g.second_ratio is None and g.best_rps == best_rps


def test_a_fit_the_window_refutes_has_no_say() -> None:
    """A second fit that predicts the applied knobs serve nothing (here a tenth of the
    compute) says so of the candidate too. Where the window measured the applied knobs
    meeting the SLO and the lead fit predicts they serve, that fit is refuted by its own
    window and lowers nothing; otherwise its word stands."""
    model, w, cal, now_rps, best_rps, best = _calibrated()
    cal = cal.without_bound()
    crippled = replace(cal, compute=cal.compute * 0.1, bandwidth=cal.bandwidth * 0.1)
    assert model.predict(KNOBS, w, crippled).capacity_rps == 0.0
    assert model.predict(best, w, crippled).capacity_rps == 0.0
    g = robust_gain(model, KNOBS, best, w, cal, crippled, now_rps, best_rps)
    assert g.second_binds and g.best_rps == 0.0
    g = robust_gain(model, KNOBS, best, w, cal, crippled, now_rps, best_rps, applied_serves=True)
    assert not g.binds and g.best_rps == best_rps and g.second_ratio is None
    # The lead predicts no capacity for the applied knobs either: the other fit's word stands.
    g = robust_gain(model, KNOBS, best, w, cal, crippled, 0.0, best_rps, applied_serves=True)
    assert g.second_binds and g.best_rps == 0.0


@pytest.mark.parametrize(("factor", "action"), [(1.0, "rollout"), (0.5, "hold")])
def test_decide_holds_a_gain_the_recent_fits_do_not_predict(factor: float, action: str) -> None:
    """decide() keeps the mean in the state's calibration, and a candidate whose gain the
    recent windows' mean fit does not predict is held, with both numbers in the reason."""
    snap = violating_snapshot(KNOBS, rate=4.0)
    obs, policy = Observation(snap, ready_pods(KNOBS)), make_policy()
    first = decide(TuningState.initial(KNOBS), obs, policy, CTX, NOW, SharedModel())
    assert first.action == "rollout", first.reason
    mean = ParamMean.from_dict(first.new_state.calibration)
    assert mean is not None and mean.since == mean.at == NOW.timestamp()
    cal = dict(first.new_state.calibration)
    cal.update(mean_compute=cal["compute"] * factor, mean_since=cal["mean_since"] - 3600.0)
    state = replace(TuningState.initial(KNOBS), calibration=cal)
    d = decide(state, obs, policy, CTX, NOW + timedelta(seconds=30), SharedModel())
    assert d.action == action, d.reason
    if action == "hold":
        assert "the mean fit of the last 60 min" in d.reason
        assert "not rolled out: no gain that holds at the recent windows' mean fit" in d.reason
        assert d.new_state.recommendation is None
        (_, applied), (_, proposed) = d.predictions
        assert proposed.capacity_rps <= applied.capacity_rps
    else:
        assert "the mean fit" not in d.reason


@settings(max_examples=15, deadline=None)
@given(compute=st.floats(0.5, 2.0), bandwidth=st.floats(0.5, 2.0), span=st.floats(0.0, 3.0))
def test_the_gain_acted_on_is_never_more_than_either_fit_predicts(
    compute: float, bandwidth: float, span: float
) -> None:
    """Whatever the recent fits said, the capacity a decision acts on is at most the lead
    fit's prediction and, once the mean spans a window (it then leads), at most this window's
    fit's gain over the applied knobs' capacity."""
    model, w, cal, now_rps, best_rps, best = _calibrated()
    mean = replace(
        ParamMean.start(cal, T0 - span * WINDOW_S),
        compute=cal.compute * compute,
        bandwidth=cal.bandwidth * bandwidth,
        at=T0,
    )
    fits = Fits(cal, mean if span >= 1.0 else None, mean_leads=span >= 1.0)
    now_rps = model.predict(KNOBS, w, fits.lead).capacity_rps
    best_rps = model.predict(best, w, fits.lead).capacity_rps
    g = robust_gain(model, KNOBS, best, w, fits.lead, fits.second, now_rps, best_rps)
    assert g.best_rps <= best_rps
    assert g.binds == (g.best_rps < best_rps)
    assert not (g.second_binds and g.bound_binds)
    if span < 1.0:
        assert g.second_ratio is None and not g.second_binds
    elif g.second_ratio is not None:
        assert g.best_rps <= now_rps * g.second_ratio * (1 + 1e-12)
    if g.bound_ratio is not None:
        assert g.best_rps <= now_rps * g.bound_ratio * (1 + 1e-12)
    if cal.at_admission_bound() is None:
        assert not g.bound_binds and g.bound_ratio is None


@pytest.mark.parametrize("rate", [0.05, 4.0, 40.0])
def test_the_same_window_again_changes_nothing_in_status(rate: float) -> None:
    """A reconcile that sees no new samples writes nothing: the status the state renders to
    after it is the one before it (1,000 idle deployments would otherwise patch status every
    reconcile; bench.scale counts those writes). The controller keeps the time stamps of a
    decision and a model check that did not change (`controller.keep_stamp`)."""
    snap = make_snapshot(KNOBS, rate=rate)
    obs, policy = Observation(snap, ready_pods(KNOBS)), make_policy()
    first = decide(TuningState.initial(KNOBS), obs, policy, CTX, NOW, SharedModel())
    later = first.new_state
    for k in range(1, 4):
        d = decide(later, obs, policy, CTX, NOW + timedelta(seconds=30 * k), SharedModel())
        assert d.action == first.action or first.action == "rollout", d.reason
        if first.action == "rollout":
            return
        assert _unstamped(d.new_state) == _unstamped(later)
        later = d.new_state


def _unstamped(state: TuningState) -> dict[str, Any]:
    out = state.to_dict()
    for key in ("lastDecision", "model"):
        if isinstance(out.get(key), dict):
            out[key] = {k: v for k, v in out[key].items() if k != "time"}
    return out


def test_the_candidate_acted_on_gains_most_under_both_fits() -> None:
    """When the recent windows' mean fit (which leads) disagrees with this window's, the
    candidate acted on is the one whose smaller gain (of the two fits') is the largest of the
    mean search's best and the window search's best, and the reason names both. Over a
    violated and a healthy window and means that move compute or bandwidth, some must
    switch."""
    switched = 0
    for snap in (violating_snapshot(KNOBS, rate=4.0), make_snapshot(KNOBS, rate=6.0)):
        switched += _switches(snap)
    assert switched > 0, "no mean fit moved the choice: the test shows nothing"


def _switches(snap: Snapshot) -> int:
    obs, policy = Observation(snap, ready_pods(KNOBS)), make_policy("Recommend")
    first = decide(TuningState.initial(KNOBS), obs, policy, CTX, NOW, MeanOnly())
    assert first.new_state.recommendation is not None, first.reason
    switched = 0
    for key, factor in itertools.product(("compute", "bandwidth"), (0.7, 0.85)):
        cal = dict(first.new_state.calibration)
        cal.update({f"mean_{key}": cal[key] * factor, "mean_since": cal["mean_since"] - 3600.0})
        state = replace(TuningState.initial(KNOBS), calibration=cal)
        d = decide(state, obs, policy, CTX, NOW + timedelta(seconds=30), MeanOnly())
        if d.new_state.recommendation is None:
            continue
        (_, current), (chosen, acted) = d.predictions
        fit = Calibration.from_dict(
            {k: v for k, v in d.new_state.calibration.items() if not k.startswith("mean_")}
        )
        mean = ParamMean.from_dict(d.new_state.calibration)
        assert mean is not None
        w = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
        model = MeanOnly()
        by_mean = model.predict(KNOBS, w, mean.calibration(fit))
        fits = Fits(fit, mean, mean_leads=prediction_agrees(snap, policy.slo, by_mean))
        assert current == model.predict(KNOBS, w, fits.lead)
        assert d.search_memo is not None
        lead_best = d.search_memo.result.best
        known, second_best = d.search_memo.other("window" if fits.mean_leads else "mean")
        assert lead_best is not None
        if known and second_best is not None:
            other = robust_gain(
                model, KNOBS, second_best, w, fits.lead, fits.second, current.capacity_rps,
                model.predict(second_best, w, fits.lead).capacity_rps,
            )  # fmt: skip
            assert acted.capacity_rps >= other.best_rps * (1 - 1e-9), (key, factor, chosen)
        if not chosen.same_as(lead_best):
            switched += 1
            both = f"the most that both {fits.lead_name()} and {fits.second_name()} predict"
            assert both in d.reason
            assert "admission cost per request" not in d.reason
            assert f"{fits.lead_name()} alone chose {lead_best.describe()}" in d.reason
    return switched
