"""The tuning methods compared on each scenario, all inside the policy's bounds.

- `defaults`: vLLM's per-GPU defaults (vLLM arg_utils.py), never changed.
- `auto_tune`: vLLM's benchmarks/auto_tune/auto_tune.sh procedure (vLLM auto_tune.sh): the
  gpu_memory_utilization probe from 0.98 down in 0.01 steps (kept: the first that starts), then
  the NUM_SEQS_LIST x NUM_BATCHED_TOKENS_LIST grid (128 256 x 512 1024 2048 4096), each measured
  with 1000 prompts at rate inf and, when that misses the latency limit, 100-prompt runs from
  int(throughput)+1 down to 1 req/s; best throughput wins. Its limit is on P99 E2E only; here it
  is given the scenario's SLO percentiles instead (a user would patch the script so).
- `random`: random search over the knob space, each trial a capacity benchmark.
- `bo`: Bayesian optimisation in the manner of SCOOT (arXiv 2408.04323): a GP (Matern 5/2, fitted
  by marginal likelihood) with expected improvement, a feasibility classifier for hidden
  constraints (distance-weighted kNN standing in for SCOOT's random forest) with SCOOT's
  adaptive threshold, and the default configuration as the first (reference) point.
- `ours`: the operator's decide() loop against the live deployment (mode Auto).
- `oracle`: the exhaustive grid on the ground truth (`oracle_grid`).

The search baselines are offline tuners, as they are in practice: each trial restarts a vLLM
server on a separate, identical GPU (costing the model loading time) and runs a benchmark
there; the live deployment keeps its defaults until the tuning ends, then rolls out the best
configuration found. Their trials, tuning time and crashes on the tuning GPU are counted.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Protocol

import numpy as np
from scipy.optimize import minimize
from scipy.stats import norm

from bench.tuning.promsim import SimTransport
from bench.tuning.scenario import Scenario
from bench.tuning.truth import (
    Truth,
    engine_config,
    judge,
    knob_key,
    oom_hazard,
    starts,
)
from bench.tuning.world import NAMESPACE, World, revision
from vllm_autotuner.adapters.prometheus import PrometheusSource
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.core.autoscaling import published_capacity, track
from vllm_autotuner.core.decide import Decision, decide
from vllm_autotuner.core.knob_defaults import default_knobs
from vllm_autotuner.core.perf_model import AnalyticModel, EngineModel, PerformanceModel
from vllm_autotuner.core.search_memo import SearchMemo
from vllm_autotuner.core.snapshot import Observation, Scaling, Snapshot, evidence_window_s
from vllm_autotuner.core.topology import Topology, canary_running, topology
from vllm_autotuner.core.tuning_types import (
    Bounds,
    DeploymentContext,
    Knobs,
    TuningPolicy,
    TuningState,
)
from vllm_sim.catalog import load_gpu
from vllm_sim.engine import Engine
from vllm_sim.types import EngineCrashed
from vllm_sim.workload import run_virtual

EPOCH = datetime(2026, 1, 5, tzinfo=UTC)  # virtual t = 0 (a Monday, 00:00 UTC)
RECONCILE_S = 30.0  # the operator's default reconcile interval (operator.py reconcile_interval_s)


@dataclass(frozen=True)
class TrialPoint:
    """One trial: what was tried, what the method measured, what is really true."""

    index: int
    knobs: Knobs
    end_s: float  # virtual time the trial ended (offline: since the tuning started)
    measured: float | None  # the method's own measurement (capacity or throughput)
    failed: bool  # crashed or did not start
    incumbent: Knobs  # the method's best so far after this trial
    incumbent_truth: float = 0.0  # ground-truth capacity of the incumbent (filled later)


@dataclass
class Tuning:
    """A method's search (before its live run)."""

    method: str
    final: Knobs
    trials: list[TrialPoint] = field(default_factory=list)
    tuning_s: float = 0.0  # virtual time the tuning took
    trial_crashes: int = 0  # crashes or failed starts on the tuning GPU


# ----------------------------------------------------------------------------- knob space


