"""One pod of vLLM's V1 scheduler in steady state at an arrival rate, Poisson or bursty.

Every step decodes one token for each running request, then spends what is left of the token
budget (`max_num_batched_tokens`) on prefill, oldest prompt first. So the step-time
distribution, which is the inter-token latency distribution, is set by how many prefill
tokens each step carries; and TTFT by how long a prompt waits behind the prefill backlog.

Both come from one short sample path with common random numbers (the same arrivals, scaled
by the rate, for every evaluation, so that results are smooth in the rate and in the knobs):

- arrivals: a renewal process at `rate` whose gaps have the squared coefficient of variation
  `arrival_cv2` (1: Poisson; gamma gaps otherwise, as `vllm bench serve --burstiness`);
  prompt and output lengths lognormal, fitted to the observed mean and p90; prefix-cache hits
  remove that share of each prompt's compute;
- running decodes `R` by Little's law (rate x output length x mean step), or as observed;
- the scheduler's walk over the steps, in order: step k admits what arrived before step
  k - 2 ended (async scheduling) and spends at most `budget - R` tokens on the oldest
  prompts, a prompt spanning steps when it must;
- step time from the deployment's physics (core/physics.py) at `R` decodes plus the step's
  prefill tokens and their attention (each prefill token attends to every token before it
  in its prompt, the cached prefix and earlier chunks included), plus a cost per admitted
  request;
- TTFT of each arrival: from its arrival to the end of the step that completes its prefill,
  plus the frontend overhead (async scheduling delays the first step by one); the wait for a free
  sequence slot (`max_num_seqs`) is added as an M/M/c queue.

Stability: the prefill flow must fit in the budget left by the decodes, `R` must stay under
`max_num_seqs` and the KV cache must hold the running requests' context.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt
import scipy.special

from vllm_autotuner.core.physics import StepCurveFn, lognormal_sigma

FloatArray = npt.NDArray[np.float64]

STEPS = 1000
_MAX_ARRIVALS = 24000
_RNG = np.random.default_rng(20261203)
# Exponential inter-arrival gaps at rate 1 and standard normals for lengths: common random
# numbers shared by every evaluation.
_GAPS: FloatArray = _RNG.exponential(1.0, _MAX_ARRIVALS)
_ARRIVALS_UNIT: FloatArray = np.cumsum(_GAPS)
# The same gaps as uniforms, for arrivals burstier or more regular than Poisson: gamma gaps of
# shape 1 / cv2 through the gamma's quantile function, so that every shape shares the random
# numbers and results move smoothly with it. Shapes sit on a grid (ratio ARRIVAL_CV2_RATIO)
# and the last ARRIVAL_SHAPES_KEPT of them are kept (190 KiB each).
_GAP_UNIFORMS: FloatArray = -np.expm1(-_GAPS)
ARRIVAL_CV2_RATIO = 1.1
ARRIVAL_SHAPES_KEPT = 8
MIN_ARRIVAL_CV2 = 0.25
MAX_ARRIVAL_CV2 = 6.0
_Z_PROMPT: FloatArray = _RNG.standard_normal(_MAX_ARRIVALS)
_Z_STEP: FloatArray = _RNG.standard_normal(STEPS * 4)
_Z_RUN: FloatArray = _RNG.standard_normal(STEPS * 4)
# Step-time noise for the longer paths that sample rare arrivals' first tokens: the first
# STEPS * 4 are _Z_STEP's own (common random numbers), the rest from a generator of its own.
# 64,000 steps of 70 ms hold TAIL_PATH_ARRIVALS arrivals down to 0.045 req/s (512 KiB).
LONG_STEPS = STEPS * 64
_Z_STEP_LONG: FloatArray = np.concatenate(
    [_Z_STEP, np.random.default_rng(20261206).standard_normal(LONG_STEPS - len(_Z_STEP))]
)
_WARMUP = 0.1  # the first tenth of the path fills an empty engine
MIN_PATH_ARRIVALS = 20  # fewer arrivals in a path give no first-token statistics
# Arrivals behind the first-token quantiles a prediction reads (`SteadyState.ttft`) and the
# prefill-time fractions the calibration matches (`prefill_below`). The STEPS-long path
# holds too few where steps are long or arrivals rare, and its TTFT tail comes out short:
# it sees few of the queue's busy periods. On rag-8b-a100 at 768 tokens and 1.5 req/s/pod
# (97 arrivals in the path) its p95 was 855 ms against 1,092-1,133 ms on paths of 400-1,600
# arrivals, which matched the window's own histogram (first tokens within 1 s: 0.92 on the
# long paths, 0.91 in the window, 0.97 on the short path); on the held-out 32B RAG window
# the p95 of 18 arrivals was their longest.
# Such a path is walked only when a quantile is asked for: the step-time fit never asks, and
# walked for every fit it tripled bench.decide_cost's first decision. 200 arrivals gave that
# p95 as well (1,164 ms; 400: 1,140) at half the walk; with 400, bench.scale's idle p99 at
# 1,000 deployments went from 456 ms to 1.38 s.
TAIL_PATH_ARRIVALS = 200

# Utilisation limits beyond which the steady state does not exist (queues grow without bound).
MAX_TOKEN_UTIL = 0.97
MAX_SEQ_UTIL = 0.97
MAX_KV_UTIL = 1.0
KV_SPREAD_SIGMAS = 2.0
# Rounds of Little's law on the sample path's own mean step, and when they agree.
_PATH_ROUNDS = 8
_PATH_TOLERANCE = 0.01
_SECANT_REACH = 4.0


@dataclass(frozen=True)
class Traffic:
    """Per-pod traffic: arrival rate and length distributions."""

    rate: float
    prompt_mean: float
    prompt_sigma: float  # lognormal sigma of prompt lengths
    gen_mean: float
    gen_p90: float
    prefix_hit_rate: float = 0.0
    arrival_cv2: float = 1.0  # squared coefficient of variation of inter-arrival gaps

    @property
    def hit_share(self) -> float:
        """The share of each prompt the prefix cache serves, kept within [0, 0.99]."""
        return min(0.99, max(0.0, self.prefix_hit_rate))


@dataclass(frozen=True)
class Knobs3:
    budget: int
    max_seqs: int
    kv_tokens: float | None


@dataclass(frozen=True)
class Costs:
    """Calibrated costs outside the step-time roofline."""

    admit_s: float = 0.0  # CPU time a step spends per request it admits
    frontend_s: float = 0.004  # arrival to the scheduler seeing the request (vLLM's frontend)
    api_s: float = 0.0  # what the engine cannot explain of TTFT (HTTP, tokenisation)
    jitter: float = 0.0  # log-normal sigma of step times around the roofline


@dataclass(frozen=True)
class SteadyState:
    stable: bool
    why: str
    step_mean_s: float
    running: float
    itl: Callable[[float], float]  # quantile (0..1) -> seconds
    itl_below: Callable[[float], float]  # seconds -> fraction of inter-token gaps at or under
    itl_mean_s: float
    ttft: Callable[[float], float]  # quantile (0..1) -> seconds
    prefill_mean_s: float  # first scheduled to first token (vllm:request_prefill_time_seconds)
    prefill_below: Callable[[float], float]  # seconds -> fraction of prefills at or under
    gen_steps_p: Callable[[float], float]  # quantile of output length
    token_util: float
    seq_util: float
    kv_util: float


def _unstable(why: str, util: tuple[float, float, float]) -> SteadyState:
    inf = math.inf
    return SteadyState(
        False,
        why,
        inf,
        inf,
        lambda q: inf,
        lambda x: 0.0,
        inf,
        lambda q: inf,
        inf,
        lambda x: 0.0,
        lambda q: inf,
        *util,
    )


StepCurve = Callable[[float, float], StepCurveFn]


def _lognormal_quantile(mean: float, p90: float) -> Callable[[float], float]:
    sigma = lognormal_sigma(mean, p90)
    mu = math.log(max(mean, 1.0)) - 0.5 * sigma * sigma
    z = {0.5: 0.0, 0.9: 1.2816, 0.95: 1.6449, 0.99: 2.3263}

    def q(p: float) -> float:
        zz = z.get(round(p, 2))
        if zz is None:
            zz = NormalDist().inv_cdf(min(max(p, 1e-6), 1 - 1e-6))
        return math.exp(mu + sigma * zz)

    return q


def steady_state(
    traffic: Traffic,
    knobs: Knobs3,
    curve_at: StepCurve,
    costs: Costs,
    running: float | None = None,
) -> SteadyState:
    """The steady state at `traffic.rate`, or the reason there is none.

    `curve_at(R, ctx)` returns the step-time curve (tokens -> seconds) with `R` running
    decodes of `ctx` context tokens each.
    `running` fixes the number of running requests (calibration from an observed window,
    where the engine may be past saturation) instead of deriving it by Little's law.
    """
    lam = max(traffic.rate, 1e-9)
    g = max(1.0, traffic.gen_mean)
    p_mean = max(1.0, traffic.prompt_mean)
    # A running request's context, averaged over the time it runs: long outputs run longer,
    # so they weigh more (E[g (p + g/2)] / E[g] for independent lengths).
    g_sigma = lognormal_sigma(g, max(traffic.gen_p90, g * 1.0001))
    g_cv2 = math.exp(g_sigma * g_sigma) - 1.0
    ctx_per_seq = p_mean + 0.5 * g * (1.0 + g_cv2)
    budget = float(knobs.budget)
    seqs_cap = float(knobs.max_seqs)
    gen_q = _lognormal_quantile(g, max(traffic.gen_p90, g * 1.0001))

    t_mean = _mean_step(traffic, ctx_per_seq, seqs_cap, budget, curve_at, running, costs.admit_s)
    before: tuple[float, float] | None = None  # the last round's (mean step in, path's mean)
    for _ in range(_PATH_ROUNDS):
        r = running if running is not None else lam * g * t_mean
        util = _utilisation(lam, t_mean, r, traffic, knobs, ctx_per_seq)
        if running is None:
            why = _unstable_why(r, seqs_cap, util)
            if why:
                return _unstable(why, util)
        r_eff = min(r, seqs_cap)
        path = _path(lam, traffic, budget, r_eff, ctx_per_seq, curve_at, t_mean, costs)
        # The mean step of the path (every step's own prefill chunk and admissions) is longer
        # than the step at the mean chunk: the step curve bends upwards where prefill turns
        # compute-bound. Little's law must run on the path's mean, or the batch it gives is
        # too small (chat-8b-h100 at 896 tokens, 28 req/s: 106 running instead of the
        # simulator's 195, mean ITL 19 ms instead of 27).
        if running is not None or abs(path.step_mean - t_mean) <= _PATH_TOLERANCE * t_mean:
            break
        t_mean, before = _next_mean_step(t_mean, path.step_mean, before), (t_mean, path.step_mean)
    step_mean = path.step_mean
    _, seq_util, kv_util = util
    # Waiting for a sequence slot: a G/M/c queue with c = max_num_seqs servers whose service
    # is a request's decode (Sakasegawa's M/M/c mean wait, times (cv2 + 1) / 2 for the gaps'
    # variability as Allen-Cunneen's approximation has it; exponential tail).
    wait_mean = 0.0
    burst = 0.5 * (1.0 + clamp_cv2(traffic.arrival_cv2))
    if running is None:
        # The tighter of the two limits on admission, each as c servers busy for a decode.
        for servers, rho in (
            (seqs_cap, seq_util),
            (seqs_cap / max(seq_util, 1e-9) * kv_util, kv_util),
        ):
            if rho > 0.5:
                wait = _mmc_wait(max(1.0, servers), rho) * burst * g * step_mean
                wait_mean = max(wait_mean, wait)
    itl_sorted, itl_cum = path.itl_sorted, path.itl_cum
    tail_path = path.tail

    def first_tokens() -> tuple[FloatArray, FloatArray]:
        return (path.ttft_sorted, path.prefill_sorted) if tail_path is None else tail_path()

    def itl(q: float) -> float:
        i = int(np.searchsorted(itl_cum, q, side="left"))
        return float(itl_sorted[min(len(itl_sorted) - 1, i)])

    def itl_below(x: float) -> float:
        i = int(np.searchsorted(itl_sorted, x, side="right"))
        return 0.0 if i == 0 else float(itl_cum[i - 1])

    def prefill_below(x: float) -> float:
        prefill_sorted = first_tokens()[1]
        n = len(prefill_sorted)
        return float(np.searchsorted(prefill_sorted, x, side="right")) / n if n else 0.0

    def ttft(q: float) -> float:
        ttft_sorted = first_tokens()[0]
        base = float(ttft_sorted[min(len(ttft_sorted) - 1, int(q * len(ttft_sorted)))])
        tail = wait_mean * math.log(1.0 / max(1e-9, 1.0 - q)) if q > 0.5 else wait_mean * 0.7
        return base + tail + costs.api_s

    return SteadyState(
        True,
        "",
        step_mean,
        r_eff,
        itl,
        itl_below,
        path.itl_mean,
        ttft,
        path.prefill_mean,
        prefill_below,
        gen_q,
        *util,
    )


# --------------------------------------------------------------------- shared evaluations
#
# A search predicts ~150 candidates, and each capacity is a bisection over the rate: about
# 2,000 steady states, most of them repeats. Candidates that differ only in max_num_seqs or
# gpu_memory_utilization run the same sample path at the same rates whenever neither limit
# binds (those knobs enter only the stability checks and the wait for a slot, computed apart).
# Inside `shared_evaluations()` the two costly parts, the mean step's fixed point and the
# sample path, are remembered by their exact inputs, so a repeat returns the same numbers
# without the work. Scoped to one block (one search) and to the thread running it, so
# nothing is shared between deployments and nothing outlives the search.

_MEMO: ContextVar[_Memo | None] = ContextVar("steady_state_memo", default=None)
# Sample paths kept at once in one block: the candidates of one token budget come one after
# another in a search, each re-walking the rates of the one before (~11 each); a path holds
# ~20 KiB of arrays.
MEMO_PATHS = 64


@dataclass(frozen=True)
class _Path:
    """What the TTFT and ITL distributions need of one sample path."""

    step_mean: float
    itl_sorted: FloatArray
    itl_cum: FloatArray
    itl_mean: float
    ttft_sorted: FloatArray
    prefill_mean: float
    prefill_sorted: FloatArray
    # (first tokens, prefill times), sorted, from a path of TAIL_PATH_ARRIVALS arrivals,
    # walked on first use (None: the path above holds that many).
    tail: Callable[[], tuple[FloatArray, FloatArray]] | None = None


class _Memo:
    def __init__(self) -> None:
        self.steps: dict[Hashable, tuple[float, float]] = {}
        self.paths: OrderedDict[Hashable, _Path] = OrderedDict()

    def path(self, key: Hashable, compute: Callable[[], _Path]) -> _Path:
        found = self.paths.get(key)
        if found is not None:
            self.paths.move_to_end(key)
            return found
        found = self.paths[key] = compute()
        if len(self.paths) > MEMO_PATHS:
            self.paths.popitem(last=False)
        return found


@contextmanager
def shared_evaluations() -> Iterator[None]:
    """Within this block (in this thread), steady_state() reuses the fixed point and sample
    path of any earlier call with the same inputs: same results, less work. Nested blocks
    share the outer one's memory."""
    if _MEMO.get() is not None:
        yield
        return
    token = _MEMO.set(_Memo())
    try:
        yield
    finally:
        _MEMO.reset(token)


