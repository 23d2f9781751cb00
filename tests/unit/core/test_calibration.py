"""Calibration of the analytic model: a function of the window and of the fit at the knobs
before, never of how often the same window was fitted.

The operator calibrates every reconcile, handing the previous fit back as the prior. The same
window must give the same fit (and so the same recommendation) however many times it is
calibrated: otherwise an unchanged deployment flips its recommendation each reconcile (a new
Event every time) and no remembered search is ever reused (core/search_memo.py). A fit made
at other knobs centres the prior of the next window's fit (a sequential update: a window
whose steps all carry about the same tokens cannot tell compute from bandwidth).
"""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.unit.core.test_decide import CTX, KNOBS, SLO_DEFAULT, make_snapshot, violating_snapshot
from vllm_autotuner.core import perf_model
from vllm_autotuner.core.perf_model import AnalyticModel, Calibration, FitProblem, Workload, _params
from vllm_autotuner.core.snapshot import Snapshot
from vllm_autotuner.core.steady_state import Knobs3, steady_state
from vllm_autotuner.core.tuning_types import Knobs

OTHER = Knobs(1408, 256, 0.92)


def _fit(snap: Snapshot, prior: Calibration | None) -> tuple[AnalyticModel, Workload, Calibration]:
    model = AnalyticModel()
    w = Workload.from_snapshot(snap, SLO_DEFAULT, 0.9)
    return model, w, model.calibrate(snap, KNOBS, CTX, w, prior)


def test_recalibrating_the_same_window_from_its_own_fit_changes_nothing() -> None:
    """Found by test_decide.py::test_recommend_mode_publishes_but_never_applies: with the
    previous fit as Powell's starting point, `compute` went 0.87 -> 1.03 -> 0.98 on one
    unchanged window and the recommendation flipped 1408 <-> 1728 tokens every reconcile."""
    snap = violating_snapshot()
    _, _, first = _fit(snap, None)
    model, w, again = _fit(snap, first)
    assert again.to_dict() == first.to_dict()
    _, _, third = _fit(snap, again)
    assert third.to_dict() == first.to_dict()
    assert model.predict(OTHER, w, again) == model.predict(OTHER, w, first)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    itl_mean=st.floats(10.0, 40.0),
    tail=st.floats(1.2, 3.0),
    rate=st.sampled_from([2.0, 4.0, 8.0]),
    prior_bw=st.floats(0.3, 3.0),
    prior_compute=st.floats(0.3, 3.0),
)
def test_the_fit_does_not_depend_on_the_prior_efficiencies(
    itl_mean: float, tail: float, rate: float, prior_bw: float, prior_compute: float
) -> None:
    """Whatever efficiencies an earlier window left in status, this window's fit is its own."""
    snap = make_snapshot(rate=rate, itl_mean=itl_mean, itl_p95=itl_mean * tail)
    _, _, clean = _fit(snap, None)
    _, _, primed = _fit(snap, Calibration(bandwidth=prior_bw, compute=prior_compute))
    for key in ("bandwidth", "compute", "admit_s", "jitter", "api_s"):
        assert primed.to_dict()[key] == clean.to_dict()[key], key


