"""Performance models: what would this deployment do with other knobs, under this workload?

A model is calibrated on what one snapshot showed (the observed knobs, load and latencies) and
then predicts, for any candidate knobs, the SLO percentiles at the observed load and the
capacity: the highest per-pod request rate that still meets every SLO target with the safety
margin. Search compares candidates by those predictions, so a model must above all rank knob
settings correctly; absolute accuracy matters for the predicted numbers people read.

`AnalyticModel` is a closed-form step-time and queueing model (microseconds per prediction), used
in property tests, as the search's screen and as a fallback. `EngineModel` runs the simulator's
engine instead: slower (about a second per decide), closer to what vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from vllm_autotuner.core.knob_defaults import GIB, gpu_memory_gib
from vllm_autotuner.core.numeric import find_root
from vllm_autotuner.core.snapshot import Snapshot
from vllm_autotuner.core.tuning_types import SLO, DeploymentContext, Knobs
from vllm_sim.catalog import GPU_ALIASES, GPU_SPECS, MODEL_ALIASES, MODEL_CONFIGS
from vllm_sim.engine import Engine
from vllm_sim.types import EngineConfig, Reality, StartupError
from vllm_sim.workload import LengthDist, WorkloadSpec

DEFAULT_PERCENTILE = 95.0


@dataclass(frozen=True)
class Workload:
    """Per-pod traffic to predict for, and the targets a prediction is judged against."""

    request_rate: float
    prompt_mean: float
    prompt_p90: float
    gen_mean: float
    gen_p90: float
    prefix_hit_rate: float = 0.0
    slo: SLO = field(default_factory=SLO)
    safety_margin: float = 0.9

    @classmethod
    def from_snapshot(cls, s: Snapshot, slo: SLO, safety_margin: float) -> Workload:
        """Lengths and rate as observed; p90 falls back to 2x the mean (a long-tailed guess)."""
        pm = s.prompt_len.mean or s.prompt_len.p50 or 512.0
        gm = s.generation_len.mean or s.generation_len.p50 or 128.0
        return cls(
            request_rate=s.per_pod_rate(),
            prompt_mean=pm,
            prompt_p90=s.prompt_len.p90 or 2.0 * pm,
            gen_mean=gm,
            gen_p90=s.generation_len.p90 or 2.0 * gm,
            prefix_hit_rate=min(0.99, max(0.0, s.prefix_cache_hit_rate or 0.0)),
            slo=slo,
            safety_margin=safety_margin,
        )

    def at_rate(self, rate: float) -> Workload:
        return replace(self, request_rate=rate)


@dataclass(frozen=True)
class Calibration:
    """Fitted parameters of a model for one deployment (persisted in status.tuning).

    `step_scale` multiplies the prior step time (1.0 = the catalog's GPU at the assumed
    efficiencies); `compute_scale` multiplies the per-token compute cost on top of it (what
    makes prefill-carrying steps long); `per_request_overhead_s` is time a request spends
    outside engine steps (API server, tokenisation); the KV fields let capacity follow
    gpu_memory_utilization.
    """

    step_scale: float = 1.0
    compute_scale: float = 1.0
    per_request_overhead_s: float = 0.0
    kv_bytes_per_token: float | None = None
    gpu_memory_bytes: float | None = None
    observed_kv_tokens: float | None = None
    observed_gmu: float | None = None
    fitted: bool = False
    extra: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for k, v in asdict(self).items():
            if k == "extra":
                continue
            if isinstance(v, bool):
                out[k] = 1.0 if v else 0.0
            elif v is not None:
                out[k] = float(v)
        out.update({f"x_{k}": float(v) for k, v in self.extra.items()})
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, float]) -> Calibration:
        def g(key: str) -> float | None:
            v = d.get(key)
            return None if v is None else float(v)

        return cls(
            step_scale=g("step_scale") or 1.0,
            compute_scale=g("compute_scale") or 1.0,
            per_request_overhead_s=g("per_request_overhead_s") or 0.0,
            kv_bytes_per_token=g("kv_bytes_per_token"),
            gpu_memory_bytes=g("gpu_memory_bytes"),
            observed_kv_tokens=g("observed_kv_tokens"),
            observed_gmu=g("observed_gmu"),
            fitted=bool(d.get("fitted", 0.0)),
            extra={k[2:]: float(v) for k, v in d.items() if k.startswith("x_")},
        )

    def kv_tokens_at(self, gmu: float) -> float | None:
        """KV capacity at another gpu_memory_utilization, by keeping non-KV memory constant."""
        if self.observed_kv_tokens is None or self.observed_gmu is None:
            return None
        if self.kv_bytes_per_token and self.gpu_memory_bytes:
            non_kv = (
                self.observed_gmu * self.gpu_memory_bytes
                - self.observed_kv_tokens * self.kv_bytes_per_token
            )
            return max(0.0, (gmu * self.gpu_memory_bytes - non_kv) / self.kv_bytes_per_token)
        # Without byte counts assume 30% of the GPU is weights and activations (8B on 80 GB:
        # 16 GB weights + a few GB of activations and graphs, vLLM gpu_worker.py).
        f0 = min(0.3, 0.9 * self.observed_gmu)
        return max(0.0, self.observed_kv_tokens * (gmu - f0) / (self.observed_gmu - f0))


@dataclass(frozen=True)
class Prediction:
    """Predicted behaviour of one knob setting under one workload (per pod).

    Latencies are at each SLO target's percentile (p95 for metrics without a target).
    `feasible` means the configuration can run and meets the SLO with the safety margin at the
    workload's rate; `capacity_rps` is the highest rate at which it still would.
    """

    ttft_ms: float
    itl_ms: float
    e2e_ms: float
    kv_capacity_tokens: float | None
    preemption_rate: float
    feasible: bool
    capacity_rps: float
    meets_slo: bool
    reason: str = ""
    # Worst predicted value / SLO threshold over the targets (no margin); > 1 misses the SLO.
    slo_ratio: float = 0.0


class PerformanceModel(Protocol):
    """What decide() and search need from a performance model."""

    def calibrate(
        self,
        snapshot: Snapshot,
        knobs: Knobs,
        ctx: DeploymentContext,
        workload: Workload,
        prior: Calibration | None,
    ) -> Calibration: ...

    def predict(self, knobs: Knobs, workload: Workload, calibration: Calibration) -> Prediction: ...


# --------------------------------------------------------------------------- analytic model

# Achieved memory bandwidth (B/s) and dense BF16 compute (FLOP/s) per GPU, from
# NVIDIA datasheets (vendor data sheets, dense figures).
_GPU_SPECS: dict[str, tuple[float, float]] = {
    "H100": (3.35e12, 989e12),
    "H200": (4.8e12, 989e12),
    "A100": (2.039e12, 312e12),
    "L40S": (0.864e12, 362e12),
    "B200": (8.0e12, 2250e12),
}
# Llama-3.1-8B shaped priors (a roofline of its weights): 15.01 GB read per decode step,
# 128 KiB of KV per token, ~15 GFLOP per prefill token; efficiencies 0.85 (bandwidth) and 0.5
# (compute); ~2.5 ms of host work per step. The calibrated step_scale absorbs the rest.
_WEIGHT_BYTES = 15.01e9
_KV_BYTES = 131072.0
_FLOP_PER_TOKEN = 15e9
_ETA_BW = 0.85
_ETA_MFU = 0.5
_STEP_FIXED_S = 2.5e-3


def _specs(product: str | None) -> tuple[float, float]:
    p = (product or "H100").upper()
    for key in ("H200", "H100", "A100", "L40S", "B200"):
        if key in p:
            return _GPU_SPECS[key]
    return _GPU_SPECS["H100"]


def _percentile(slo: SLO, metric: str) -> float:
    t = getattr(slo, metric)
    return DEFAULT_PERCENTILE if t is None else float(t.percentile)


class _Steady(NamedTuple):
    """A tuple, not a dataclass: the capacity search builds a few thousand per decision."""

    step_s: float  # mean step time
    decode_step_s: float
    prefill_step_s: float
    running: float
    util: float  # utilisation of the tightest resource
    wait_mean_s: float
    stable: bool
    preemption_rate: float
    chunk: float
    prefill_steps_frac: float


_UNSTABLE = _Steady(
    math.inf, math.inf, math.inf, math.inf, math.inf, math.inf, False, 0.0, 0.0, 1.0
)


class _Pre(NamedTuple):
    """What one prediction's many steady states share: step coefficients and KV capacity."""

    fixed: float
    weights: float
    kv_read: float
    compute: float
    kv_cap: float | None