def _next_mean_step(t: float, got: float, before: tuple[float, float] | None) -> float:
    """The next guess of the fixed point t = path(t): the path's mean `got`, or the secant
    through this round and the one `before` (fewer rounds: the path's mean grows with the
    guess at a slope under one, so plain iteration creeps near saturation), at most
    `_SECANT_REACH` times as far as the plain step."""
    if before is None:
        return got
    t0, got0 = before
    plain = got - t
    slope = (plain - (got0 - t0)) / (t - t0) if t != t0 else 0.0
    if slope >= 0.0:
        return got
    step = -plain / slope
    limit = abs(plain) * _SECANT_REACH
    return t + max(-limit, min(limit, step)) if math.isfinite(step) else got


def _utilisation(
    lam: float, t_mean: float, r: float, traffic: Traffic, knobs: Knobs3, ctx_per_seq: float
) -> tuple[float, float, float]:
    """(token budget, sequence slots, KV cache) utilisation at mean step `t_mean` with `r`
    running requests."""
    seqs_cap = float(knobs.max_seqs)
    p_mean = max(1.0, traffic.prompt_mean)
    hit = traffic.hit_share
    kv_util = 0.0
    if knobs.kv_tokens is not None and knobs.kv_tokens > 0:
        # The running set's context fluctuates (how many run, how long each is; more under
        # bursts): the cache must hold two standard deviations above the mean, or decodes
        # preempt each other.
        r_kv = min(r, seqs_cap)
        spread = math.sqrt(1.3 * running_peakedness(traffic) * r_kv)
        need = r_kv * ctx_per_seq + KV_SPREAD_SIGMAS * ctx_per_seq * spread
        kv_util = need / knobs.kv_tokens
    room = float(knobs.budget) - min(r, seqs_cap)
    token_util = lam * t_mean * p_mean * (1 - hit) / room if room > 0 else math.inf
    return token_util, r / seqs_cap, kv_util