def test_the_model_is_deterministic_across_instances() -> None:
    """decide()'s determinism rests on the model's: fresh instances agree exactly (the
    property tests share one caching model, so this is where it is checked)."""
    a, wa, ca = _fit(violating_snapshot(), None)
    b, wb, cb = _fit(violating_snapshot(), None)
    assert ca == cb
    assert a.predict(OTHER, wa, ca) == b.predict(OTHER, wb, cb)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    itl_mean=st.floats(8.0, 11.0),
    under_10ms=st.floats(0.6, 0.97),
    rate=st.floats(4.0, 10.0),
    running=st.floats(8.0, 25.0),
)
def test_the_fit_puts_no_steps_above_a_bound_the_window_never_crossed(
    itl_mean: float, under_10ms: float, rate: float, running: float
) -> None:
    """Found on tight-itl-8b-h100 (bench/tuning): every inter-token latency of the window under
    25 ms, yet every other fit of 640/608 put ~5 % of them above it (jitter 0.25, compute
    0.4), predicted a p99 of 35-53 ms and a capacity of 3 req/s/pod where the truth is 30.
    The window's tail must bound the fit's: under 1 % above 25 ms at the window's own load."""
    knobs = Knobs(640, 608, 0.92)
    n = 50_000.0
    buckets = ((10.0, n * under_10ms), (25.0, n), (50.0, n), (math.inf, n))
    snap = make_snapshot(knobs, rate=rate, itl_mean=itl_mean, running_max=running / 0.6)
    snap = replace(
        snap,
        itl=replace(snap.itl, buckets=buckets),
        steps_per_s=1000.0 / (itl_mean * 0.98),
    )
    model = AnalyticModel()
    w = Workload.from_snapshot(snap, SLO_DEFAULT, 0.9)
    cal = model.calibrate(snap, knobs, CTX, w, None)
    *_, steady = model._latencies(knobs, w, cal, w.request_rate, model._kv(knobs, cal))
    assert steady.stable
    assert steady.itl_below(0.025) >= 0.99, (cal, steady.itl_below(0.025))


EARLIER = Calibration(
    bandwidth=0.7,
    compute=1.3,
    admit_s=0.0015,
    jitter=0.08,
    fitted=True,
    fitted_budget=512.0,
    fitted_seqs=512.0,
)


def _distance(a: Calibration, b: Calibration) -> float:
    return math.dist(_params(a), _params(b))


def test_a_fit_at_other_knobs_centres_the_next_windows_prior() -> None:
    snap = violating_snapshot()
    _, _, alone = _fit(snap, None)
    _, _, primed = _fit(snap, EARLIER)
    assert alone.prior_centre() is None
    centre = primed.prior_centre()
    assert centre is not None
    assert _params(centre) == _params(EARLIER)
    assert (primed.fitted_budget, primed.fitted_seqs) == (
        float(KNOBS.max_num_batched_tokens),
        float(KNOBS.max_num_seqs),
    )
    assert _distance(primed, EARLIER) < _distance(alone, EARLIER)
    # The window still speaks: the primed fit explains it as well as the fit alone, or nearly.
    assert primed.fit_error is not None and alone.fit_error is not None
    assert primed.fit_error <= alone.fit_error + 0.05


def test_the_same_window_refitted_keeps_the_centre_it_was_given() -> None:
    """A fit at these knobs is not its own next prior: refitting the same window from it
    keeps the centre of the knobs before, so nothing drifts and status is not rewritten."""
    snap = violating_snapshot()
    _, _, first = _fit(snap, EARLIER)
    _, _, again = _fit(snap, first)
    _, _, third = _fit(snap, Calibration.from_dict(again.to_dict()))
    assert again.to_dict() == first.to_dict() == third.to_dict()


def test_the_centre_and_the_fitted_knobs_survive_status() -> None:
    _, _, fit = _fit(violating_snapshot(), EARLIER)
    back = Calibration.from_dict(fit.to_dict())
    assert back == fit


def test_a_remembered_prediction_is_the_prediction() -> None:
    """predict() remembers its answers (perf_model.PREDICT_CACHE); the memo must give exactly
    what the model computes, and tell apart calibrations that differ in any field."""
    model, w, cal = _fit(violating_snapshot(), None)
    perf_model._prediction.cache_clear()
    fresh = model._predict(OTHER, w, cal, True)
    assert model.predict(OTHER, w, cal) == fresh
    assert model.predict(OTHER, w, cal) is model.predict(OTHER, w, cal)
    slower = replace(cal, compute=cal.compute * 0.5)
    assert model.predict(OTHER, w, slower) == model._predict(OTHER, w, slower, True)
    assert model.predict(OTHER, w, slower) != fresh