class AnalyticModel:
    """A steady-state model of vLLM's V1 scheduler (vLLM scheduler.py) at a Poisson arrival rate.

    Per step: `t = scale * (fixed + max(weights + kv_read * context, compute * tokens))`.
    With Little's law (running = rate * decode steps * t) and the token flow
    (tokens per step = rate * (uncached prompt + output) * t) this has a closed-form fixed
    point; the token budget, max_num_seqs and the KV cache are the three servers a request may
    queue for. Tails come from the mix of decode-only and prefill-carrying steps (ITL) and an
    exponential waiting-time tail (TTFT).
    """

    def __init__(self, gpu_product: str | None = None) -> None:
        self.gpu_product = gpu_product

    # -- calibration -------------------------------------------------------------------------

    def calibrate(
        self,
        snapshot: Snapshot,
        knobs: Knobs,
        ctx: DeploymentContext,
        workload: Workload,
        prior: Calibration | None,
    ) -> Calibration:
        """Fit step time to the observed ITL (mean and tail) and overhead to the median TTFT.

        Two scales are fitted in turn: the whole step (from the mean ITL, mostly decode-only
        steps) and the compute part (from the ITL tail, the steps that carry prefill chunks).
        """
        self.gpu_product = ctx.gpu_product
        cal = replace(_kv_calibration(snapshot, knobs, ctx, prior), fitted=False)
        mean_itl = snapshot.itl.mean_ms or snapshot.itl.p50_ms
        if mean_itl is None or workload.request_rate <= 0:
            return cal
        q = _percentile(workload.slo, "itl")
        tail_itl = snapshot.itl.at(q)
        for _ in range(3):
            cal = self._fit(cal, "step_scale", knobs, workload, mean_itl / 1000.0, None)
            if tail_itl is not None and tail_itl > mean_itl:
                cal = self._fit(cal, "compute_scale", knobs, workload, tail_itl / 1000.0, q)
        cal = replace(cal, fitted=True)
        ttft = snapshot.ttft.p50_ms
        if ttft is not None:
            no_overhead = replace(cal, per_request_overhead_s=0.0)
            pred = self._latencies(knobs, workload, no_overhead, percentile_override=50.0)
            cal = replace(cal, per_request_overhead_s=max(0.0, ttft / 1000.0 - pred[0]))
        return cal

    def _fit(
        self,
        cal: Calibration,
        name: str,
        knobs: Knobs,
        w: Workload,
        target_s: float,
        itl_percentile: float | None,
    ) -> Calibration:
        """Solve for one scale (a root in log space) so the model reproduces `target_s`."""

        def value(log_scale: float) -> float:
            c = _with_scale(cal, name, math.exp(log_scale))
            if itl_percentile is None:
                st = self._steady(knobs, w, c)
                return st.step_s if st.stable else 1e3
            itl = self._latencies(knobs, w, c, itl_override=itl_percentile)[1]
            return itl if math.isfinite(itl) else 1e3

        lo, hi = math.log(0.02), math.log(50.0)
        f_lo, f_hi = value(lo) - target_s, value(hi) - target_s
        if f_lo >= 0:
            x = lo
        elif f_hi <= 0:
            x = hi
        else:
            x = find_root(lambda v: value(v) - target_s, lo, hi, xtol=1e-4)
        return _with_scale(cal, name, math.exp(x))

    # -- prediction --------------------------------------------------------------------------

    def predict(self, knobs: Knobs, workload: Workload, calibration: Calibration) -> Prediction:
        kv = calibration.kv_tokens_at(knobs.gpu_memory_utilization)
        if kv is not None and kv < workload.prompt_p90 + workload.gen_p90:
            return Prediction(
                math.inf,
                math.inf,
                math.inf,
                kv,
                0.0,
                False,
                0.0,
                False,
                f"KV cache of {kv:.0f} tokens cannot hold one long request",
                math.inf,
            )
        pre = self._pre(knobs, calibration)
        ttft, itl, e2e, st = self._latencies(knobs, workload, calibration, pre=pre)
        meets = self._meets(workload, ttft, itl, e2e) and st.stable
        capacity = self._capacity(knobs, workload, calibration, pre)
        reason = "" if meets else ("overloaded" if not st.stable else "SLO missed")
        return Prediction(
            ttft_ms=ttft * 1000.0,
            itl_ms=itl * 1000.0,
            e2e_ms=e2e * 1000.0,
            kv_capacity_tokens=kv,
            preemption_rate=st.preemption_rate,
            feasible=meets,
            capacity_rps=capacity,
            meets_slo=meets,
            reason=reason,
            slo_ratio=slo_ratio(workload.slo, ttft * 1000.0, itl * 1000.0, e2e * 1000.0),
        )

    def _meets(self, w: Workload, ttft: float, itl: float, e2e: float) -> bool:
        for metric, value in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
            t = getattr(w.slo, metric)
            if t is not None and value * 1000.0 > w.safety_margin * t.threshold_ms:
                return False
        return True

    def _capacity(
        self, knobs: Knobs, w: Workload, cal: Calibration, pre: _Pre | None = None
    ) -> float:
        pre = pre or self._pre(knobs, cal)

        def ok(rate: float) -> bool:
            # The rate goes in as an argument: a Workload copy per probe cost a fifth of
            # every decision (docs/scale.md).
            ttft, itl, e2e, st = self._latencies(knobs, w, cal, rate=rate, pre=pre)
            return st.stable and self._meets(w, ttft, itl, e2e)

        lo, hi = 0.0, max(0.5, w.request_rate)
        for _ in range(40):
            if not ok(hi):
                break
            lo, hi = hi, hi * 2.0
        else:
            return hi
        for _ in range(30):
            mid = 0.5 * (lo + hi)
            if ok(mid):
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-3 * max(hi, 1e-6):
                break
        return lo

    # -- internals ---------------------------------------------------------------------------

    def _coeffs(self, cal: Calibration) -> tuple[float, float, float, float]:
        bw, peak = _specs(self.gpu_product)
        kvb = cal.kv_bytes_per_token or _KV_BYTES
        s = cal.step_scale
        return (
            s * _STEP_FIXED_S,
            s * _WEIGHT_BYTES / (bw * _ETA_BW),
            s * kvb / (bw * _ETA_BW),
            s * cal.compute_scale * _FLOP_PER_TOKEN / (peak * _ETA_MFU),
        )

    def _pre(self, knobs: Knobs, cal: Calibration) -> _Pre:
        return _Pre(*self._coeffs(cal), cal.kv_tokens_at(knobs.gpu_memory_utilization))

    def _steady(
        self,
        knobs: Knobs,
        w: Workload,
        cal: Calibration,
        rate: float | None = None,
        pre: _Pre | None = None,
    ) -> _Steady:
        fixed, weights, kv_read, compute, kv_cap = pre or self._pre(knobs, cal)
        lam = max(0.0, w.request_rate if rate is None else rate)
        p_eff = max(1.0, w.prompt_mean * (1.0 - w.prefix_hit_rate))
        g = max(1.0, w.gen_mean)
        ctx = w.prompt_mean + 0.5 * g
        budget = float(knobs.max_num_batched_tokens)
        seqs = float(knobs.max_num_seqs)
        # Bandwidth regime: t = fixed + weights + kv_read*ctx*lam*g*t.
        b1 = kv_read * ctx * lam * g
        # Compute regime: t = fixed + compute*lam*(p_eff+g)*t.
        b2 = compute * lam * (p_eff + g)
        if b1 >= 1.0 or b2 >= 1.0:
            return _UNSTABLE
        t = max((fixed + weights) / (1.0 - b1), fixed / (1.0 - b2))
        running = lam * g * t
        tokens_per_step = lam * (p_eff + g) * t
        kv_need = running * (w.prompt_mean + g)  # full-sequence reservation at admission
        util_tok = tokens_per_step / budget
        util_seq = running / seqs
        util_kv = 0.0 if kv_cap is None or kv_cap <= 0 else kv_need / kv_cap
        util = max(util_tok, util_seq, util_kv)
        stable = util < 1.0
        # Waiting time: the tightest resource as an M/M/c queue (Sakasegawa's approximation).
        if util_tok >= max(util_seq, util_kv):
            servers, service = 1.0, t * (p_eff + g) / budget
        elif util_seq >= util_kv:
            servers, service = seqs, g * t
        else:
            servers = max(1.0, (kv_cap or 1.0) / (w.prompt_mean + g))
            service = g * t
        if stable and util > 0:
            wait = util ** (math.sqrt(2.0 * (servers + 1.0)) - 1.0) / (servers * (1.0 - util))
            wait *= service
        else:
            wait = 0.0 if stable else math.inf
        preempt = 0.0
        if kv_cap is not None and kv_cap > 0:
            peak = running * (w.prompt_mean + g) * 1.3
            if peak > kv_cap:
                preempt = lam * min(1.0, (peak - kv_cap) / peak)
        chunk_room = max(1.0, budget - running)
        # Prompts arriving while one is in prefill share the step's chunk.
        chunk = min(chunk_room, max(1.0, w.prompt_p90 * (1.0 - w.prefix_hit_rate)) * (1 + lam * t))
        steps_per_prefill = math.ceil(p_eff / chunk_room)
        frac = min(1.0, lam * t * steps_per_prefill)
        decode_step = fixed + max(weights + kv_read * running * ctx, compute * running)
        prefill_step = fixed + max(weights + kv_read * running * ctx, compute * (running + chunk))
        return _Steady(
            t, decode_step, prefill_step, running, util, wait, stable, preempt, chunk, frac
        )

    def _latencies(
        self,
        knobs: Knobs,
        w: Workload,
        cal: Calibration,
        percentile_override: float | None = None,
        itl_override: float | None = None,
        rate: float | None = None,
        pre: _Pre | None = None,
    ) -> tuple[float, float, float, _Steady]:
        """(ttft, itl, e2e) in seconds at each metric's SLO percentile, and the steady state
        (at `rate` instead of the workload's when given)."""
        st = self._steady(knobs, w, cal, rate, pre)
        if not st.stable:
            return math.inf, math.inf, math.inf, st
        q_itl = (itl_override or percentile_override or _percentile(w.slo, "itl")) / 100.0
        tail = 1.0 - q_itl
        if st.prefill_steps_frac >= tail:
            itl = st.prefill_step_s
        else:
            itl = st.decode_step_s + (st.prefill_step_s - st.decode_step_s) * (
                st.prefill_steps_frac / max(tail, 1e-9)
            )
        itl = max(itl, st.step_s) if q_itl >= 0.5 else itl
        q_ttft = (percentile_override or _percentile(w.slo, "ttft")) / 100.0
        prompt_q = w.prompt_p90 if q_ttft >= 0.9 else w.prompt_mean
        p_eff_q = max(1.0, prompt_q * (1.0 - w.prefix_hit_rate))
        chunk_room = max(1.0, knobs.max_num_batched_tokens - st.running)
        prefill = math.ceil(p_eff_q / chunk_room) * st.prefill_step_s + st.step_s
        wait_q = st.wait_mean_s * math.log(1.0 / max(1e-9, 1.0 - q_ttft)) if q_ttft > 0.5 else 0.0
        ttft = cal.per_request_overhead_s + wait_q + prefill
        q_e2e = (percentile_override or _percentile(w.slo, "e2e")) / 100.0
        gen_q = w.gen_p90 if q_e2e >= 0.9 else w.gen_mean
        e2e = ttft + max(0.0, gen_q - 1.0) * st.step_s
        return ttft, itl, e2e, st


