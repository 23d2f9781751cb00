"""The V1 scheduler in steady state (core/steady_state.py): monotone where physics is.

On the deployment's roofline (Llama-3.1-8B on an H100, the prior efficiencies), for any
traffic and knobs:
- more traffic never shortens steps or the mean and median inter-token gap (within the
  noise of one sample path). The tail percentiles (ITL p90-p99, TTFT) are NOT monotone in
  the model: strict xfails below record by how much;
- a smaller token budget never lengthens the longest inter-token gap at the same rate (a
  step carries at most a budget of prefill). It does not shorten every tail percentile: it
  spreads each prefill over more steps (strict xfail below, with the measured numbers);
- quantiles are ordered, `itl_below` is the inverse of `itl`;
- the steady state exists only inside the utilisation limits, each named when it fails:
  max_num_seqs, the KV cache, the token budget.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.unit.core.test_decide import CTX, KNOBS, SLO_DEFAULT, make_snapshot
from vllm_autotuner.core import steady_state as steady_state_module
from vllm_autotuner.core.perf_model import AnalyticModel, Calibration, Workload, _costs
from vllm_autotuner.core.physics import lognormal_sigma
from vllm_autotuner.core.steady_state import (
    MAX_SEQ_UTIL,
    MAX_TOKEN_UTIL,
    Knobs3,
    SteadyState,
    StepCurve,
    Traffic,
    shared_evaluations,
    steady_state,
)

QUANTILES = (0.5, 0.9, 0.95, 0.99)
# One sample path: "non-decreasing" holds up to this relative noise (TTFT: plus 2 ms).
# Measured worst decrease over 2,500 random pairs (rate x 1.02-1.5): step mean 0.3%, ITL
# mean 2.4% (0.13 running: the per-step decode count is clipped at one), ITL p50 0.3%.
# The tail percentiles are not always monotone (a strict xfail below, with the numbers).
STEP_NOISE = 0.03
TTFT_NOISE = 0.05


def curve_at() -> StepCurve:
    model = AnalyticModel()
    model.bind(CTX)
    return model._curve_at(Calibration())


CURVE = curve_at()
COSTS = _costs(Calibration(admit_s=0.0002))


def traffic(rate: float, prompt: float, gen: float, hit: float = 0.0) -> Traffic:
    return Traffic(
        rate=rate,
        prompt_mean=prompt,
        prompt_sigma=lognormal_sigma(prompt, 2.0 * prompt),
        gen_mean=gen,
        gen_p90=2.0 * gen,
        prefix_hit_rate=hit,
    )


def state(t: Traffic, budget: int = 8192, seqs: int = 1024, kv: float | None = 4e5) -> SteadyState:
    return steady_state(t, Knobs3(budget, seqs, kv), CURVE, COSTS)


workloads = st.tuples(
    st.sampled_from([200.0, 600.0, 2000.0, 6000.0]),  # prompt mean
    st.sampled_from([50.0, 250.0, 800.0]),  # output mean
    st.sampled_from([0.0, 0.5]),  # prefix-cache hit rate
)


# ------------------------------------------------------------------------------------- tables


def test_light_traffic_is_stable_and_decode_bound() -> None:
    s = state(traffic(0.5, 600.0, 250.0))
    assert s.stable and s.why == ""
    assert 0.005 < s.step_mean_s < 0.03  # an 8B decode step on an H100: ~7-15 ms
    assert s.itl(0.5) <= s.itl(0.99)
    assert s.token_util < 0.2 and s.seq_util < 0.2


@pytest.mark.parametrize(
    ("t", "knobs", "why"),
    [
        (traffic(200.0, 600.0, 250.0), Knobs3(8192, 64, None), "max_num_seqs"),
        (traffic(1.0, 600.0, 2000.0), Knobs3(8192, 1024, 5e4), "KV cache"),
        (traffic(20.0, 6000.0, 10.0), Knobs3(1024, 1024, None), "token budget"),
    ],
)
def test_each_limit_is_named_when_the_steady_state_does_not_exist(
    t: Traffic, knobs: Knobs3, why: str
) -> None:
    s = steady_state(t, knobs, CURVE, COSTS)
    assert not s.stable and why in s.why
    assert math.isinf(s.itl(0.95)) and math.isinf(s.ttft(0.5)) and s.itl_below(1.0) == 0.0
    if why == "max_num_seqs":
        assert s.seq_util >= MAX_SEQ_UTIL
    if why == "token budget":
        assert s.token_util >= MAX_TOKEN_UTIL


# --------------------------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(w=workloads, r1=st.floats(0.05, 40.0), factor=st.floats(1.05, 3.0))
def test_more_traffic_never_shortens_steps_gaps_or_first_tokens(
    w: tuple[float, float, float], r1: float, factor: float
) -> None:
    """Utilisations, steps and gaps (mean, median), within STEP_NOISE; finite first tokens.
    The tails are not monotone in the model (strict xfails below)."""
    prompt, gen, hit = w
    lo, hi = state(traffic(r1, prompt, gen, hit)), state(traffic(r1 * factor, prompt, gen, hit))
    assert hi.token_util >= lo.token_util and hi.seq_util >= lo.seq_util
    assert hi.kv_util >= lo.kv_util
    if not lo.stable:
        assert not hi.stable  # past a limit at one rate, past it at any higher rate
        return
    assume(hi.stable)
    assert hi.step_mean_s >= lo.step_mean_s * (1 - STEP_NOISE)
    assert hi.itl_mean_s >= lo.itl_mean_s * (1 - STEP_NOISE)
    assert hi.itl(0.5) >= lo.itl(0.5) * (1 - STEP_NOISE)
    assert math.isfinite(lo.ttft(0.99)) and math.isfinite(hi.ttft(0.99))


@pytest.mark.xfail(
    strict=True,
    reason="measured with Little's law on the path's own mean step: with under 2 requests "
    "running and 6,000-token prompts, the mean ITL falls 7.4 % for 5 % more traffic (7.86 -> "
    "7.28 ms at 1.71 -> 1.80 req/s; worst of prompts 2,000-6,000 over 1-25 req/s in steps of "
    "5 %): the path's few prefill-carrying steps weigh on the mean by whole steps (sample-path "
    "noise). Before that change: 6.25 req/s, 14.74 -> 13.98 ms.",
)
def test_the_mean_gap_never_falls_with_more_traffic_when_few_requests_run() -> None:
    for prompt in (2000.0, 4000.0, 6000.0):
        rate = 1.0
        while rate < 25.0:
            lo, hi = (state(traffic(r, prompt, 50.0)) for r in (rate, rate * 1.05))
            if lo.stable and hi.stable:
                assert hi.itl_mean_s >= lo.itl_mean_s * (1 - STEP_NOISE), (prompt, rate)
            rate *= 1.05


def test_the_tail_percentiles_never_fall_with_more_traffic() -> None:
    """Was a strict xfail until first tokens came from TAIL_PATH_ARRIVALS arrivals: 8.586 ->
    9.154 req/s (2,000-token prompts, 50-token outputs) moved the TTFT p95 from 244 to 220 ms
    and the p99 from 337 to 283 ms on the 1,000-step path's 100-odd arrivals; from 200 they
    move 278 -> 268 and 362 -> 347 ms, within the noise allowance. (The ITL p95 of that pair
    read 11.3 -> 8.5 ms when the xfail was written; on the code before this change it was
    already 38.1 -> 39.9 ms.)"""
    for rates in ((8.586, 9.154), (16.85, 20.27)):
        lo, hi = (state(traffic(r, 2000.0, 50.0)) for r in rates)
        assert lo.stable and hi.stable
        for q in (0.9, 0.95, 0.99):
            assert hi.itl(q) >= lo.itl(q) * (1 - STEP_NOISE), (rates, q)
            assert hi.ttft(q) >= lo.ttft(q) * (1 - TTFT_NOISE) - 0.002, (rates, q)


@pytest.mark.xfail(
    strict=True,
    reason="measured: the path is 1,000 steps whatever the rate, so TTFT quantiles come from "
    "rate x 1000 x step arrivals: 28 at 4.34 req/s on an 8B/H100 (6.4 ms steps). Over 0.5-44 "
    "req/s in steps of 25 % (600-token prompts, 50-token outputs), 14 of 84 quantile pairs "
    "fall by more than the noise allowance, worst 2.22 -> 2.78 req/s: TTFT p95 60.2 -> 42.2 "
    "ms. (Before Little's law ran on the path's mean step: 4.34 -> 5.42 req/s, p99 76.2 -> "
    "36.1 ms; over 24 workloads x 31 rate steps of 25%, TTFT fell 980 times where the path "
    "had < 200 arrivals, down to 0.47x.)",
)
def test_first_tokens_are_not_noise_at_a_few_requests_per_second() -> None:
    for k in range(10, 31):
        rate = 0.05 * 1.25**k
        lo, hi = state(traffic(rate, 600.0, 50.0)), state(traffic(rate * 1.25, 600.0, 50.0))
        if not (lo.stable and hi.stable):
            continue
        for q in QUANTILES:
            assert hi.ttft(q) >= lo.ttft(q) * (1 - TTFT_NOISE) - 0.002, (rate, q)


def test_a_quiet_pod_has_a_finite_first_token_time_and_a_capacity() -> None:
    """Bug (fixed in steady_state._sample_path): below about 1 / (1000 steps x step time)
    (0.17 req/s on an 8B/H100) the path held no arrival, TTFT was infinite although the
    state was stable, and the model gave such a pod a capacity of 0 req/s (22 at 0.2)."""
    s = state(traffic(0.05, 600.0, 250.0))
    assert s.stable and math.isfinite(s.ttft(0.95)) and s.ttft(0.95) < 1.0
    model = AnalyticModel()
    snap = make_snapshot(rate=0.5, itl_mean=8.0, itl_p95=10.0, running_max=3.0)
    w = Workload.from_snapshot(snap, SLO_DEFAULT, 0.9)
    cal = model.calibrate(snap, KNOBS, CTX, w, None)
    quiet, busier = model.predict(KNOBS, w.at_rate(0.1), cal), model.predict(KNOBS, w, cal)
    assert quiet.meets_slo and math.isfinite(quiet.ttft_ms)
    assert quiet.capacity_rps == pytest.approx(busier.capacity_rps, rel=0.1)


def test_a_rare_arrival_is_not_queued_behind_a_rate_it_does_not_have() -> None:
    """Bug (fixed in steady_state._path): below the rate that puts MIN_PATH_ARRIVALS in a
    1,000-step path, first tokens were sampled at that rate instead (3 req/s here), so every
    quieter pod showed the same queueing. A RAG window on Qwen2.5-32B / 2 x L40S at 0.14
    req/s per pod, 1.5 s of prefill per prompt, read a TTFT p90 of 4.7 s against its 2.5 s.
    6,000-token prompts at a 256-token budget: p50 166 ms at 0.05 req/s, 315 at 3."""
    quiet = state(traffic(0.05, 6000.0, 50.0), budget=256)
    busy = state(traffic(3.0, 6000.0, 50.0), budget=256)
    assert quiet.stable and busy.stable
    assert quiet.ttft(0.5) < 0.7 * busy.ttft(0.5)


@settings(max_examples=60, deadline=None)
@given(
    w=workloads,
    rate=st.floats(0.05, 40.0),
    budgets=st.tuples(st.sampled_from([512, 1024, 2048, 4096]), st.sampled_from([2, 4, 8])),
)
def test_a_smaller_budget_never_lengthens_the_longest_gap(
    w: tuple[float, float, float], rate: float, budgets: tuple[int, int]
) -> None:
    """The longest step carries at most a budget of prefill. Without step-time jitter: the
    jitter is drawn per step index, and when a smaller budget spreads one prompt over two
    steps every later prompt lands one step off, on another draw (28.75 against 26.92 ms for
    the same 200-token prompts at 21 req/s, 2048 vs 8192 tokens). Within 1%: the running
    set's size is drawn per step around its mean, which moved the longest gap by 0.3% in 2
    of 1,842 stable grid points (prompt 600, output 800, 10 req/s, 512 vs 1024 tokens)."""
    prompt, gen, hit = w
    small, factor = budgets
    t = traffic(rate, prompt, gen, hit)
    costs = _costs(Calibration(admit_s=0.0002, jitter=0.0))

    def at(budget: int) -> SteadyState:
        return steady_state(t, Knobs3(budget, 256, 4e5), CURVE, costs)

    a, b = at(small), at(small * factor)
    assume(a.stable and b.stable)
    assert a.itl(1.0) <= b.itl(1.0) * 1.01


@pytest.mark.xfail(
    strict=True,
    reason="measured: 6000-token prompts at 3 req/s: budget 2048 -> ITL p95 40.9 ms, budget "
    "16384 -> 8.8 ms. A small budget spreads each prefill over more steps: more than 5% of "
    "the gaps then carry a chunk. (Before Little's law ran on the path's mean step: 5 req/s, "
    "4096 -> 78.7 ms vs 32768 -> 8.8 ms; over a grid of 3,684 stable (workload, rate, budget "
    "pair, p95|p99) points the p95/p99 was longer with the smaller budget in 745, by up to "
    "8.9x.)",
)
def test_a_smaller_budget_shortens_the_itl_p95() -> None:
    """The brief's "smaller budget -> shorter ITL tail", at the SLO's usual percentile."""
    t = traffic(3.0, 6000.0, 50.0)
    small, large = state(t, budget=2048, seqs=256), state(t, budget=16384, seqs=256)
    assert small.stable and large.stable
    assert small.itl(0.95) <= large.itl(0.95)


@settings(max_examples=60, deadline=None)
@given(w=workloads, rate=st.floats(0.05, 40.0))
def test_quantiles_are_ordered_and_itl_below_inverts_itl(
    w: tuple[float, float, float], rate: float
) -> None:
    prompt, gen, hit = w
    s = state(traffic(rate, prompt, gen, hit))
    assume(s.stable)
    itl = [s.itl(q) for q in QUANTILES]
    ttft = [s.ttft(q) for q in QUANTILES]
    assert itl == sorted(itl) and ttft == sorted(ttft)
    assert s.itl(0.0) <= s.itl_mean_s <= s.itl(1.0)
    for q in QUANTILES:
        assert s.itl_below(s.itl(q)) >= q - 1e-9
        assert 0.0 <= s.itl_below(s.itl(q)) <= 1.0
    assert s.prefill_mean_s <= s.ttft(0.99)
    assert s.running <= 1024 and s.token_util < MAX_TOKEN_UTIL and s.seq_util < MAX_SEQ_UTIL


@settings(max_examples=40, deadline=None)
@given(w=workloads, rate=st.floats(0.05, 40.0), seqs=st.sampled_from([16, 64, 256]))
def test_a_fixed_running_set_is_what_calibration_sees(
    w: tuple[float, float, float], rate: float, seqs: int
) -> None:
    """Calibration fixes the running requests to the gauge's mean: the steady state then
    always exists (the window ran it), and while prefill leaves room in the budget, more
    running decodes never shorten a step. (A step that fills the budget holds the same
    number of tokens whatever the mix: 0.08% shorter with 16 decodes than with 4 in one
    overloaded example, 2000-token prompts at 36 req/s on 16 sequences.)"""
    prompt, gen, hit = w
    t = traffic(rate, prompt, gen, hit)
    few = steady_state(t, Knobs3(8192, seqs, None), CURVE, COSTS, running=seqs / 4)
    many = steady_state(t, Knobs3(8192, seqs, None), CURVE, COSTS, running=float(seqs))
    assert few.stable and many.stable
    assert many.running >= few.running
    assume(many.token_util < 0.5)
    assert many.itl(0.5) >= few.itl(0.5) * (1 - 1e-9)


# ------------------------------------------------------------------------ shared evaluations


def _numbers(s: SteadyState) -> tuple[object, ...]:
    """Everything a steady state tells, as plain numbers (its quantile functions sampled)."""
    gaps = (0.001, 0.01, 0.03, 0.1)
    return (
        s.stable,
        s.why,
        s.step_mean_s,
        s.running,
        s.itl_mean_s,
        s.prefill_mean_s,
        s.token_util,
        s.seq_util,
        s.kv_util,
        *(s.itl(q) for q in (0.0, *QUANTILES, 1.0)),
        *(s.ttft(q) for q in (0.0, *QUANTILES, 1.0)),
        *(s.itl_below(x) for x in gaps),
        *(s.gen_steps_p(q) for q in QUANTILES),
    )


knob_sets = st.lists(
    st.tuples(
        st.sampled_from([256, 1024, 2048, 8192]),  # budget
        st.sampled_from([8, 32, 256, 1024]),  # max_num_seqs: binding and not
        st.sampled_from([None, 3e4, 4e5]),  # KV tokens: binding and not
        st.floats(0.05, 40.0),  # rate
    ),
    min_size=2,
    max_size=8,
)


@settings(max_examples=40, deadline=None)
@given(w=workloads, knobs=knob_sets, running=st.sampled_from([None, None, 12.0]))
def test_shared_evaluations_change_no_number(
    w: tuple[float, float, float],
    knobs: list[tuple[int, int, float | None, float]],
    running: float | None,
) -> None:
    """Inside `shared_evaluations()` (one search), a steady state is exactly the one computed
    alone, whatever was evaluated before it in the block: the same knobs again, another
    max_num_seqs or KV cache at the same rate (the remembered fixed point and sample path
    are reused only where those limits do not bind), other rates."""
    prompt, gen, hit = w
    # Each set of knobs twice, and each rate again with the first set's limits swapped in.
    calls = [*knobs, *knobs, *((b, knobs[0][1], knobs[0][2], r) for b, _, _, r in knobs)]

    def evaluate(budget: int, seqs: int, kv: float | None, rate: float) -> SteadyState:
        t = traffic(rate, prompt, gen, hit)
        return steady_state(t, Knobs3(budget, seqs, kv), CURVE, COSTS, running=running)

    alone = [_numbers(evaluate(*c)) for c in calls]
    with shared_evaluations():
        shared = [_numbers(evaluate(*c)) for c in calls]
    assert shared == alone


def test_shared_evaluations_reuse_paths_and_end_with_their_block() -> None:
    """The memory does its job (a repeat costs no sample path), and is gone after the block."""
    t = traffic(8.0, 600.0, 250.0)
    with shared_evaluations():
        state(t, seqs=1024)
        before = len(steady_state_module._MEMO.get().paths)  # type: ignore[union-attr]
        state(t, seqs=512)  # the limit does not bind at 8 req/s: same fixed point and path
        assert len(steady_state_module._MEMO.get().paths) == before  # type: ignore[union-attr]
    assert steady_state_module._MEMO.get() is None


@settings(max_examples=300, deadline=None)
@given(
    n_steps=st.integers(2, 3000),
    k_share=st.floats(0.0, 1.0),
    idle_s=st.floats(1e-4, 0.2),
    jitter=st.sampled_from([0.0, 0.02, 0.06, 0.5]),
    gap_steps=st.one_of(st.floats(-200.0, 4000.0), st.just(math.inf)),
    arrived_before=st.booleans(),
    window=st.sampled_from([0.01, 0.3, 0.9, steady_state_module._IDLE_WINDOW]),
)
def test_an_idle_stretch_lays_down_the_steps_of_a_sum_to_the_path_end(
    n_steps: int,
    k_share: float,
    idle_s: float,
    jitter: float,
    gap_steps: float,
    arrived_before: bool,
    window: float,
) -> None:
    """`_idle_stretch` sums the step noise over a window of the steps the gap should take
    (widened when short; windows far too short are drawn too, so that the widening runs).
    Its steps must be, bit for bit, those of summing the noise from step k to the path's end
    and cutting at the step that admits the arrival."""
    noise = np.exp(jitter * steady_state_module._Z_STEP_LONG[:n_steps] - 0.5 * jitter**2)
    k = min(n_steps - 1, int(k_share * n_steps))
    t = 1.5 + k * idle_s
    previous_end = t if k >= 1 else 0.0
    nxt = t + gap_steps * idle_s
    if arrived_before and k >= 1:
        nxt = previous_end - idle_s * 0.5  # it arrived during step k - 1
    ends = [0.0] * n_steps
    starts = [0.0] * n_steps
    if k >= 1:
        ends[k - 1] = previous_end
    kept = steady_state_module._IDLE_WINDOW
    steady_state_module._IDLE_WINDOW = window
    try:
        got = steady_state_module._idle_stretch(k, t, nxt, idle_s, noise, ends, starts)
    finally:
        steady_state_module._IDLE_WINDOW = kept

    full = t + np.cumsum(idle_s * noise[k:])
    if k >= 1 and nxt < previous_end:
        stop = k + 1
    else:
        stop = min(n_steps, k + int(np.searchsorted(full, nxt, side="right")) + 2)
    assert got == (stop, float(full[stop - k - 1]))
    assert len(ends) == len(starts) == n_steps
    assert ends[k:stop] == full[: stop - k].tolist()
    assert starts[k] == t
    assert starts[k + 1 : stop] == full[: stop - k - 1].tolist()
