"""Ground truth: what a configuration really achieves on the scenario's hidden reality.

"Capacity under the SLO" of knobs is the highest constant Poisson arrival rate per replica at
which one engine with the hidden `Reality` meets every SLO percentile in steady state: over a
seeded run sized by time (`truth_plan`: a warm-up of two expected request latencies, a
measured window of three and at least `truth_requests` judged requests, a cool-down while
arrivals continue). It is found by doubling then bisecting the rate to 1 %. A configuration
that fails to start or that the reality's run-time OOM hazard would kill has capacity 0: it
cannot serve.

Until 2026-12-06 a rate was judged on a fixed run of `truth_requests` requests with the first
10 % as warm-up. At 37 req/s such a run lasts 21 s against a 10 s request, so the batch never
filled and the last requests finished in an emptying engine: capacities near saturation came
out up to 22 % above what 4,000-request runs sustain, and by different amounts per knob
setting, so the oracle's ranking was off too (docs/decisions.md).

Evaluations are cached on disk under bench/.cache/, keyed by the scenario file's content hash
and the knobs, because the oracle grid and the report ask for the same points again and again.
The search baselines use `benchmark_capacity`: the same rate search, with their own seeds and
5 % precision (a real benchmark is noisy), each rate judged by one run sized by time
(`BenchPlan`: a warm-up and a measured window of several expected request latencies, so that
long outputs reach steady state); a run-time crash during it is a failed trial.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.tuning.scenario import Scenario
from vllm_autotuner.core.tuning_types import Knobs
from vllm_sim.engine import Engine
from vllm_sim.types import EngineConfig, EngineCrashed, Request, RequestRecord, StartupError

CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache"
WARMUP_FRACTION = 0.1
PRECISION = 1.01


def engine_config(s: Scenario, k: Knobs) -> EngineConfig:
    return EngineConfig(
        model=s.model,
        gpu=s.gpu,
        tensor_parallel_size=s.tensor_parallel_size,
        max_num_seqs=int(k.max_num_seqs),
        max_num_batched_tokens=int(k.max_num_batched_tokens),
        gpu_memory_utilization=float(k.gpu_memory_utilization),
        max_model_len=s.max_model_len,
    )


def oom_hazard(s: Scenario, k: Knobs) -> bool:
    """True when the hidden reality kills this configuration at run time (sooner or later)."""
    r = s.reality
    return (
        r.oom_above_utilization is not None
        and k.gpu_memory_utilization > r.oom_above_utilization
        and k.max_num_batched_tokens >= r.oom_min_batched_tokens
    )


def starts(s: Scenario, k: Knobs) -> bool:
    try:
        Engine(engine_config(s, k), s.reality, seed=0, record_itl=False)
    except (StartupError, ValueError):
        return False
    return True


def knob_key(k: Knobs) -> str:
    return f"{k.max_num_batched_tokens}/{k.max_num_seqs}/{k.gpu_memory_utilization:.3f}"


@dataclass(frozen=True)
class Verdict:
    meets: bool
    ratio: float  # worst measured/threshold over the SLO targets (> 1: missed)
    crashed: bool = False
    seconds: float = 0.0  # virtual time the run took (first arrival to the end of the run)


def _judged(
    records: list[RequestRecord], window: tuple[float, float] | None
) -> list[RequestRecord]:
    """The finished requests a verdict is about: those that arrived inside `window`, or by
    default after the first 10 % of the run (warm-up)."""
    done = [r for r in records if r.finish_reason not in ("abort", "error")]
    if not done or window is None:
        if not done:
            return []
        t0 = min(r.arrival_time for r in done)
        t1 = max(r.arrival_time for r in done)
        window = (t0 + WARMUP_FRACTION * (t1 - t0), math.inf)
    lo, hi = window
    return [r for r in done if lo <= r.arrival_time < hi] or done


def judge(
    s: Scenario, records: list[RequestRecord], window: tuple[float, float] | None = None
) -> Verdict:
    judged = _judged(records, window)
    if not judged:
        return Verdict(False, math.inf)
    worst = 0.0
    for metric, target in s.slo.targets():
        if metric == "ttft":
            values = np.array([r.ttft if r.ttft is not None else math.inf for r in judged])
        elif metric == "e2e":
            values = np.array([r.e2e for r in judged])
        else:
            gaps = [np.asarray(r.itl) for r in judged if r.itl]
            values = np.concatenate(gaps) if gaps else np.zeros(1)
        v = float(np.percentile(values, target.percentile)) * 1000.0
        worst = max(worst, v / target.threshold_ms)
    return Verdict(worst <= 1.0, worst)


def run_at(s: Scenario, k: Knobs, rate: float, requests: int, seed: int) -> Verdict:
    """One seeded run of `requests` at a constant Poisson `rate` on one engine; the first
    10 % of the arrivals are warm-up (the ground truth's measurement until 2026-12-06, kept
    for `bench.tuning.sustained`'s fixed-length runs)."""
    reqs = sorted(s.shape(rate, requests, seed).generate(), key=lambda r: r.arrival_time)
    if not reqs:
        return Verdict(False, math.inf)
    cut = reqs[0].arrival_time + WARMUP_FRACTION * (reqs[-1].arrival_time - reqs[0].arrival_time)
    return _run(s, k, reqs, seed, (cut, math.inf), judge_window=None)


def _run(
    s: Scenario,
    k: Knobs,
    reqs: list[Request],
    seed: int,
    window: tuple[float, float],
    judge_window: tuple[float, float] | None,
) -> Verdict:
    """Run `reqs` on one engine and judge the SLO on those that arrived inside `window`.

    It stops early once the verdict is certain: when more judged requests (or, for ITL,
    token gaps) already exceed a threshold than the percentile allows out of the run's total,
    the run misses the SLO whatever the rest does (every request generates its max_tokens).
    It also stops once every judged request has finished (later arrivals only keep the load up).
    """
    engine = Engine(engine_config(s, k), s.reality, seed=seed, record_itl=True)
    lo, hi = window
    judged = [r for r in reqs if lo <= r.arrival_time < hi]
    targets = s.slo.targets()
    allowed: dict[str, float] = {}
    for metric, target in targets:
        total = sum(max(r.max_tokens - 1, 0) for r in judged) if metric == "itl" else len(judged)
        allowed[metric] = (1.0 - target.percentile / 100.0) * total
    limit = {m: t.threshold_ms / 1000.0 for m, t in targets}
    bad = dict.fromkeys(allowed, 0.0)
    records: list[RequestRecord] = []
    waiting_for = {r.request_id for r in judged}
    start = reqs[0].arrival_time

    def verdict(v: Verdict) -> Verdict:
        return Verdict(v.meets, v.ratio, v.crashed, max(0.0, engine.now - start))

    def harvest() -> bool:
        """Collect finished requests; True once the verdict is certainly a miss."""
        for rec in engine.pop_finished():
            records.append(rec)
            waiting_for.discard(rec.request_id)
            if not lo <= rec.arrival_time < hi or rec.finish_reason in ("abort", "error"):
                continue
            ttft = rec.ttft if rec.ttft is not None else math.inf
            if "ttft" in bad and ttft > limit["ttft"]:
                bad["ttft"] += 1
            if "e2e" in bad and rec.e2e > limit["e2e"]:
                bad["e2e"] += 1
            if "itl" in bad and rec.itl:
                bad["itl"] += int(np.count_nonzero(np.asarray(rec.itl) > limit["itl"]))
        return any(bad[m] > allowed[m] + 0.5 for m in bad)

    try:
        for i, req in enumerate(reqs):
            if req.arrival_time > engine.now:
                engine.run_until(req.arrival_time)
            try:
                engine.add_request(req)
            except ValueError:
                waiting_for.discard(req.request_id)
                continue
            if i % 32 == 31 and harvest():
                return verdict(Verdict(False, math.inf))
            if not waiting_for and req.arrival_time >= hi:
                break
        if math.isinf(hi):  # every request is judged: run them all out
            while engine.has_unfinished():
                engine.run_until(math.inf)
        while waiting_for and engine.has_unfinished():
            engine.run_until(engine.now + 1.0)
            if harvest():
                return verdict(Verdict(False, math.inf))
        harvest()
    except EngineCrashed:
        return verdict(Verdict(False, math.inf, crashed=True))
    return verdict(judge(s, records, judge_window))


def search_capacity(
    s: Scenario, k: Knobs, requests: int, seed: int, guess: float, precision: float
) -> tuple[float, int, bool]:
    """(capacity, runs used, crashed): doubling then bisection on the rate (ground truth)."""
    cap, runs, crashed, _ = bisect_rate(
        lambda rate: run_at(s, k, rate, requests, seed), guess, precision
    )
    return cap, runs, crashed


def bisect_rate(
    probe: Callable[[float], Verdict], guess: float, precision: float
) -> tuple[float, int, bool, float]:
    """(highest rate meeting the SLO, runs, crashed, virtual seconds of every run): doubling
    then bisection on the rate, each rate judged by one `probe` run."""
    runs, seconds = 0, 0.0

    def ok(rate: float) -> bool | None:
        nonlocal runs, seconds
        runs += 1
        v = probe(rate)
        seconds += v.seconds
        return None if v.crashed else v.meets

    lo, hi = 0.0, max(guess, 0.05)
    first = ok(hi)
    if first is None:
        return 0.0, runs, True, seconds
    if first:
        lo = hi
        while True:
            hi = lo * 2.0
            r = ok(hi)
            if r is None:
                return 0.0, runs, True, seconds
            if not r:
                break
            lo = hi
            if hi > 1e4:
                return hi, runs, False, seconds
    else:
        while True:
            cand = hi / 2.0
            if cand < 0.02:
                return 0.0, runs, False, seconds
            r = ok(cand)
            if r is None:
                return 0.0, runs, True, seconds
            if r:
                lo = cand
                break
            hi = cand
    while hi / lo > precision:
        mid = math.sqrt(lo * hi)
        r = ok(mid)
        if r is None:
            return 0.0, runs, True, seconds
        if r:
            lo = mid
        else:
            hi = mid
    return lo, runs, False, seconds


class Truth:
    """Cached ground-truth capacity for one scenario (one process writes one cache file)."""

    def __init__(self, scenario: Scenario, cache_dir: Path | None = CACHE_DIR) -> None:
        self.s = scenario
        self.path = None if cache_dir is None else cache_dir / f"truth-{scenario.truth_key()}.json"
        self.values: dict[str, float] = {}
        self.benchmarks: dict[str, list[float]] = {}
        self.evaluations = 0
        if self.path is not None and self.path.exists():
            try:
                raw = json.loads(self.path.read_text())
                self.values = {str(a): float(b) for a, b in raw.get("capacity", {}).items()}
                self.benchmarks = {str(a): list(b) for a, b in raw.get("benchmarks", {}).items()}
            except (ValueError, OSError, AttributeError):
                self.values, self.benchmarks = {}, {}
        self._guess: float | None = None

    def capacity(self, k: Knobs) -> float:
        key = knob_key(k)
        if key in self.values:
            return self.values[key]
        self.evaluations += 1
        if oom_hazard(self.s, k) or not starts(self.s, k):
            cap = 0.0
        else:
            cap, _, crashed = self._search(k, self.start_rate(), PRECISION)
            cap = 0.0 if crashed else cap
        self.values[key] = cap
        return cap

    def start_rate(self) -> float:
        """Where every capacity search starts, so that a result never depends on the order
        of evaluations: 1 req/s, or the capacity found there for the first config evaluated
        (remembered in the cache)."""
        if self._guess is None:
            stored = self.values.get("start-rate")
            if stored is None:
                b = self.s.bounds
                probe = Knobs(
                    int(min(max(2048, b.mnbt.min), b.mnbt.max)),
                    int(min(max(128, b.mns.min), b.mns.max)),
                    b.gmu.min,
                )
                cap, _, _ = self._search(probe, 1.0, 1.1)
                stored = max(0.25, cap)
                self.values["start-rate"] = stored
            self._guess = stored
        return self._guess

    def _search(self, k: Knobs, guess: float, precision: float) -> tuple[float, int, bool]:
        """(capacity, runs, crashed): the rate search on the ground truth's runs."""
        plan = truth_plan(self.s)
        cap, runs, crashed, _ = bisect_rate(
            lambda rate: run_for(self.s, k, rate, self.s.truth_seed, plan), guess, precision
        )
        return cap, runs, crashed

    def benchmark(self, k: Knobs, seed: int, guess: float) -> Benchmark:
        """`benchmark_capacity`, remembered: it is deterministic given its seeds."""
        plan = bench_plan(self.s)
        key = f"bench-t:{knob_key(k)}:{seed}:{plan.key()}:{guess:.4g}"
        hit = self.benchmarks.get(key)
        if hit is not None:
            return Benchmark(hit[0], bool(hit[1]), bool(hit[2]), int(hit[3]), hit[4])
        b = benchmark_capacity(self.s, k, seed, plan, guess)
        self.benchmarks[key] = [b.capacity, float(b.crashed), float(b.started), b.runs, b.seconds]
        return b

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        data = {"capacity": self.values, "benchmarks": self.benchmarks}
        tmp.write_text(json.dumps(data, sort_keys=True, indent=0))
        tmp.replace(self.path)


@dataclass(frozen=True)
class Benchmark:
    """What an offline tuner's benchmark of one configuration reported."""

    capacity: float
    crashed: bool
    started: bool
    runs: int
    seconds: float  # virtual time the benchmark runs took (every run, end to end)


@dataclass(frozen=True)
class BenchPlan:
    """How long one benchmark run at a fixed rate lasts, sized by time so that it measures the
    steady state whatever the output lengths: a warm-up of several expected request latencies
    (the batch fills up), a measured window of several more (and at least `min_requests`
    judged requests), then a cool-down during which arrivals continue, so that the last judged
    requests still share the engine with newer ones."""

    expected_e2e_s: float
    warmup_s: float
    measure_s: float
    cooldown_s: float
    min_requests: int

    def key(self) -> str:
        return f"{self.warmup_s:.4g}/{self.measure_s:.4g}/{self.cooldown_s:.4g}/{self.min_requests}"


BENCH_WARMUP_E2E = 2.0  # warm-up, in expected end-to-end latencies
BENCH_MEASURE_E2E = 3.0  # measured window, in expected end-to-end latencies
BENCH_MIN_REQUESTS = 400  # judged requests at least (the old fixed run: 450 of 500)
BENCH_MIN_WARMUP_S = 10.0


def expected_e2e_s(s: Scenario) -> float:
    """What a benchmark's author can know before running: the workload's mean output length at
    the SLO's inter-token latency, plus its TTFT (the E2E threshold when the SLO has one)."""
    slo = s.slo
    if slo.e2e is not None:
        return slo.e2e.threshold_ms / 1000.0
    sample = s.shape(1.0, 2000, 7).generate()
    mean_out = float(np.mean([r.max_tokens for r in sample])) if sample else 128.0
    itl = slo.itl.threshold_ms / 1000.0 if slo.itl is not None else 0.05
    ttft = slo.ttft.threshold_ms / 1000.0 if slo.ttft is not None else 1.0
    return ttft + mean_out * itl


def bench_plan(s: Scenario) -> BenchPlan:
    e2e = expected_e2e_s(s)
    return BenchPlan(
        expected_e2e_s=e2e,
        warmup_s=max(BENCH_MIN_WARMUP_S, BENCH_WARMUP_E2E * e2e),
        measure_s=BENCH_MEASURE_E2E * e2e,
        cooldown_s=e2e,
        min_requests=BENCH_MIN_REQUESTS,
    )


def truth_plan(s: Scenario) -> BenchPlan:
    """The ground truth's runs: a benchmark's plan with at least `truth_requests` judged."""
    return dataclasses.replace(bench_plan(s), min_requests=s.truth_requests)


def run_for(s: Scenario, k: Knobs, rate: float, seed: int, plan: BenchPlan) -> Verdict:
    """One time-sized benchmark run at a constant Poisson `rate` (see `BenchPlan`)."""
    measure = max(plan.measure_s, plan.min_requests / rate)
    total = plan.warmup_s + measure + plan.cooldown_s
    reqs = sorted(
        s.shape(rate, math.ceil(rate * total), seed).generate(), key=lambda r: r.arrival_time
    )
    if not reqs:
        return Verdict(False, math.inf)
    lo = reqs[0].arrival_time + plan.warmup_s
    window = (lo, lo + measure)
    return _run(s, k, reqs, seed, window, judge_window=window)


def benchmark_capacity(
    s: Scenario, k: Knobs, seed: int, plan: BenchPlan, guess: float | None = None
) -> Benchmark:
    """A shorter, noisier capacity search (5 % precision, its own seeds), as a tuner's own
    benchmark would measure it, each rate judged by one time-sized run."""
    if not starts(s, k):
        return Benchmark(0.0, False, False, 0, 0.0)
    g = guess if guess is not None else max(0.5, s.peak_rate_per_replica())
    cap, runs, crashed, seconds = bisect_rate(lambda rate: run_for(s, k, rate, seed, plan), g, 1.05)
    return Benchmark(0.0 if crashed else cap, crashed, True, runs, seconds)
