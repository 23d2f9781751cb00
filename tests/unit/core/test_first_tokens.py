"""What the model assumes of first tokens, and where the step-time fit starts: each was
wrong on a held-out RAG window (Qwen2.5-32B on two L40S, prompts spread evenly over
3,000-6,000 tokens), and the model predicted no capacity where the truth has 0.13 req/s/pod.

- vLLM's prompt-length buckets (1-2-5 tokens) are too coarse for a tail: that window's two
  buckets and mean give a log-normal of sigma 0.38, with a p95 of 8,000 tokens. The prefill
  times show the same prompts on finer buckets; the calibration reads the spread from both.
- Decode steps near an ITL bucket bound make a valley in bandwidth narrower than the fit's
  coarse grid of starts; a finer line of starts finds it.
- First-token quantiles need more arrivals than the model's step path holds where prefills
  are long: their queue's busy periods are rare in a short path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from statistics import NormalDist

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.unit.core.test_decide import CTX, SLO_DEFAULT, make_snapshot
from vllm_autotuner.core import perf_model
from vllm_autotuner.core import steady_state as ss
from vllm_autotuner.core.perf_model import Calibration, Workload
from vllm_autotuner.core.physics import lognormal_sigma
from vllm_autotuner.core.snapshot import LatencySummary, LengthSummary, Snapshot, cdf_points
from vllm_autotuner.core.steady_state import Knobs3, SteadyState, steady_state
from vllm_autotuner.core.tuning_types import Knobs

QWEN = replace(
    CTX,
    model="Qwen/Qwen2.5-32B-Instruct",
    gpu_product="NVIDIA-L40S",
    tensor_parallel_size=2,
    max_model_len=16384,
)
KNOBS = Knobs(2048, 256, 0.92)
ENGINE = Calibration(bandwidth=0.82, compute=0.75, admit_s=0.0, jitter=0.05)
KV = 68_000.0
# vLLM's bucket bounds: request_prompt_tokens (1-2-5 tokens), request_prefill_time_seconds
# (in ms here, as the adapter reads them) and inter_token_latency_seconds (s) up to 100 ms.
_LENGTH_BOUNDS = (100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0)
_PREFILL_BOUNDS_MS = (300.0, 500.0, 800.0, 1000.0, 1500.0, 2000.0, 2500.0, 5000.0, 10000.0)
_ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1)
N = 1000.0
GRID_STEP = perf_model._PROMPT_SIGMAS[1] / perf_model._PROMPT_SIGMAS[0]


def _p90(mean: float, sigma: float) -> float:
    return math.exp(math.log(mean) - 0.5 * sigma * sigma + 1.2816 * sigma)


def _engine_at(prompt_mean: float, sigma: float, rate: float) -> tuple[Workload, SteadyState]:
    """The model's own steady state of the 32B pod with prompts of this spread."""
    w = Workload(rate, prompt_mean, _p90(prompt_mean, sigma), 150.0, 280.0, slo=SLO_DEFAULT)
    traffic = replace(perf_model._traffic(w, rate), prompt_sigma=sigma)
    shape = perf_model.shape_of(QWEN)
    k3 = Knobs3(KNOBS.max_num_batched_tokens, KNOBS.max_num_seqs, KV)
    steady = steady_state(
        traffic, k3, perf_model._curve(shape, ENGINE), perf_model._costs(ENGINE)
    )  # fmt: skip
    assert steady.stable
    return w, steady


def _lognormal_buckets(mean: float, sigma: float) -> tuple[tuple[float, float], ...]:
    mu = math.log(mean) - 0.5 * sigma * sigma
    cdf = [0.5 * math.erfc(-(math.log(b) - mu) / (sigma * math.sqrt(2.0))) for b in _LENGTH_BOUNDS]
    return (*((b, round(N * f)) for b, f in zip(_LENGTH_BOUNDS, cdf, strict=True)), (math.inf, N))