def _unstable_why(r: float, seqs_cap: float, util: tuple[float, float, float]) -> str:
    """Why there is no steady state at this utilisation ("" when there is one)."""
    token_util, seq_util, kv_util = util
    if seq_util >= MAX_SEQ_UTIL:
        return f"max_num_seqs: {r:.0f} running of {seqs_cap:.0f}"
    if kv_util >= MAX_KV_UTIL:
        return f"KV cache {kv_util:.0%} full"
    if token_util >= MAX_TOKEN_UTIL:
        return f"token budget: prefill needs {token_util:.0%} of it"
    return ""


def _mean_step(
    traffic: Traffic,
    ctx_per_seq: float,
    seqs_cap: float,
    budget: float,
    curve_at: StepCurve,
    running: float | None,
    admit_s: float = 0.0,
) -> float:
    """The mean step time: a damped fixed point of Little's law and the step curve."""
    memo = _MEMO.get()
    if memo is None:
        return _iterate_mean_step(
            traffic, ctx_per_seq, seqs_cap, budget, curve_at, running, admit_s
        )[0]
    # A result whose iterates never ran more requests than the cap is also the result for
    # any larger cap (min(r, cap) was r throughout): remembered without the cap.
    free = (traffic, ctx_per_seq, budget, curve_at, running, admit_s)
    found = memo.steps.get(free)
    if found is not None and found[1] <= seqs_cap:
        return found[0]
    capped = (*free, seqs_cap)
    found = memo.steps.get(capped)
    if found is not None:
        return found[0]
    t_mean, peak = _iterate_mean_step(
        traffic, ctx_per_seq, seqs_cap, budget, curve_at, running, admit_s
    )
    memo.steps[free if peak <= seqs_cap else capped] = (t_mean, peak)
    return t_mean