def _with_scale(cal: Calibration, name: str, value: float) -> Calibration:
    if name == "step_scale":
        return replace(cal, step_scale=value)
    return replace(cal, compute_scale=value)


def slo_ratio(slo: SLO, ttft_ms: float, itl_ms: float, e2e_ms: float) -> float:
    """Worst value/threshold over the SLO's targets (0 when it has none)."""
    worst = 0.0
    for metric, value in (("ttft", ttft_ms), ("itl", itl_ms), ("e2e", e2e_ms)):
        t = getattr(slo, metric)
        if t is not None:
            worst = max(worst, value / t.threshold_ms)
    return worst


def _kv_calibration(
    snapshot: Snapshot, knobs: Knobs, ctx: DeploymentContext, prior: Calibration | None
) -> Calibration:
    """KV facts from vllm:cache_config_info, falling back to what was learned before."""
    base = prior or Calibration()
    info = snapshot.kv_cache
    kv_tokens = info.capacity_tokens()
    gmu = info.gpu_memory_utilization or knobs.gpu_memory_utilization
    mem_gib = ctx.gpu_memory_gib or gpu_memory_gib(ctx.gpu_product)
    bpt = base.kv_bytes_per_token
    if info.kv_cache_memory_bytes and kv_tokens:
        bpt = info.kv_cache_memory_bytes / kv_tokens
    return replace(
        base,
        kv_bytes_per_token=bpt,
        gpu_memory_bytes=mem_gib * GIB if mem_gib else base.gpu_memory_bytes,
        observed_kv_tokens=float(kv_tokens) if kv_tokens else base.observed_kv_tokens,
        observed_gmu=gmu if kv_tokens else base.observed_gmu,
    )