def context(s: Scenario) -> DeploymentContext:
    product = load_gpu(s.gpu).device_name.replace(" ", "-")
    return DeploymentContext(
        model=s.model,
        gpu_product=product,
        tensor_parallel_size=s.tensor_parallel_size,
        max_model_len=s.max_model_len,
        replicas=s.replicas,
        rollout=s.rollout,
    )


def clamp(k: Knobs, b: Bounds) -> Knobs:
    return Knobs(
        int(min(max(k.max_num_batched_tokens, b.mnbt.min), b.mnbt.max)),
        int(min(max(k.max_num_seqs, b.mns.min), b.mns.max)),
        round(min(max(k.gpu_memory_utilization, b.gmu.min), b.gmu.max), 3),
    )


def vllm_refuses(k: Knobs) -> str | None:
    """Why vLLM would refuse to start with these knobs whatever the GPU, or None.

    vLLM's start-up checks on these three knobs (vllm.config: SchedulerConfig and CacheConfig
    validation): max_num_batched_tokens >= max_num_seqs; both >= 1; gpu_memory_utilization in
    (0, 1]. (max_num_batched_tokens >= max_model_len applies only with chunked prefill off,
    which these deployments never turn off.) A failure that depends on memory (weights or the
    KV cache for one max_model_len sequence not fitting) is a hidden constraint: a tuner learns
    it by trying, so it is not filtered here.
    """
    if k.max_num_seqs < 1 or k.max_num_batched_tokens < 1:
        return "max_num_seqs and max_num_batched_tokens must be >= 1"
    if k.max_num_batched_tokens < k.max_num_seqs:
        return (
            f"max_num_batched_tokens ({k.max_num_batched_tokens}) must be greater than or "
            f"equal to max_num_seqs ({k.max_num_seqs})"
        )
    if not 0.0 < k.gpu_memory_utilization <= 1.0:
        return f"gpu_memory_utilization must be in (0, 1], got {k.gpu_memory_utilization}"
    return None


def vllm_defaults(s: Scenario) -> Knobs:
    ctx = context(s)
    return clamp(default_knobs(ctx.gpu_product, None, s.max_model_len), s.bounds)


class Space:
    """The knob space as the search baselines see it: log2 of the two batching knobs and
    gpu_memory_utilization, mapped to [0, 1]^3; mnbt in multiples of 64, mns of 8."""

    def __init__(self, b: Bounds) -> None:
        self.b = b
        self.lo = np.array([math.log2(b.mnbt.min), math.log2(b.mns.min), b.gmu.min])
        self.hi = np.array([math.log2(b.mnbt.max), math.log2(b.mns.max), b.gmu.max])

    def knobs(self, u: np.ndarray) -> Knobs:
        x = self.lo + np.clip(u, 0, 1) * (self.hi - self.lo)
        mnbt = int(round(2 ** x[0] / 64) * 64)
        mns = int(round(2 ** x[1] / 8) * 8)
        return clamp(Knobs(max(mnbt, 64), max(mns, 8), round(float(x[2]), 2)), self.b)

    def unit(self, k: Knobs) -> np.ndarray:
        x = np.array(
            [
                math.log2(k.max_num_batched_tokens),
                math.log2(k.max_num_seqs),
                k.gpu_memory_utilization,
            ]
        )
        span = np.where(self.hi > self.lo, self.hi - self.lo, 1.0)
        out: np.ndarray = np.clip((x - self.lo) / span, 0, 1)
        return out


# -------------------------------------------------------------------------------- oracle


def _levels(lo: float, hi: float, base: tuple[int, ...]) -> list[int]:
    out = {v for v in base if lo <= v <= hi} | {int(lo), int(hi)}
    return sorted(out)