# vLLM's inter-token latency histogram bounds (s) up to 100 ms.
_ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1)


def _window_of(engine: Calibration, knobs: Knobs, rate: float, running: float) -> FitProblem:
    """The fit problem of a window the model itself produced with `engine`'s parameters: its
    mean ITL, mean step and the histogram's fractions at vLLM's bounds."""
    shape = perf_model.shape_of(CTX)
    w = Workload.from_snapshot(make_snapshot(knobs, rate=rate), SLO_DEFAULT, 1.0)
    traffic = perf_model._traffic(w, rate)
    k3 = Knobs3(knobs.max_num_batched_tokens, knobs.max_num_seqs, 200_000.0)
    st = steady_state(
        traffic, k3, perf_model._curve(shape, engine), perf_model._costs(engine), running=running
    )
    assert st.stable
    fracs = tuple((b, st.itl_below(b)) for b in _ITL_BOUNDS)
    shown = [(b, f) for b, f in fracs if f > 0.01]
    cut = next((i for i, (_, f) in enumerate(shown) if f >= 0.995), len(shown) - 1)
    return perf_model.FitProblem(
        shape,
        traffic,
        k3,
        running,
        math.log(st.itl_mean_s),
        math.log(st.step_mean_s),
        tuple(shown[: cut + 1]),
    )


def _objective(problem: FitProblem, x: tuple[float, ...] | list[float]) -> float:
    """The fit's own objective (perf_model._residuals, squared and summed)."""
    return perf_model._sq(perf_model._residuals(problem, x))


@settings(max_examples=5, deadline=None, derandomize=True)
@given(
    bandwidth=st.floats(0.75, 1.05),
    compute=st.floats(0.6, 1.1),
    admit_ms=st.floats(0.0, 2.5),
    budget=st.sampled_from([384, 512, 640, 1024, 2048]),
    load=st.sampled_from([(5.0, 10.0), (9.0, 22.0), (18.0, 45.0)]),
)
# Windows where Powell stopped 0.046-0.066 above the engine's own objective.
@example(bandwidth=0.921, compute=0.957, admit_ms=0.53, budget=2048, load=(9.0, 22.0))
@example(bandwidth=0.835, compute=0.632, admit_ms=2.13, budget=1024, load=(5.0, 10.0))
@example(bandwidth=0.933, compute=0.678, admit_ms=0.11, budget=640, load=(9.0, 22.0))
def test_the_fit_finds_a_minimum_at_least_as_deep_as_the_engine_that_made_the_window(
    bandwidth: float, compute: float, admit_ms: float, budget: int, load: tuple[float, float]
) -> None:
    """A window the model itself produced has a fit at least as good as its own parameters:
    the optimiser reaches the valley. Found on tight-itl-8b-h100: decode steps near the 10 ms
    bound make a valley 2 % wide in bandwidth; Powell stepped over it and stopped at an
    objective 70 times the minimum's, with compute 0.64 instead of 0.85 (capacity 12 req/s
    against 30). The objective counts the prior, so the engine's own point is not zero; the
    sample path's residuals are rough, and two engines can explain one window about equally
    well, so the fit may stop anywhere within 2e-3 of it. Measured on 30 such windows:
    Powell missed by more than 1e-3 on 13, worst 0.066; Nelder-Mead on 3, worst 0.007."""
    engine = replace(
        Calibration(), bandwidth=bandwidth, compute=compute, admit_s=admit_ms / 1000.0, jitter=0.05
    )
    rate, running = load
    problem = _window_of(engine, Knobs(budget, 256, 0.92), rate, running)
    x, _ = perf_model._fit_step_times.__wrapped__(problem)
    truth = _objective(problem, _params(engine))
    # 2e-3 of squared residuals: every residual within about 4 % of the window's.
    assert _objective(problem, x) <= truth + 2e-3, (x, _params(engine))