# ----------------------------------------------------------------------------- engine model


@runtime_checkable
class Screened(Protocol):
    """A model too slow to evaluate everywhere: search screens candidates with a cheap one."""

    def screen(self, calibration: Calibration) -> tuple[PerformanceModel, Calibration]: ...


def _sim_gpu(product: str | None) -> str | None:
    """The simulator's catalog name for a GPU product label, or None when it has none."""
    if not product:
        return None
    p = product.upper().replace("_", "-")
    for prefix in ("NVIDIA-", "TESLA-"):
        p = p.removeprefix(prefix)
    if p in GPU_SPECS:
        return p
    if p in GPU_ALIASES:
        return GPU_ALIASES[p]
    if p.startswith("A100"):
        return "A100-40GB" if "40G" in p else "A100-80GB"
    for key in sorted(GPU_SPECS, key=len, reverse=True):
        if p.startswith(key):
            return key
    return None


def _sim_model(name: str) -> bool:
    lower = {k.lower() for k in (*MODEL_CONFIGS, *MODEL_ALIASES)}
    short = {k.split("/")[-1].lower() for k in (*MODEL_CONFIGS, *MODEL_ALIASES)}
    return name.lower() in lower or name.lower() in short


def _lognormal_sigma(mean: float, p90: float) -> float:
    """Sigma of a lognormal with this mean and p90 (p90 = mean * exp(1.2816 s - s^2 / 2))."""
    ratio = max(1.0001, p90 / max(mean, 1.0))
    # Solve s^2/2 - 1.2816 s + ln(ratio) = 0 for the smaller root (the physical branch).
    disc = 1.2816**2 - 2.0 * math.log(ratio)
    if disc <= 0:
        return 1.2816
    return max(0.05, 1.2816 - math.sqrt(disc))