def _iterate_mean_step(
    traffic: Traffic,
    ctx_per_seq: float,
    seqs_cap: float,
    budget: float,
    curve_at: StepCurve,
    running: float | None,
    admit_s: float = 0.0,
) -> tuple[float, float]:
    """(mean step, the most running requests any iterate assumed). Every arrival is admitted
    once, so a step of `t` admits `rate x t` requests on average, each at `admit_s`. Steps
    that carry prefill and steps that do not are averaged apart: a prompt fills a share of
    the steps (all of them under load) with chunks of up to the budget left by the decodes,
    and the step curve bends upwards where prefill turns compute-bound, so the step at the
    mean chunk is shorter than the mean step."""
    lam = max(traffic.rate, 1e-9)
    g = max(1.0, traffic.gen_mean)
    p_mean = max(1.0, traffic.prompt_mean)
    hit = traffic.hit_share
    # First guess of the mean step: decodes only, at Little's law's batch.
    t_mean = float(curve_at(1.0, ctx_per_seq)(np.array([1.0]))[0])
    position = _mean_position(traffic)
    peak = -math.inf
    for _ in range(30):
        r = running if running is not None else lam * g * t_mean
        peak = max(peak, r)
        r_eff = min(r, seqs_cap)
        prefill = lam * t_mean * p_mean * (1 - hit)
        curve = curve_at(r_eff, ctx_per_seq)
        room = max(1.0, budget - r_eff)
        busy = min(1.0, lam * t_mean * max(1.0, p_mean * (1 - hit) / room))
        chunk = prefill / busy
        step = busy * curve.step(r_eff + chunk, chunk * position)
        if busy < 1.0:
            step += (1.0 - busy) * curve.step(r_eff, 0.0)
        t_new = step + admit_s * lam * t_mean
        if abs(t_new - t_mean) < 1e-4 * t_mean:
            t_mean = t_new
            break
        t_mean = 0.5 * (t_mean + t_new)
    return t_mean, peak