def oracle_configs(s: Scenario, truth: Truth, progress: Callable[[str], None]) -> list[Knobs]:
    """The oracle's grid, in three stages on the ground truth (it may read the hidden reality):

    1. every valid (mnbt, mns) pair of powers of two inside the bounds, at the highest
       gpu_memory_utilization (0.01 grid) the reality lets run without the OOM hazard;
    2. around the best 2 pairs, the √2-finer neighbours (mnbt in multiples of 64, mns of 8);
    3. for the best pair, every 0.01 of gpu_memory_utilization inside the bounds.

    More KV cache never lowers capacity in the simulator, so the highest safe value is where
    a pair shows its best; stage 3 confirms it.
    """
    b = s.bounds
    mnbts = _levels(b.mnbt.min, b.mnbt.max, tuple(2**i for i in range(6, 16)))
    mnss = _levels(b.mns.min, b.mns.max, tuple(2**i for i in range(3, 12)))
    gmus = [round(float(g), 2) for g in np.arange(b.gmu.min, b.gmu.max + 1e-9, 0.01)]

    def top_safe(t: int, n: int) -> float:
        safe = [g for g in gmus if not oom_hazard(s, Knobs(t, n, g))]
        return max(safe) if safe else gmus[0]

    seen: dict[str, tuple[Knobs, float]] = {}

    def evaluate(ks: list[Knobs]) -> None:
        for k in ks:
            if k.max_num_batched_tokens >= k.max_num_seqs and b.contains(k):
                seen.setdefault(knob_key(k), (k, truth.capacity(k)))

    evaluate([Knobs(t, n, top_safe(t, n)) for t in mnbts for n in mnss])
    progress(f"oracle stage 1: {len(seen)} configs")
    ranked = sorted(seen.values(), key=lambda kc: -kc[1])[:2]
    finer = []
    for k, _ in ranked:
        for ft in (2**-0.5, 1.0, 2**0.5):
            for fn in (2**-0.5, 1.0, 2**0.5):
                t = int(round(k.max_num_batched_tokens * ft / 64) * 64)
                n = int(round(k.max_num_seqs * fn / 8) * 8)
                t = int(min(max(t, b.mnbt.min), b.mnbt.max))
                n = int(min(max(n, b.mns.min), b.mns.max))
                finer.append(Knobs(t, n, top_safe(t, n)))
    evaluate(finer)
    best = max(seen.values(), key=lambda kc: kc[1])[0]
    evaluate([Knobs(best.max_num_batched_tokens, best.max_num_seqs, g) for g in gmus])
    progress(f"oracle stages 2-3: {len(seen)} configs")
    return [k for k, _ in seen.values()]


def run_oracle(s: Scenario, truth: Truth, progress: Callable[[str], None]) -> tuple[Knobs, float]:
    configs = oracle_configs(s, truth, progress)
    truth.save()
    return max(((k, truth.capacity(k)) for k in configs), key=lambda kc: kc[1])


# ----------------------------------------------------------------------------- auto_tune


def _bench_run(
    s: Scenario, k: Knobs, rate: float, prompts: int, seed: int, engine_seed: int
) -> tuple[float, bool, bool, float]:
    """(throughput req/s, meets the SLO, crashed, seconds) of one `vllm bench serve` run."""
    engine = Engine(engine_config(s, k), s.reality, seed=engine_seed, record_itl=True)
    # rate inf: every prompt arrives at t ~ 0
    spec = s.shape(1e6 if math.isinf(rate) else rate, prompts, seed)
    try:
        records = run_virtual(engine, spec)
    except EngineCrashed:
        return 0.0, False, True, engine.now
    done = [r for r in records if r.finish_reason not in ("abort", "error")]
    if not done:
        return 0.0, False, False, 0.0
    span = max(r.finish_time for r in done) - min(r.arrival_time for r in done)
    return len(done) / max(span, 1e-9), judge(s, records).meets, False, span