def _window(w: Workload, steady: SteadyState, lengths: tuple[tuple[float, float], ...]) -> Snapshot:
    """A window of that steady state: its prefill-time histogram at vLLM's bounds, and the
    given prompt-length histogram."""
    prefill = tuple((b, round(N * steady.prefill_below(b / 1000.0))) for b in _PREFILL_BOUNDS_MS)
    snap = make_snapshot(KNOBS, rate=w.request_rate, prompt=(w.prompt_mean, w.prompt_p90))
    return replace(
        snap,
        running_mean=steady.running,
        prompt_len=LengthSummary(mean=w.prompt_mean, buckets=lengths),
        prefill_time=LatencySummary(
            mean_ms=steady.prefill_mean_s * 1000.0, buckets=(*prefill, (math.inf, N))
        ),
    )


def _fitted_sigma(snap: Snapshot, w: Workload) -> float | None:
    cal = perf_model._fit_prompt_sigma(
        ENGINE, perf_model.shape_of(QWEN), snap, KNOBS, w, KV
    )  # fmt: skip
    return cal.prompt_sigma


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    sigma=st.floats(0.1, 0.7),
    prompt_mean=st.floats(2500.0, 6000.0),
    rate=st.floats(0.05, 0.2),
)
def test_the_prompt_spread_is_read_back_from_a_window_the_model_made(
    sigma: float, prompt_mean: float, rate: float
) -> None:
    """Lengths and prefill times of one log-normal spread: the fit finds it within one
    step of its grid of spreads."""
    w, steady = _engine_at(prompt_mean, sigma, rate)
    got = _fitted_sigma(_window(w, steady, _lognormal_buckets(prompt_mean, sigma)), w)
    assert got is not None
    assert abs(math.log(got / sigma)) <= math.log(GRID_STEP) * 1.01, (got, sigma)


def test_prefill_times_overrule_length_buckets_that_cannot_show_a_tail() -> None:
    """The held-out window's lengths (mean 4,649; none under 2,000 tokens, 65 % under 5,000,
    all under 10,000) read alone as sigma 0.38; prefill times of prompts spread 0.15 bring
    the fit down to them."""
    lengths = ((1000.0, 0.0), (2000.0, 0.0), (5000.0, 646.0), (10000.0, N), (math.inf, N))
    w, steady = _engine_at(4649.0, 0.15, 0.12)
    alone = lognormal_sigma(
        4649.0, LengthSummary(mean=4649.0, buckets=lengths).lognormal_p90() or 0
    )
    assert alone > 0.3
    got = _fitted_sigma(_window(w, steady, lengths), w)
    assert got is not None and got < 0.22, (got, alone)


def test_a_window_with_too_few_prefills_keeps_the_length_histograms_spread() -> None:
    w, steady = _engine_at(4000.0, 0.3, 0.1)
    snap = _window(w, steady, _lognormal_buckets(4000.0, 0.3))
    few = replace(
        snap, prefill_time=replace(snap.prefill_time, buckets=((300.0, 0.0), (math.inf, 5.0)))
    )
    assert _fitted_sigma(few, w) is None
    # Everything in the first bucket (an 8B model's prefills) says nothing of the spread.
    fast = replace(
        snap, prefill_time=LatencySummary(mean_ms=80.0, buckets=((300.0, N), (math.inf, N)))
    )
    assert _fitted_sigma(fast, w) is None


def test_the_calibrated_spread_is_what_predictions_use_and_survives_status() -> None:
    w, _ = _engine_at(4649.0, 0.38, 0.12)
    narrow = replace(ENGINE, prompt_sigma=0.15)
    assert perf_model._traffic(w, 0.12, narrow).prompt_sigma == 0.15
    assert (
        perf_model._traffic(w, 0.12, ENGINE).prompt_sigma
        == perf_model._traffic(w, 0.12).prompt_sigma
    )
    assert Calibration.from_dict(narrow.to_dict()) == narrow
    model = perf_model.AnalyticModel()
    model.bind(QWEN)
    wide_p = model.predict(KNOBS, w, ENGINE, capacity=False)
    narrow_p = model.predict(KNOBS, w, narrow, capacity=False)
    assert narrow_p.ttft_ms < wide_p.ttft_ms