def _mean_position(traffic: Traffic) -> float:
    """How many tokens a computed prefill token attends to on average: its position in the
    prompt, cached prefix included (a share `hit` of each prompt; log-normal lengths, so the
    token-weighted mean of P is E[P²]/E[P] = mean x exp(sigma²))."""
    hit = traffic.hit_share
    sigma = traffic.prompt_sigma
    return 0.5 * (1.0 + hit) * max(1.0, traffic.prompt_mean) * math.exp(sigma * sigma)


def _path(
    lam: float,
    traffic: Traffic,
    budget: float,
    r_eff: float,
    ctx_per_seq: float,
    curve_at: StepCurve,
    t_mean: float,
    costs: Costs,
) -> _Path:
    memo = _MEMO.get()

    def compute() -> _Path:
        return _sample_distributions(lam, traffic, budget, r_eff, ctx_per_seq, curve_at,
                                     t_mean, costs)  # fmt: skip

    if memo is None:
        return compute()
    return memo.path((traffic, budget, r_eff, ctx_per_seq, curve_at, t_mean, costs), compute)


def _sample_distributions(
    lam: float,
    traffic: Traffic,
    budget: float,
    r_eff: float,
    ctx_per_seq: float,
    curve_at: StepCurve,
    t_mean: float,
    costs: Costs,
) -> _Path:
    """Step times, inter-token gaps and first tokens on one sample path at `r_eff` decodes."""
    p_mean = max(1.0, traffic.prompt_mean)
    hit = traffic.hit_share
    room = max(1.0, budget - r_eff)
    curve = curve_at(r_eff, ctx_per_seq)
    t_steps, ttft_samples, prefills = _sample_path(
        lam, traffic, p_mean, hit, r_eff, room, curve, t_mean, costs
    )
    if lam * STEPS * t_mean < MIN_PATH_ARRIVALS:
        # Arrivals this rare (none at all in the path below ~0.2 req/s on an 8B/H100): their
        # first tokens are sampled on a longer path at their own rate that holds
        # MIN_PATH_ARRIVALS of them, and only past LONG_STEPS at a higher rate. Steps and gaps
        # keep the STEPS-long path. (At twice the rate, as before, a RAG window on
        # Qwen2.5-32B / 2 x L40S at 0.14 req/s per pod, prompts of 4,550 tokens taking 1.5 s
        # of prefill, queued behind each other: TTFT p90 4.7 s where the window had 2.5.)
        steps = min(LONG_STEPS, math.ceil(MIN_PATH_ARRIVALS / (lam * t_mean)))
        lam_ttft = max(lam, MIN_PATH_ARRIVALS / (steps * t_mean))
        _, ttft_samples, prefills = _sample_path(
            lam_ttft, traffic, p_mean, hit, r_eff, room, curve, t_mean, costs, steps
        )
    tail = None
    if lam * STEPS * t_mean < TAIL_PATH_ARRIVALS:

        @functools.cache
        def tail() -> tuple[FloatArray, FloatArray]:
            steps = min(LONG_STEPS, math.ceil(TAIL_PATH_ARRIVALS / (lam * t_mean)))
            rate = max(lam, TAIL_PATH_ARRIVALS / (steps * t_mean))
            _, first, prefill = _sample_path(
                rate, traffic, p_mean, hit, r_eff, room, curve, t_mean, costs, steps
            )
            return _frozen(np.sort(first)), _frozen(np.sort(prefill))

    warm = int(len(t_steps) * _WARMUP)
    body = t_steps[warm:]
    # The running set is not constant: its size spreads around the mean (Poisson for Poisson
    # arrivals, wider for bursts: `running_peakedness`), and a step with more decodes is
    # longer (more KV to read) and yields more tokens. Inter-token latencies are the steps
    # weighted by their decodes.
    spread = math.sqrt(running_peakedness(traffic) * max(r_eff, 1.0))
    decodes = np.maximum(1.0, r_eff + spread * _Z_RUN[: len(body)])
    wider = max(1.0, r_eff * 1.25)
    slope = (
        float(curve_at(wider, ctx_per_seq)(np.array([wider]))[0])
        - float(curve(np.array([r_eff]))[0])
    ) / max(1e-9, wider - r_eff)
    itl_steps = np.maximum(body + slope * (decodes - r_eff), 1e-6)
    order = np.argsort(itl_steps)
    itl_cum = np.cumsum(decodes[order])
    itl_cum /= itl_cum[-1]
    return _Path(
        step_mean=float(body.mean()),
        itl_sorted=_frozen(itl_steps[order]),
        itl_cum=_frozen(itl_cum),
        itl_mean=float(np.dot(itl_steps, decodes) / decodes.sum()),
        ttft_sorted=_frozen(np.sort(ttft_samples)),
        prefill_mean=float(prefills.mean()),
        prefill_sorted=_frozen(np.sort(prefills)),
        tail=tail,
    )