def auto_tune(s: Scenario, progress: Callable[[str], None]) -> Tuning:
    b = s.bounds
    t = 0.0
    trials: list[TrialPoint] = []
    crashes = 0
    seqs = [int(min(max(v, b.mns.min), b.mns.max)) for v in (128, 256)]
    toks = [int(min(max(v, b.mnbt.min), b.mnbt.max)) for v in (512, 1024, 2048, 4096)]
    seqs, toks = sorted(set(seqs)), sorted(set(toks))
    best: tuple[float, Knobs] | None = None
    found_gmu: float | None = None
    g = min(0.98, b.gmu.max)
    while g >= max(0.90, b.gmu.min) - 1e-9:
        k = Knobs(toks[-1], seqs[-1], round(g, 2))
        t += s.load_time_s
        ok = starts(s, k)
        crashes += 0 if ok else 1
        inc = best[1] if best else k
        trials.append(TrialPoint(len(trials) + 1, k, t, None, not ok, inc))
        if ok:
            found_gmu = round(g, 2)
            break
        g -= 0.01
    if found_gmu is None:
        d = vllm_defaults(s)
        return Tuning("auto_tune", d, trials, t, crashes)
    seed = 1000
    for n in seqs:
        for m in toks:
            k = Knobs(m, n, found_gmu)
            t += s.load_time_s
            seed += 1
            thr, meets, crashed, secs = _bench_run(s, k, math.inf, 1000, seed, seed)
            t += secs
            value = thr if meets and not crashed else 0.0
            if not meets and not crashed:
                r = int(thr) + 1
                while r >= 1:
                    seed += 1
                    thr2, meets2, crashed2, secs2 = _bench_run(s, k, float(r), 100, seed, seed)
                    t += secs2 + 5.0
                    if crashed2:
                        crashed = True
                        break
                    if meets2:
                        value = thr2
                        break
                    r -= 1
            crashes += int(crashed)
            if value > 0 and (best is None or value > best[0]):
                best = (value, k)
            inc = best[1] if best else k
            trials.append(TrialPoint(len(trials) + 1, k, t, value, crashed, inc))
            progress(f"auto_tune {len(trials)}: {k.describe()} -> {value:.2f} req/s")
    final = best[1] if best else vllm_defaults(s)
    return Tuning("auto_tune", final, trials, t, crashes)


# ----------------------------------------------------------------------- random and BO


def startable(space: Space, rng: np.random.Generator) -> Knobs:
    """A uniform draw from the part of the space vLLM accepts at start-up (rejection
    sampling: no trial is spent on a configuration vLLM refuses outright)."""
    for _ in range(10_000):
        k = space.knobs(rng.random(3))
        if vllm_refuses(k) is None:
            return k
    raise ValueError(f"no configuration inside {space.b} passes vLLM's start-up checks")


def startable_units(space: Space, units: np.ndarray) -> np.ndarray:
    """The candidate points (rows in [0, 1]^3) whose knobs vLLM accepts at start-up."""
    keep = [vllm_refuses(space.knobs(u)) is None for u in units]
    out: np.ndarray = units[np.asarray(keep, dtype=bool)]
    return out


def _trial(
    s: Scenario, truth: Truth, k: Knobs, seed: int, guess: float
) -> tuple[float | None, bool, float]:
    """One trial: a server restart and a capacity benchmark of time-sized runs
    (truth.BenchPlan)."""
    bench = truth.benchmark(k, seed, guess)
    seconds = s.load_time_s + bench.seconds
    if not bench.started or bench.crashed:
        return None, True, seconds
    return bench.capacity, False, seconds


def random_search(
    s: Scenario, truth: Truth, n: int, seed: int, progress: Callable[[str], None]
) -> Tuning:
    space = Space(s.bounds)
    rng = np.random.default_rng(seed)
    t = 0.0
    best: tuple[float, Knobs] | None = None
    out = Tuning("random", vllm_defaults(s))
    guess = max(0.5, s.peak_rate_per_replica())
    for i in range(n):
        k = startable(space, rng)
        value, failed, secs = _trial(s, truth, k, seed * 100 + i, guess)
        t += secs
        out.trial_crashes += int(failed)
        if value is not None and value > 0 and (best is None or value > best[0]):
            best = (value, k)
            guess = value
        inc = best[1] if best else out.final
        out.trials.append(TrialPoint(i + 1, k, t, value, failed, inc))
    progress(f"random: {n} trials, best measured {best[0] if best else 0:.2f} req/s")
    out.final = best[1] if best else out.final
    out.tuning_s = t
    return out