RAG_32B = """\
name: rag-32b-l40s-window
description: one pod of RAG on Qwen2.5-32B, TP2 on L40S, at a constant rate
model: Qwen/Qwen2.5-32B-Instruct
gpu: L40S
tensor_parallel_size: 2
max_model_len: 16384
replicas: 1
horizon_s: 1800
seed: 7
workload: {preset: rag, rate: 0.12}
slo:
  ttft: {percentile: 95, threshold_ms: 3000}
  itl: {percentile: 95, threshold_ms: 80}
bounds:
  max_num_batched_tokens: {min: 256, max: 16384, max_step: 8192}
  max_num_seqs: {min: 16, max: 512, max_step: 256}
  gpu_memory_utilization: {min: 0.80, max: 0.96, max_step: 0.05}
reality:
  bandwidth_efficiency: 0.82
  compute_efficiency: 0.75
  per_request_overhead_s: 0.003
  step_jitter: 0.07
"""


def test_a_simulated_rag_window_on_a_32b_pod_calibrates_to_its_engine(tmp_path: Path) -> None:
    """The simulator's engine behind bench.tuning's world (the preset's prompts are uniform
    over 3,000-6,000 tokens), read through the operator's Prometheus adapter. Decode steps
    near 63 ms sit under the 75 ms bucket bound: the valley in bandwidth is about 0.75-0.87,
    between the coarse grid's 0.675 and 1.01. From the grid alone, on this window, the fit
    stopped at compute 1.08 (the engine's 0.75) with the mean ITL 13 % off; on the held-out
    scenario's three pods at bandwidth 1.6 and 35 % off. The length buckets alone give
    sigma 0.38; uniform lengths of that mean and range have the spread of sigma 0.19."""
    from bench.model_fit.__main__ import observe
    from bench.tuning.methods import context, vllm_defaults
    from bench.tuning.scenario import load

    path = tmp_path / "rag.yaml"
    path.write_text(RAG_32B)
    s = load(str(path))
    knobs = vllm_defaults(s)
    snap = observe(s, knobs, 0.12, seconds=1800.0)
    assert snap.available, snap.reason
    policy = s.policy("Auto")
    model = perf_model.AnalyticModel()
    w = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
    cal = model.calibrate(snap, knobs, context(s), w, None)
    assert 0.82 / 1.15 < cal.bandwidth < 0.82 * 1.15, cal
    assert 0.75 / 1.25 < cal.compute < 0.75 * 1.25, cal
    assert cal.fit_error is not None and cal.fit_error < 0.1, cal
    assert lognormal_sigma(w.prompt_mean, w.prompt_p90) > 0.35
    assert cal.prompt_sigma is not None and cal.prompt_sigma < 0.3, cal


