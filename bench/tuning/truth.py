"""Ground truth: what a configuration really achieves on the scenario's hidden reality.

"Capacity under the SLO" of knobs is the highest constant Poisson arrival rate per replica at
which one engine with the hidden `Reality` meets every SLO percentile over a seeded run of
`truth_requests` requests (requests of the first 10 % of the run are warm-up and not judged).
It is found by doubling then bisecting the rate to 1 %. A configuration that fails to start
or that the reality's run-time OOM hazard would kill has capacity 0: it cannot serve.

Evaluations are cached on disk under bench/.cache/, keyed by the scenario file's content hash
and the knobs, because the oracle grid and the report ask for the same points again and again.
The search baselines use `benchmark_capacity`: the same measurement, shorter and with their own
seeds (a real benchmark is noisy), and a run-time crash during it is a failed trial.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.tuning.scenario import Scenario
from vllm_autotuner.core.tuning_types import Knobs
from vllm_sim.engine import Engine
from vllm_sim.types import EngineConfig, EngineCrashed, RequestRecord, StartupError

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


def judge(s: Scenario, records: list[RequestRecord]) -> Verdict:
    done = [r for r in records if r.finish_reason not in ("abort", "error")]
    if not done:
        return Verdict(False, math.inf)
    t0 = min(r.arrival_time for r in done)
    t1 = max(r.arrival_time for r in done)
    cut = t0 + WARMUP_FRACTION * (t1 - t0)
    judged = [r for r in done if r.arrival_time >= cut] or done
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
    """One seeded run of `requests` at a constant Poisson `rate` on one engine.

    It stops early once the verdict is certain: when more judged requests (or, for ITL,
    token gaps) already exceed a threshold than the percentile allows out of the run's total,
    the run misses the SLO whatever the rest does (every request generates its max_tokens).
    """
    engine = Engine(engine_config(s, k), s.reality, seed=seed, record_itl=True)
    reqs = sorted(s.shape(rate, requests, seed).generate(), key=lambda r: r.arrival_time)
    if not reqs:
        return Verdict(False, math.inf)
    cut = reqs[0].arrival_time + WARMUP_FRACTION * (reqs[-1].arrival_time - reqs[0].arrival_time)
    judged = [r for r in reqs if r.arrival_time >= cut]
    targets = s.slo.targets()
    allowed: dict[str, float] = {}
    for metric, target in targets:
        total = sum(max(r.max_tokens - 1, 0) for r in judged) if metric == "itl" else len(judged)
        allowed[metric] = (1.0 - target.percentile / 100.0) * total
    limit = {m: t.threshold_ms / 1000.0 for m, t in targets}
    bad = dict.fromkeys(allowed, 0.0)
    records: list[RequestRecord] = []
    try:
        for i, req in enumerate(reqs):
            if req.arrival_time > engine.now:
                engine.run_until(req.arrival_time)
            try:
                engine.add_request(req)
            except ValueError:
                continue
            if i % 32 != 31:
                continue
            for rec in engine.pop_finished():
                records.append(rec)
                if rec.arrival_time < cut or rec.finish_reason in ("abort", "error"):
                    continue
                ttft = rec.ttft if rec.ttft is not None else math.inf
                if "ttft" in bad and ttft > limit["ttft"]:
                    bad["ttft"] += 1
                if "e2e" in bad and rec.e2e > limit["e2e"]:
                    bad["e2e"] += 1
                if "itl" in bad and rec.itl:
                    bad["itl"] += int(np.count_nonzero(np.asarray(rec.itl) > limit["itl"]))
            if any(bad[m] > allowed[m] + 0.5 for m in bad):
                return Verdict(False, math.inf)
        while engine.has_unfinished():
            engine.run_until(math.inf)
        records.extend(engine.pop_finished())
    except EngineCrashed:
        return Verdict(False, math.inf, crashed=True)
    return judge(s, records)


def search_capacity(
    s: Scenario, k: Knobs, requests: int, seed: int, guess: float, precision: float
) -> tuple[float, int, bool]:
    """(capacity, runs used, crashed): doubling then bisection on the rate."""
    runs = 0

    def ok(rate: float) -> bool | None:
        nonlocal runs
        runs += 1
        v = run_at(s, k, rate, requests, seed)
        return None if v.crashed else v.meets

    lo, hi = 0.0, max(guess, 0.05)
    first = ok(hi)
    if first is None:
        return 0.0, runs, True
    if first:
        lo = hi
        while True:
            hi = lo * 2.0
            r = ok(hi)
            if r is None:
                return 0.0, runs, True
            if not r:
                break
            lo = hi
            if hi > 1e4:
                return hi, runs, False
    else:
        while True:
            cand = hi / 2.0
            if cand < 0.02:
                return 0.0, runs, False
            r = ok(cand)
            if r is None:
                return 0.0, runs, True
            if r:
                lo = cand
                break
            hi = cand
    while hi / lo > precision:
        mid = math.sqrt(lo * hi)
        r = ok(mid)
        if r is None:
            return 0.0, runs, True
        if r:
            lo = mid
        else:
            hi = mid
    return lo, runs, False


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
            cap, _, crashed = search_capacity(
                self.s, k, self.s.truth_requests, self.s.truth_seed, self.start_rate(), PRECISION
            )
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
                cap, _, _ = search_capacity(
                    self.s, probe, self.s.truth_requests, self.s.truth_seed, 1.0, 1.1
                )
                stored = max(0.25, cap)
                self.values["start-rate"] = stored
            self._guess = stored
        return self._guess

    def benchmark(self, k: Knobs, seed: int, requests: int, guess: float) -> Benchmark:
        """`benchmark_capacity`, remembered: it is deterministic given its seeds."""
        key = f"bench:{knob_key(k)}:{seed}:{requests}:{guess:.4g}"
        hit = self.benchmarks.get(key)
        if hit is not None:
            return Benchmark(hit[0], bool(hit[1]), bool(hit[2]), int(hit[3]), hit[4])
        b = benchmark_capacity(self.s, k, seed, requests, guess)
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
    seconds: float  # virtual time the benchmark runs took (arrivals of every run)


def benchmark_capacity(
    s: Scenario, k: Knobs, seed: int, requests: int = 300, guess: float | None = None
) -> Benchmark:
    """A shorter, noisier capacity search, as a tuner's own benchmark would measure it."""
    if not starts(s, k):
        return Benchmark(0.0, False, False, 0, 0.0)
    g = guess if guess is not None else max(0.5, s.peak_rate_per_replica())
    cap, runs, crashed = search_capacity(s, k, requests, seed, g, 1.05)
    # Each run sends `requests` at about the capacity: ~requests/capacity seconds each.
    seconds = runs * requests / max(cap, g * 0.5, 0.1)
    return Benchmark(0.0 if crashed else cap, crashed, True, runs, seconds)