def _matern52(a: np.ndarray, b: np.ndarray, ls: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.sum(((a[:, None, :] - b[None, :, :]) / ls) ** 2, axis=-1))
    r = math.sqrt(5.0) * d
    out: np.ndarray = (1.0 + r + r * r / 3.0) * np.exp(-r)
    return out


class GP:
    """A small GP regressor: Matern 5/2 with per-dimension length scales, signal and noise
    variances fitted by maximising the log marginal likelihood (L-BFGS-B, 3 starts)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x = x
        self.mu = float(np.mean(y))
        self.sd = float(np.std(y)) or 1.0
        self.y = (y - self.mu) / self.sd
        best: tuple[float, np.ndarray] | None = None
        for start in ([-1.0, -1.0, -1.0, 0.0, -3.0], [0.0, 0.0, 0.0, 0.0, -2.0],
                      [-2.0, -2.0, -2.0, 0.0, -4.0]):  # fmt: skip
            res = minimize(self._nll, np.array(start), method="L-BFGS-B",
                           bounds=[(-4, 2)] * 3 + [(-3, 3), (-8, 0)])  # fmt: skip
            if best is None or res.fun < best[0]:
                best = (float(res.fun), res.x)
        assert best is not None
        self._set(best[1])

    def _set(self, p: np.ndarray) -> None:
        self.ls = np.exp(p[:3])
        self.var = float(np.exp(p[3]))
        self.noise = float(np.exp(p[4]))
        k = self.var * _matern52(self.x, self.x, self.ls) + (self.noise + 1e-8) * np.eye(
            len(self.x)
        )
        self.chol = np.linalg.cholesky(k)
        self.alpha = np.linalg.solve(self.chol.T, np.linalg.solve(self.chol, self.y))

    def _nll(self, p: np.ndarray) -> float:
        try:
            self._set(p)
        except np.linalg.LinAlgError:
            return 1e10
        return float(
            0.5 * self.y @ self.alpha + np.sum(np.log(np.diag(self.chol)))
            + 0.5 * len(self.y) * math.log(2 * math.pi)
        )  # fmt: skip

    def predict(self, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ks = self.var * _matern52(xs, self.x, self.ls)
        mean = ks @ self.alpha
        v = np.linalg.solve(self.chol, ks.T)
        var = np.maximum(self.var - np.sum(v * v, axis=0), 1e-12)
        return mean * self.sd + self.mu, np.sqrt(var) * self.sd


def feasibility(x: np.ndarray, ok: np.ndarray, xs: np.ndarray, k: int = 5) -> np.ndarray:
    """P(config runs) by distance-weighted kNN over the trials so far (SCOOT uses a random
    forest on the same labels; kNN keeps this free of scikit-learn)."""
    d = np.sqrt(np.sum((xs[:, None, :] - x[None, :, :]) ** 2, axis=-1)) + 1e-6
    kk = min(k, len(x))
    idx = np.argsort(d, axis=1)[:, :kk]
    w = 1.0 / np.take_along_axis(d, idx, axis=1)
    out: np.ndarray = np.sum(w * ok[idx], axis=1) / np.sum(w, axis=1)
    return out


def bayes_opt(
    s: Scenario, truth: Truth, n: int, seed: int, progress: Callable[[str], None]
) -> Tuning:
    space = Space(s.bounds)
    rng = np.random.default_rng(seed)
    out = Tuning("bo", vllm_defaults(s))
    xs: list[np.ndarray] = []
    ys: list[float | None] = []
    delta, streak = 0.5, 0  # SCOOT's adaptive feasibility threshold
    best: tuple[float, Knobs] | None = None
    t = 0.0
    guess = max(0.5, s.peak_rate_per_replica())
    n_init = 5
    for i in range(n):
        if i == 0:
            k = out.final  # SCOOT's reference point: the default configuration
        elif i < n_init:
            k = startable(space, rng)
        else:
            cand = startable_units(space, rng.random((2000, 3)))
            if len(cand) == 0:
                cand = np.array([space.unit(startable(space, rng))])
            x = np.array(xs)
            ok = np.array([0.0 if y is None else 1.0 for y in ys])
            feas = np.ones(len(cand))
            if len(x) >= 2 and ok.min() < 1.0:  # RF built once there are #features-1 samples
                feas = feasibility(x, ok, cand)
            good = [j for j, y in enumerate(ys) if y is not None]
            if len(good) >= 2:
                gp = GP(x[good], np.array([ys[j] for j in good], dtype=float))
                mean, sd = gp.predict(cand)
                y_best = max(float(ys[j] or 0.0) for j in good)
                z = (mean - y_best - 0.01 * abs(y_best)) / sd
                ei = sd * (z * norm.cdf(z) + norm.pdf(z))
            else:
                ei = rng.random(len(cand))
            allowed = feas >= delta
            score = np.where(allowed, ei, -np.inf) if allowed.any() else ei * feas
            k = space.knobs(cand[int(np.argmax(score))])
        value, failed, secs = _trial(s, truth, k, seed * 100 + i, guess)
        t += secs
        xs.append(space.unit(k))
        ys.append(None if failed else (value or 0.0))
        out.trial_crashes += int(failed)
        if failed:
            delta, streak = min(0.75, max(delta + 0.05, 0.5)), 0
        else:
            streak += 1
            if streak % 5 == 0:
                delta = max(0.25, delta - 0.05)
        if value is not None and value > 0 and (best is None or value > best[0]):
            best = (value, k)
            guess = value
        inc = best[1] if best else out.final
        out.trials.append(TrialPoint(i + 1, k, t, value, failed, inc))
    progress(f"bo: {n} trials, best measured {best[0] if best else 0:.2f} req/s")
    out.final = best[1] if best else out.final
    out.tuning_s = t
    return out


def prefix(tuning: Tuning, n: int, name: str) -> Tuning:
    """The same sequential search stopped after `n` trials (same seeds: identical prefix)."""
    trials = tuning.trials[:n]
    final = trials[-1].incumbent if trials else tuning.final
    return Tuning(
        name,
        final,
        list(trials),
        trials[-1].end_s if trials else 0.0,
        sum(1 for tp in trials if tp.failed),
    )


# ---------------------------------------------------------------------------------- ours


class TrueCapacity(Protocol):
    """What holds the model to the truth: `Truth.capacity` (cached)."""

    def capacity(self, k: Knobs) -> float: ...


@dataclass(frozen=True)
class PredictionPoint:
    """The model's capacity for one knob setting at one decision, next to the ground truth.

    `role`: "applied" (what runs on the stable pods) or "proposed". `observed_rate`: finished
    requests per second per pod in the decision's window, as the tuner saw it (Prometheus);
    `arrival_rate`: requests per second per pod the Service sent to those pods in the same
    window (ground truth). `overloaded`: that arrival rate was above the true capacity of the
    applied knobs, i.e. the window was past saturation.
    """

    t: float
    role: str
    knobs: Knobs
    predicted: float
    true: float | None
    observed_rate: float
    arrival_rate: float
    overloaded: bool | None

    def error(self) -> float | None:
        """predicted / true - 1 (None when the truth is 0 or unknown)."""
        if self.true is None or self.true <= 0:
            return None
        return self.predicted / self.true - 1.0


@dataclass
class OursTrace:
    times: list[float] = field(default_factory=list)
    knobs: list[Knobs] = field(default_factory=list)
    actions: list[tuple[float, str, str]] = field(default_factory=list)
    # Per reconcile: the phase and the candidate on the canary pod (None outside a canary).
    phases: list[str] = field(default_factory=list)
    canary: list[Knobs | None] = field(default_factory=list)
    predictions: list[PredictionPoint] = field(default_factory=list)


def _target(
    s: Scenario,
    policy: TuningPolicy,
    name: str,
    knobs: Knobs,
    pods: list[str],
    since: float | None,
    window_s: float,
    pods_since: float | None,
) -> SnapshotTarget:
    return SnapshotTarget(
        namespace=NAMESPACE,
        name=name,
        pods=tuple(pods),
        since=None if since is None else EPOCH + timedelta(seconds=since),
        knobs=knobs,
        revision=revision(knobs),
        window_s=window_s,
        slo=(policy.slo.ttft, policy.slo.itl, policy.slo.e2e),
        model_name=s.model,
        pods_since=None if pods_since is None else EPOCH + timedelta(seconds=pods_since),
    )


def _observe(
    s: Scenario,
    world: World,
    state: TuningState,
    policy: TuningPolicy,
    snapshots: Callable[[list[SnapshotTarget]], dict[tuple[str, str], Snapshot]],
    scaling: Scaling | None,
    window: float,
) -> tuple[Observation, list[str], float | None]:
    """What the operator observes at this reconcile: one snapshot of the pods running the
    applied knobs or, during a canary, the stable pods and the canary pod over the same window
    (since the later of the two sets became ready, and never before the replica count last
    settled), `window` seconds long at most (evidence_window_s, as the controller asks). Also
    the stable pods and their `since`."""
    applied = state.applied
    settled = None
    if scaling is not None and scaling.settled_at is not None:
        settled = (scaling.settled_at - EPOCH).total_seconds()
    if not canary_running(state):
        pods, ready = world.ready_pods(applied)
        since = max((x for x in (ready, settled) if x is not None), default=None)
        target = _target(s, policy, "bench", applied, pods, since, window, ready)
        obs = Observation(snapshots([target])[target.key], world.pod_health(), scaling=scaling)
        return obs, pods, since
    assert state.candidate is not None
    pods, s_since = world.ready_pods(applied, "stable")
    c_pods, c_since = world.ready_pods(state.candidate, "canary")
    fair = None
    if state.analysis is not None:
        fair = (state.analysis.since - EPOCH).total_seconds()
    known = [x for x in (s_since, c_since, fair, settled) if x is not None]
    since = max(known) if known else None
    stable = _target(s, policy, "bench", applied, pods, since, window, s_since)
    canary = _target(s, policy, "bench-canary", state.candidate, c_pods, since, window, c_since)
    snaps = snapshots([stable, canary])
    obs = Observation(
        snaps[stable.key], world.pod_health(), canary=snaps[canary.key], scaling=scaling
    )
    return obs, pods, since


def _predictions(
    decision: Decision,
    snap: Snapshot,
    world: World,
    pods: list[str],
    since: float | None,
    window_s: float,
    truth: TrueCapacity | None,
) -> list[PredictionPoint]:
    """The model's predictions at this decision next to the ground truth (cached)."""
    if not decision.predictions:
        return []
    t = world.t
    start = t - window_s if since is None else max(since, t - window_s)
    arrival = world.arrival_rate(pods, start, t)
    observed = snap.per_pod_rate() if snap.available else 0.0
    applied_true = None if truth is None else truth.capacity(decision.predictions[0][0])
    out = []
    for i, (knobs, pred) in enumerate(decision.predictions):
        out.append(
            PredictionPoint(
                t=t,
                role="applied" if i == 0 else "proposed",
                knobs=knobs,
                predicted=pred.capacity_rps,
                true=None if truth is None else truth.capacity(knobs),
                observed_rate=observed,
                arrival_rate=arrival,
                overloaded=None if applied_true is None else arrival > applied_true,
            )
        )
    return out