def _rag_8b_first_tokens(tail_arrivals: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """The TTFT p95 of long RAG prompts on an 8B pod at 768 tokens and 1.5 req/s (about 100
    arrivals in the STEPS-long path), with first tokens sampled from `tail_arrivals`."""
    monkeypatch.setattr(ss, "TAIL_PATH_ARRIVALS", tail_arrivals)
    ctx = replace(CTX, gpu_product="A100-80GB", max_model_len=16384)
    engine = Calibration(bandwidth=0.92, compute=0.8, admit_s=0.003, jitter=0.05)
    w = Workload(1.5, 4500.0, _p90(4500.0, 0.3), 150.0, 280.0, prefix_hit_rate=0.2)
    traffic = replace(perf_model._traffic(w, 1.5), prompt_sigma=0.3)
    k3 = Knobs3(768, 256, 400_000.0)
    steady = steady_state(
        traffic, k3, perf_model._curve(perf_model.shape_of(ctx), engine),
        perf_model._costs(engine),
    )  # fmt: skip
    assert steady.stable
    return steady.ttft(0.95)


def test_first_token_quantiles_come_from_a_path_long_enough_for_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The queue in front of long prefills has busy periods longer than the STEPS-long path
    shows often: its p95 was 21 % under that of 1,600 arrivals (888 against 1,122 ms).
    TAIL_PATH_ARRIVALS (200) are within 10 % of it (1,164 ms)."""
    default = ss.TAIL_PATH_ARRIVALS
    reference = _rag_8b_first_tokens(1600, monkeypatch)
    assert abs(_rag_8b_first_tokens(default, monkeypatch) / reference - 1.0) < 0.10
    short = _rag_8b_first_tokens(0, monkeypatch)  # 0: the STEPS-long path's own arrivals
    assert short < reference * 0.9, (short, reference)


# ------------------------------------------------------------- the time outside the engine

# vLLM's time_to_first_token_seconds bucket bounds (s), as vllm/v1/metrics/loggers.py sets them.
_TTFT_BOUNDS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


def _lognormal_ttft(median_s: float, sigma: float) -> Callable[[float], float]:
    z = NormalDist()
    return lambda q: median_s * math.exp(sigma * z.inv_cdf(q))


def _window_fractions(
    median_s: float, sigma: float, shift_s: float, bounds: Sequence[float]
) -> list[tuple[float, float]]:
    """The informative (bound, fraction at or under) of a window whose first tokens are the
    log-normal's, `shift_s` later, counted as a histogram of 10,000 (`cdf_points`)."""
    z = NormalDist()
    cum = [
        (
            b * 1000.0,
            0.0 if b <= shift_s else 1e4 * z.cdf(math.log((b - shift_s) / median_s) / sigma),
        )
        for b in bounds
    ]
    return [(b / 1000.0, f) for b, f in cdf_points([*cum, (math.inf, 1e4)])]


def _misfit(
    ttft: Callable[[float], float], shift: float, points: Sequence[tuple[float, float]]
) -> float:
    model = sorted(ttft(float(q)) for q in perf_model._TTFT_QUANTILES)
    return sum((sum(1 for v in model if v <= b - shift) / len(model) - f) ** 2 for b, f in points)


def test_a_median_inside_a_wide_bucket_puts_nothing_outside_the_engine() -> None:
    """The held-out 32B RAG window's first tokens: 1.5 s of prefill and queue, 3 ms outside
    the engine. Interpolated in the 1.0-2.5 s bucket its median reads 1.73 s, and the median's
    distance put 0.2 s outside the engine; the bucket counts put almost none."""
    median, sigma, outside = 1.5, 0.25, 0.003
    points = _window_fractions(median, sigma, outside, _TTFT_BOUNDS)
    (lo, f_lo), (hi, f_hi) = points[0], points[1]
    interpolated = lo + (0.5 - f_lo) / (f_hi - f_lo) * (hi - lo)
    assert interpolated - median > 0.2  # what the median's distance read
    assert perf_model._api_shift(_lognormal_ttft(median, sigma), points) <= 0.02


@settings(deadline=None)
@given(
    median=st.floats(0.02, 3.0),
    sigma=st.floats(0.1, 0.8),
    outside=st.one_of(st.just(0.0), st.floats(0.001, 2.0)),
    coarse=st.booleans(),
)
def test_the_time_outside_the_engine_fits_the_bucket_counts(
    median: float, sigma: float, outside: float, coarse: bool
) -> None:
    """The shift found fits the window's fractions at least as well as the true one, and
    on fine buckets (5 % apart) it is the true one within the model sample's resolution."""
    fine = tuple(0.001 * 1.05**k for k in range(240))
    points = _window_fractions(median, sigma, outside, _TTFT_BOUNDS if coarse else fine)
    assume(points)
    ttft = _lognormal_ttft(median, sigma)
    found = perf_model._api_shift(ttft, points)
    assert _misfit(ttft, found, points) <= _misfit(ttft, outside, points) + 1e-12
    if not coarse:
        slack = 0.05 * median * sigma + 0.001
        assert abs(found - outside) <= slack, (found, outside)