def _frozen(a: FloatArray) -> FloatArray:
    """`a`, read-only: a remembered path is shared by every steady state built from it."""
    a.flags.writeable = False
    return a


def _mmc_wait(servers: float, rho: float) -> float:
    """Mean wait in an M/M/c queue in units of the service time (Sakasegawa)."""
    rho = min(rho, 0.999)
    return float(rho ** (math.sqrt(2.0 * (servers + 1.0)) - 1.0) / (servers * (1.0 - rho)))


def running_peakedness(traffic: Traffic) -> float:
    """Variance over mean of the number of running requests: 1 for Poisson arrivals (M/G/inf);
    for renewal arrivals whose gaps have variability `arrival_cv2`, 1 + (cv2 - 1) x kappa,
    where kappa = int G^c(t)^2 dt / E[S] is 1/2 for exponential service times and 1 for
    constant ones (Whitt's peakedness of G/GI/inf), taken here as 1 / (1 + cv2 of the output
    length)."""
    g = max(1.0, traffic.gen_mean)
    sigma = lognormal_sigma(g, max(traffic.gen_p90, g * 1.0001))
    kappa = math.exp(-sigma * sigma)  # 1 / (1 + cv2) of a log-normal
    return 1.0 + (clamp_cv2(traffic.arrival_cv2) - 1.0) * kappa


def clamp_cv2(cv2: float) -> float:
    """`cv2` within the burstiness the model samples: [MIN_ARRIVAL_CV2, MAX_ARRIVAL_CV2]."""
    return min(MAX_ARRIVAL_CV2, max(MIN_ARRIVAL_CV2, cv2))


def arrivals_unit(cv2: float) -> FloatArray:
    """Arrival times at rate 1 whose gaps have squared coefficient of variation `cv2` (1:
    Poisson, the exponential gaps themselves; > 1 bursts, as `vllm bench serve --burstiness`
    = 1 / cv2 draws them), clamped (`clamp_cv2`) and rounded to the grid."""
    key = round(math.log(clamp_cv2(cv2)) / math.log(ARRIVAL_CV2_RATIO))
    return _ARRIVALS_UNIT if key == 0 else _gamma_arrivals(key)