def _capacity(state: TuningState, topo: Topology) -> float | None:
    published = published_capacity(state, topo)
    return None if published is None else published.per_replica_rps


def run_ours(
    s: Scenario,
    world: World,
    model_kind: str,
    progress: Callable[[str], None],
    truth: TrueCapacity | None = None,
    mode: str = "Auto",
) -> tuple[Tuning, OursTrace, int]:
    """The operator's loop: every reconcile, the snapshots through the Prometheus adapter's own
    code (PrometheusSource's cycle over a SimTransport), pod health, then decide(), then the
    Deployments its state calls for (`core.topology`) applied to the world. With `truth`, the
    model's predictions at each decision are recorded next to the ground truth's capacity.

    With a replica autoscaler in the world, the count is the autoscaler's (`replica_target`):
    the context takes it at every reconcile, its motion is tracked as the controller tracks it
    (core/autoscaling.track), a new count is rendered through the operator's topology at once,
    and the autoscaler reads the capacity the operator publishes. `mode` "Recommend" is the
    operator beside untouched knobs: it publishes the capacity and changes nothing."""
    policy = s.policy(mode)
    base_ctx = replace(context(s), autoscaled=world.autoscaler is not None)
    ctx = base_ctx
    model: PerformanceModel = (
        EngineModel() if model_kind == "engine" else AnalyticModel(ctx.gpu_product)
    )
    start = world.desired
    state = TuningState.initial(start)
    source = PrometheusSource("http://prometheus.sim", window_grid_s=15.0)
    transport = SimTransport(world.db, offset=EPOCH.timestamp())
    loop = asyncio.new_event_loop()
    trace = OursTrace()
    out = Tuning("ours", start)
    rollbacks = 0
    pending: Knobs | None = None
    crashes_seen = 0
    memo: SearchMemo | None = None
    scaling: Scaling | None = None
    live = [state]  # the operator's state now, for the autoscaler's writes between reconciles
    world.render = lambda n: topology(live[0], replace(base_ctx, replicas=n))
    if world.autoscaler is not None:
        world.autoscaler.capacity = lambda: _capacity(
            live[0], topology(live[0], replace(base_ctx, replicas=world.replica_target))
        )
    t = 0.0
    evidence: Snapshot | None = None
    try:
        while t < world.horizon - 1e-9:
            t = min(t + RECONCILE_S, world.horizon)
            world.advance_to(t)
            now = EPOCH + timedelta(seconds=t)
            ctx = replace(base_ctx, replicas=world.replica_target)
            serving = sum(1 for p in world.pods if p.phase == "ready")
            expected = topology(state, ctx).pods
            scaling = track(scaling, ctx.replicas, serving, expected, now)

            def snapshots(
                targets: list[SnapshotTarget], now: datetime = now
            ) -> dict[tuple[str, str], Snapshot]:
                return loop.run_until_complete(source._cycle(transport, targets, now))

            window = evidence_window_s(
                policy.evaluation_window_s, policy.min_requests_per_window, evidence
            )
            obs, pods, since = _observe(s, world, state, policy, snapshots, scaling, window)
            if obs.snapshot.available:
                evidence = obs.snapshot  # sizes the next window, as the controller does
            # As the controller does: the last search stands until there is new evidence.
            decision = decide(state, obs, policy, ctx, now, model, memo=memo)
            trace.predictions += _predictions(
                decision, obs.snapshot, world, pods, since, window, truth
            )
            memo = decision.search_memo or memo
            state = decision.new_state
            live[0] = state
            trace.times.append(t)
            trace.knobs.append(state.applied)
            trace.phases.append(state.phase)
            trace.canary.append(state.candidate if canary_running(state) else None)
            if decision.action not in ("hold", "verify"):
                trace.actions.append((t, decision.action, decision.reason))
                progress(f"ours t={t / 60:.0f}m {decision.action}: {decision.reason[:110]}")
            if decision.action == "rollout":
                pending = state.candidate or state.applied
            if decision.action in ("commit", "rollback") and pending is not None:
                rollbacks += int(decision.action == "rollback")
                failed = decision.action == "rollback" and world.crashes > crashes_seen
                n = len(out.trials) + 1
                out.trials.append(TrialPoint(n, pending, t, None, failed, state.last_good))
                pending, crashes_seen = None, world.crashes
            world.apply_topology(topology(state, ctx))
    finally:
        loop.close()
    if pending is not None:  # a trial still running at the horizon counts as a trial
        out.trials.append(TrialPoint(len(out.trials) + 1, pending, t, None, False, state.last_good))
    out.final = state.last_good
    out.tuning_s = world.horizon
    return out, trace, rollbacks