@dataclass(frozen=True)
class _SimResult:
    ttft_ms: float
    itl_ms: float
    e2e_ms: float
    itl_mean_ms: float
    ttft_p50_ms: float
    preemption_rate: float
    kv_tokens: float
    stable: bool


class EngineModel:
    """The simulator's engine as the performance model (how-it-works.md: the engine is the model).

    Calibration runs the observed workload (lengths and rate from the snapshot, lognormal
    shapes fitted to mean and p90) at the observed knobs and adjusts the engine's hidden
    efficiencies until it reproduces the observed mean ITL (bandwidth), ITL tail (compute) and
    median TTFT (per-request overhead). Predictions simulate a short seeded run at the
    candidate knobs; capacity is bisected on the arrival rate with a few more runs. Results are
    cached, and search screens candidates with the analytic model first (`screen`), so the
    engine runs only for the few that matter. Models or GPUs missing from the simulator's
    catalog fall back to the analytic model.
    """

    def __init__(
        self,
        num_requests: int = 300,
        seed: int = 7,
        capacity_steps: int = 3,
        capacity_requests: int = 100,
    ) -> None:
        self.num_requests = num_requests
        self.capacity_requests = capacity_requests
        self.seed = seed
        self.capacity_steps = capacity_steps
        self.analytic = AnalyticModel()
        self.ctx: DeploymentContext | None = None
        self._cache: dict[tuple[object, ...], _SimResult | None] = {}

    # -- protocol ------------------------------------------------------------------------

    def screen(self, calibration: Calibration) -> tuple[PerformanceModel, Calibration]:
        return self.analytic, calibration

    def calibrate(
        self,
        snapshot: Snapshot,
        knobs: Knobs,
        ctx: DeploymentContext,
        workload: Workload,
        prior: Calibration | None,
    ) -> Calibration:
        self.ctx = ctx
        cal = self.analytic.calibrate(snapshot, knobs, ctx, workload, prior)
        if not self._usable():
            return cal
        mean_itl = snapshot.itl.mean_ms or snapshot.itl.p50_ms
        if mean_itl is None or workload.request_rate <= 0:
            return cal
        tail_itl = snapshot.itl.at(_percentile(workload.slo, "itl"))
        ttft50 = snapshot.ttft.p50_ms
        prior_extra = dict(prior.extra) if prior is not None else {}
        be = prior_extra.get("bandwidth_efficiency", 1.0)
        ce = prior_extra.get("compute_efficiency", 1.0)
        ov = prior_extra.get("per_request_overhead_s", 0.0)
        # Fixed-point iteration: decode steps scale with 1/bandwidth efficiency, the extra
        # length of prefill-carrying steps with 1/compute efficiency.
        for _ in range(3):
            r = self._simulate(knobs, workload, be, ce, ov)
            if r is None or not r.stable:
                be, ce = be * 1.5, ce * 1.5  # the engine cannot even keep up: it is faster
                continue
            # Damped (the two interact: slower prefill also lengthens the mean step).
            be = _clip(be * (r.itl_mean_ms / mean_itl) ** 0.7, 0.05, 3.0)
            # Compute efficiency sets how much longer prefill-carrying steps are: the ITL tail
            # (an SLO metric, so matched first); what remains of TTFT is fitted below.
            if tail_itl is not None and tail_itl > 0:
                ce = _clip(ce * (r.itl_ms / tail_itl) ** 0.5, 0.05, 3.0)
            elif ttft50 is not None and ttft50 > 0:
                ce = _clip(ce * (r.ttft_p50_ms / ttft50) ** 0.5, 0.05, 3.0)
        # What the engine cannot explain of the median TTFT is API-server time, which vLLM
        # spends outside the engine's steps (Reality's overhead would lengthen steps instead,
        # so it is only used for what is small enough to be step CPU time).
        r = self._simulate(knobs, workload, be, ce, ov)
        api_s = 0.0
        if r is not None and ttft50 is not None:
            api_s = max(0.0, (ttft50 - r.ttft_p50_ms) / 1000.0)
        extra = {
            "bandwidth_efficiency": be,
            "compute_efficiency": ce,
            "per_request_overhead_s": ov,
            "api_overhead_s": api_s,
        }
        return replace(cal, extra=extra)

    def predict(self, knobs: Knobs, workload: Workload, calibration: Calibration) -> Prediction:
        if not self._usable() or "bandwidth_efficiency" not in calibration.extra:
            return self.analytic.predict(knobs, workload, calibration)
        x = calibration.extra
        be, ce, ov = (
            x["bandwidth_efficiency"],
            x["compute_efficiency"],
            x.get("per_request_overhead_s", 0.0),
        )
        r = self._simulate(knobs, workload, be, ce, ov)
        api_ms = 1000.0 * x.get("api_overhead_s", 0.0)
        if r is not None:
            r = replace(r, ttft_ms=r.ttft_ms + api_ms, e2e_ms=r.e2e_ms + api_ms)
        if r is None:
            return Prediction(
                math.inf,
                math.inf,
                math.inf,
                0.0,
                0.0,
                False,
                0.0,
                False,
                "cannot start: KV cache does not fit",
                math.inf,
            )
        meets = r.stable and self.analytic._meets(
            workload, r.ttft_ms / 1000, r.itl_ms / 1000, r.e2e_ms / 1000
        )
        if meets:
            capacity = self._capacity(knobs, workload, be, ce, ov, meets, api_ms)
        else:
            # Below the current rate; a rough figure (rate over the SLO overshoot) is enough for
            # the reason text, and saves a bisection nobody ranks by.
            ratio = slo_ratio(workload.slo, r.ttft_ms, r.itl_ms, r.e2e_ms) / workload.safety_margin
            capacity = workload.request_rate / max(1.0, ratio) if r.stable else 0.0
        return Prediction(
            ttft_ms=r.ttft_ms,
            itl_ms=r.itl_ms,
            e2e_ms=r.e2e_ms,
            kv_capacity_tokens=r.kv_tokens,
            preemption_rate=r.preemption_rate,
            feasible=meets,
            capacity_rps=capacity,
            meets_slo=meets,
            reason="" if meets else ("overloaded" if not r.stable else "SLO missed"),
            slo_ratio=slo_ratio(workload.slo, r.ttft_ms, r.itl_ms, r.e2e_ms),
        )

    # -- internals ---------------------------------------------------------------------------

    def _usable(self) -> bool:
        return (
            self.ctx is not None
            and _sim_gpu(self.ctx.gpu_product) is not None
            and _sim_model(self.ctx.model)
        )

    def _capacity(
        self,
        knobs: Knobs,
        w: Workload,
        be: float,
        ce: float,
        ov: float,
        meets_now: bool,
        api_ms: float,
    ) -> float:
        def ok(rate: float) -> bool:
            ww = w.at_rate(rate)
            r = self._simulate(knobs, ww, be, ce, ov, self.capacity_requests)
            return (
                r is not None
                and r.stable
                and self.analytic._meets(
                    ww, (r.ttft_ms + api_ms) / 1000, r.itl_ms / 1000, (r.e2e_ms + api_ms) / 1000
                )
            )

        rate = max(w.request_rate, 0.05)
        if meets_now:
            lo, hi = rate, rate * 2.0
            for _ in range(3):
                if not ok(hi):
                    break
                lo, hi = hi, hi * 2.0
            else:
                return lo
        else:
            lo, hi = 0.0, rate
            for _ in range(3):
                if ok(hi / 2.0):
                    lo = hi / 2.0
                    break
                hi /= 2.0
            else:
                return 0.0
        for _ in range(self.capacity_steps):
            mid = 0.5 * (lo + hi)
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _simulate(
        self, knobs: Knobs, w: Workload, be: float, ce: float, ov: float, n: int | None = None
    ) -> _SimResult | None:
        n = n or self.num_requests
        ctx = self.ctx
        assert ctx is not None
        key = (
            knobs,
            w.request_rate,
            w.prompt_mean,
            w.prompt_p90,
            w.gen_mean,
            w.gen_p90,
            w.prefix_hit_rate,
            tuple(w.slo.targets()),
            round(be, 6),
            round(ce, 6),
            round(ov, 6),
            ctx,
            n,
        )
        if key in self._cache:
            return self._cache[key]
        result = self._run(knobs, w, be, ce, ov, ctx, n)
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[key] = result
        return result

    def _run(
        self,
        knobs: Knobs,
        w: Workload,
        be: float,
        ce: float,
        ov: float,
        ctx: DeploymentContext,
        n: int,
    ) -> _SimResult | None:

        gpu = _sim_gpu(ctx.gpu_product)
        assert gpu is not None
        mml = ctx.max_model_len
        config = EngineConfig(
            model=ctx.model,
            gpu=gpu,
            tensor_parallel_size=ctx.tensor_parallel_size,
            max_num_seqs=knobs.max_num_seqs,
            max_num_batched_tokens=knobs.max_num_batched_tokens,
            gpu_memory_utilization=knobs.gpu_memory_utilization,
            max_model_len=mml,
            enable_prefix_caching=ctx.enable_prefix_caching,
            kv_cache_dtype=ctx.kv_cache_dtype,
        )
        reality = Reality(bandwidth_efficiency=be, compute_efficiency=ce, per_request_overhead_s=ov)
        try:
            engine = Engine(config, reality, seed=self.seed)
        except (StartupError, ValueError):
            return None
        limit = engine.max_model_len
        high_p = max(2, limit - 2)
        prompt = LengthDist(
            "lognormal", w.prompt_mean, _lognormal_sigma(w.prompt_mean, w.prompt_p90), 1, high_p
        )
        output = LengthDist(
            "lognormal", w.gen_mean, _lognormal_sigma(w.gen_mean, w.gen_p90), 1, max(1, limit // 2)
        )
        rate = max(w.request_rate, 1e-3)
        spec = WorkloadSpec(
            prompt=prompt,
            output=output,
            duration=n / rate,
            seed=self.seed,
            prefix_ratio=min(0.95, w.prefix_hit_rate),
            prefix_groups=4,
            max_requests=n,
        ).with_rate(rate)
        requests = [r for r in spec.generate() if r.prompt_len + r.max_tokens <= limit]
        if not requests:
            return None
        records = engine.run(requests)
        done = [r for r in records if r.finish_reason not in ("abort", "error")]
        if not done:
            return None
        # The first fifth of the run fills an empty engine; measure the rest (steady state).
        t_warm = requests[len(requests) // 5].arrival_time
        done = [r for r in done if r.arrival_time >= t_warm] or done
        ttfts = np.asarray([t for r in done if (t := r.ttft) is not None]) * 1000.0
        itls = np.concatenate([np.asarray(r.itl) for r in done] or [np.zeros(1)]) * 1000.0
        e2es = np.asarray([r.e2e for r in done]) * 1000.0
        q = {m: _percentile(w.slo, m) for m in ("ttft", "itl", "e2e")}
        span = max(r.finish_time for r in done) - min(r.arrival_time for r in done)
        arrivals = max(r.arrival_time for r in done) - min(r.arrival_time for r in done)
        # A run that needs far longer to drain than its arrivals took is overloaded.
        stable = span <= arrivals * 1.5 + 60.0 * max(1.0, w.gen_mean / 100.0)
        return _SimResult(
            ttft_ms=float(np.percentile(ttfts, q["ttft"])) if ttfts.size else math.inf,
            itl_ms=float(np.percentile(itls, q["itl"])) if itls.size else math.inf,
            e2e_ms=float(np.percentile(e2es, q["e2e"])),
            itl_mean_ms=float(itls.mean()) if itls.size else math.inf,
            ttft_p50_ms=float(np.percentile(ttfts, 50)) if ttfts.size else math.inf,
            preemption_rate=sum(r.num_preemptions for r in done) / max(span, 1e-9),
            kv_tokens=float(engine.kv.kv_cache_size_tokens),
            stable=stable,
        )


def _clip(v: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, v))