@functools.lru_cache(maxsize=ARRIVAL_SHAPES_KEPT)  # thread-safe: decide() runs in threads
def _gamma_arrivals(key: int) -> FloatArray:
    shape = ARRIVAL_CV2_RATIO ** (-key)
    gaps = scipy.special.gammaincinv(shape, _GAP_UNIFORMS) / shape
    return _frozen(np.cumsum(gaps))


def _sample_path(
    lam: float,
    traffic: Traffic,
    p_mean: float,
    hit: float,
    running: float,
    room: float,
    curve: StepCurveFn,
    t_mean: float,
    costs: Costs,
    steps: int = STEPS,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """(step durations, TTFT samples, prefill times) of one sample path of `steps` steps.

    Step by step, as the scheduler runs: step k admits what arrived before step k - 2 ended
    (async scheduling schedules step k + 1 while step k runs), spends its `room` on the
    oldest prompts first (a prompt may span steps), and lasts what its tokens and
    admissions cost. Each step's duration depends only on steps that ended before it was
    scheduled, so one pass is exact. (Earlier, a few vectorised rounds placed arrivals on
    the step boundaries of the round before: at low load, where each prompt makes its own
    long step, prompts landed on short steps and the path's prefill time came out at
    15 ms where its own steps took 138 ms; TTFT p95 138 ms against 368 ms.)"""
    n_steps = steps
    horizon = n_steps * t_mean
    unit = arrivals_unit(traffic.arrival_cv2)
    n_arr = int(np.searchsorted(unit, horizon * lam))
    if n_arr >= _MAX_ARRIVALS:
        n_arr = _MAX_ARRIVALS - 1
        horizon = float(unit[n_arr - 1]) / lam
        n_steps = max(50, min(len(_Z_STEP_LONG), int(horizon / t_mean)))
    arrive = unit[:n_arr] / lam
    sigma = traffic.prompt_sigma
    mu = math.log(p_mean) - 0.5 * sigma * sigma
    prompt = np.maximum(np.exp(mu + sigma * _Z_PROMPT[:n_arr]) * (1.0 - hit), 1.0)
    noise, noise_list = _step_noise(costs.jitter, STEPS if n_steps <= STEPS else LONG_STEPS)
    table = _StepTable(curve, running, room)
    ends, starts, first, done = _walk(
        arrive.tolist(), prompt.tolist(), hit, room, table, costs.admit_s,
        noise[:n_steps], noise_list[:n_steps],
    )  # fmt: skip
    ends_a = np.asarray(ends)
    t_steps = np.diff(ends_a, prepend=0.0)
    done_a = np.asarray(done)
    keep = (arrive >= horizon * _WARMUP) & (done_a >= 0) & (done_a < n_steps - 2)
    if not keep.any():
        return t_steps, np.array([math.inf]), np.array([math.inf])
    out = done_a[keep]
    ttft = ends_a[out] - arrive[keep] + costs.frontend_s
    began = np.array([starts[j] for j in np.asarray(first)[keep].tolist()])
    prefill = ends_a[out] - began
    return t_steps, ttft, prefill


@functools.lru_cache(maxsize=8)  # thread-safe: decide() runs in threads
def _step_noise(jitter: float, steps: int) -> tuple[FloatArray, list[float]]:
    """The first `steps` steps' duration factors at `jitter`, as an array and as a list
    (the walk reads floats; a path's steps are the first of these). A decision's paths share
    the fit's jitter, and converting 64,000 factors for each long path cost a tenth of a
    decision at 0.05 req/s."""
    z = _Z_STEP_LONG[:steps]
    noise = np.exp(jitter * z - 0.5 * jitter * jitter) if jitter > 0 else np.ones(steps)
    noise.flags.writeable = False
    return noise, noise.tolist()


class _StepTable:
    """The step curve at `running` decodes plus 0..`room` prefill tokens, tabulated finely
    enough (512 intervals) that linear interpolation in plain floats reproduces the curve's
    own piecewise-linear values: the time without the prefill's attention and the seconds per
    attention pair, which the walk looks up (inline) for every step that carries prefill."""

    SIZE = 512

    def __init__(self, curve: StepCurveFn, running: float, room: float):
        tokens = running + np.linspace(0.0, room, self.SIZE + 1)
        self.values: list[float] = curve.without_prefill_attention(tokens).tolist()
        self.pair_s: list[float] = curve.pair_seconds(tokens).tolist()
        self.per_token = self.SIZE / room if room > 0 else 0.0


def _walk(
    arrive: list[float],
    prompt: list[float],
    hit: float,
    room: float,
    table: _StepTable,
    admit_s: float,
    noise_a: FloatArray,
    noise: list[float],
) -> tuple[list[float], list[float], list[int], list[int]]:
    """(end and start of each step, the step that starts and the one that finishes each
    prompt, -1 when the path ends first): the scheduler's walk over the steps. `prompt` holds
    the tokens each prompt must compute; a share `hit` of the whole prompt came from the
    prefix cache, and every computed token attends to all that precede it. `noise_a` and
    `noise` hold each step's duration factor (as an array and as a list). Stretches with
    nothing to prefill are laid down at once (decode-only steps until the step that admits
    the next arrival), the rest one step at a time."""
    cached_per_token = hit / (1.0 - hit)
    values, pair_s, per_token, size = table.values, table.pair_s, table.per_token, table.SIZE
    idle = values[0]
    n_steps, n_arr = len(noise), len(arrive)
    ends = [0.0] * n_steps
    starts = [0.0] * n_steps
    first = [-1] * n_arr
    done = [-1] * n_arr
    t = 0.0
    admitted = 0  # arrivals admitted so far (in order)
    head = 0  # the oldest prompt not yet fully prefilled
    left_of_head = prompt[0] if n_arr else 0.0
    k = 0
    while k < n_steps:
        if head == admitted and not (
            k >= 2 and admitted < n_arr and arrive[admitted] < ends[k - 2]
        ):
            nxt = arrive[admitted] if admitted < n_arr else math.inf
            if nxt - t > _LONG_IDLE * idle:
                k, t = _idle_stretch(k, t, nxt, idle, noise_a, ends, starts)
            else:  # one decode-only step
                starts[k] = t
                t += idle * noise[k]
                ends[k] = t
                k += 1
            continue
        count = 0
        if k >= 2:
            limit = ends[k - 2]
            while admitted < n_arr and arrive[admitted] < limit:
                admitted += 1
                count += 1
        starts[k] = t
        space = room
        chunk = 0.0
        pairs = 0.0
        while head < admitted and space > 1e-9:
            if first[head] < 0:
                first[head] = k
            take = left_of_head if left_of_head < space else space
            whole = prompt[head]
            offset = whole * cached_per_token + whole - left_of_head
            pairs += take * (offset + 0.5 * take)
            chunk += take
            space -= take
            left_of_head -= take
            if left_of_head <= 1e-9:
                done[head] = k
                head += 1
                left_of_head = prompt[head] if head < n_arr else 0.0
        # The table's step at `chunk` tokens and `pairs` (inline: every prefill step).
        f = chunk * per_token
        j = int(f)
        if j >= size:
            step = values[size] + pair_s[size] * pairs
        else:
            w = f - j
            step = values[j] + (values[j + 1] - values[j]) * w
            step += (pair_s[j] + (pair_s[j + 1] - pair_s[j]) * w) * pairs
        t += (step + admit_s * count) * noise[k]
        ends[k] = t
        k += 1
    return ends, starts, first, done


# Decode-only stretches expected to be longer than this many steps are laid down in one
# array pass; shorter ones step by step (an array pass costs about as much as 20 steps).
_LONG_IDLE = 32
# A decode-only stretch's window of steps, as a multiple of the steps its gap takes at the
# idle step's mean (the steps' noise is a few percent; a short window is widened).
_IDLE_WINDOW = 1.25


def _idle_stretch(
    k: int,
    t: float,
    next_arrival: float,
    idle_s: float,
    noise: FloatArray,
    ends: list[float],
    starts: list[float],
) -> tuple[int, float]:
    """Lay down decode-only steps from step `k` (started at `t`) up to the step that admits
    `next_arrival` (the second after the one it arrives in); (that step, its start).

    The step ends are summed over a window of the steps the gap should take, widened until
    it holds that step (a running sum's first values do not depend on how far it runs, so
    the ends are those of a sum to the path's end; at 0.05 req/s a path of 64,000 steps
    summed to its end at each of its 200 arrivals took half of a decision's CPU)."""
    n_steps = len(ends)
    if k >= 1 and next_arrival < ends[k - 1]:
        ends_a = t + np.cumsum(idle_s * noise[k : k + 1])
        stop = k + 1  # it arrived during step k - 1: step k + 1 admits it
    else:
        length = n_steps - k
        if idle_s > 0 and math.isfinite(next_arrival):
            gap_steps = (next_arrival - t) / idle_s
            length = min(length, max(1, int(gap_steps * _IDLE_WINDOW) + _LONG_IDLE))
        while True:
            ends_a = t + np.cumsum(idle_s * noise[k : k + length])
            arrives_in = int(np.searchsorted(ends_a, next_arrival, side="right"))  # from step k
            if arrives_in + 2 <= length or k + length >= n_steps:
                break
            length = min(n_steps - k, 2 * length)
        stop = min(n_steps, k + arrives_in + 2)
    count = stop - k
    laid = ends_a[:count].tolist()
    ends[k:stop] = laid
    starts[k] = t
    starts[k + 1 : stop] = laid[:-1]
    return stop, ends[stop - 1]
