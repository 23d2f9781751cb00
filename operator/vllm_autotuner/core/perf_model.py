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

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache, partial
from typing import Protocol, runtime_checkable

import numpy as np

from vllm_autotuner.core.knob_defaults import GIB, gpu_memory_gib
from vllm_autotuner.core.physics import (
    FALLBACK_MODEL,
    DeploymentShape,
    Physics,
    StepCurveFn,
    lognormal_sigma,
    sim_gpu_name,
)
from vllm_autotuner.core.snapshot import (
    LatencySummary,
    Snapshot,
    arrival_cv2,
    cdf_points,
    length_spread,
    lognormal_misfit,
)
from vllm_autotuner.core.steady_state import (
    Costs,
    Knobs3,
    SteadyState,
    StepCurve,
    Traffic,
    clamp_cv2,
    steady_state,
)
from vllm_autotuner.core.tuning_types import SLO, DeploymentContext, Knobs
from vllm_sim.catalog import MODEL_ALIASES, MODEL_CONFIGS
from vllm_sim.engine import Engine
from vllm_sim.steptime import CALIBRATION as STEP_CALIBRATION
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
    arrival_cv2: float = 1.0  # burstiness: cv2 of the gaps between arrivals (1: Poisson)

    @classmethod
    def from_snapshot(cls, s: Snapshot, slo: SLO, safety_margin: float) -> Workload:
        """Lengths and rate as observed. The p90s come from a log-normal fitted to the length
        histograms (their buckets are too coarse to interpolate in), else from the histogram,
        else 2x the mean (a long-tailed guess)."""
        pm = s.prompt_len.mean or s.prompt_len.p50 or 512.0
        gm = s.generation_len.mean or s.generation_len.p50 or 128.0
        return cls(
            request_rate=s.per_pod_rate(),
            prompt_mean=pm,
            prompt_p90=s.prompt_len.lognormal_p90() or s.prompt_len.p90 or 2.0 * pm,
            gen_mean=gm,
            gen_p90=s.generation_len.lognormal_p90() or s.generation_len.p90 or 2.0 * gm,
            prefix_hit_rate=min(0.99, max(0.0, s.prefix_cache_hit_rate or 0.0)),
            slo=slo,
            safety_margin=safety_margin,
            arrival_cv2=arrival_cv2(s),
        )

    def at_rate(self, rate: float) -> Workload:
        return replace(self, request_rate=rate)


@dataclass(frozen=True)
class Calibration:
    """Fitted parameters of a model for one deployment (persisted in status.tuning).

    `bandwidth` and `compute` multiply the prior's memory-bandwidth and compute efficiencies
    (1.0 = the simulator's calibrated roofline for this model and GPU); `admit_s` is the CPU
    time a step spends per request it admits; `api_s` is time a request spends outside the
    engine before its first token (HTTP, tokenisation); `jitter` the relative spread of step
    times around the roofline (log-normal sigma); `kv_scale` is the observed KV cache
    over the prior's at the observed knobs. `fit_error` is the worst |log| residual of the
    fit (how well the model explains the window it was fitted on). The KV byte fields let
    capacity follow gpu_memory_utilization where the physics is not exact.
    """

    bandwidth: float = 1.0
    compute: float = 1.0
    admit_s: float = 0.0
    api_s: float = 0.0
    jitter: float = 0.05
    kv_scale: float = 1.0
    fit_error: float | None = None
    kv_bytes_per_token: float | None = None
    gpu_memory_bytes: float | None = None
    observed_kv_tokens: float | None = None
    observed_gmu: float | None = None
    fitted: bool = False
    # The knobs the fit ran at (tokens, sequences), and the centre its prior pulled towards
    # (None: the roofline; else the fit at the knobs before, see `_fit_centre`).
    fitted_budget: float | None = None
    fitted_seqs: float | None = None
    prior_bandwidth: float | None = None
    prior_compute: float | None = None
    prior_admit_s: float | None = None
    prior_jitter: float | None = None
    # The log-normal sigma of prompt lengths that the window's prefill times show (None: the
    # one the length histogram gives; see `_fit_prompt_sigma`).
    prompt_sigma: float | None = None
    # The same window fitted again with the admission cost at ADMIT_BOUND_S (None: the
    # window rules that cost out, or this fit's own is already as high): the engine the
    # window cannot tell from this one (see `at_admission_bound`).
    bound_bandwidth: float | None = None
    bound_compute: float | None = None
    bound_jitter: float | None = None
    bound_api_s: float | None = None
    # Not hashed (a dict), still compared: a calibration is a key of the prediction memo.
    extra: Mapping[str, float] = field(default_factory=dict, hash=False)

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
            bandwidth=g("bandwidth") or 1.0,
            compute=g("compute") or 1.0,
            admit_s=g("admit_s") or 0.0,
            api_s=g("api_s") or 0.0,
            jitter=g("jitter") or 0.05,
            kv_scale=g("kv_scale") or 1.0,
            fit_error=g("fit_error"),
            kv_bytes_per_token=g("kv_bytes_per_token"),
            gpu_memory_bytes=g("gpu_memory_bytes"),
            observed_kv_tokens=g("observed_kv_tokens"),
            observed_gmu=g("observed_gmu"),
            fitted=bool(d.get("fitted", 0.0)),
            fitted_budget=g("fitted_budget"),
            fitted_seqs=g("fitted_seqs"),
            prior_bandwidth=g("prior_bandwidth"),
            prior_compute=g("prior_compute"),
            prior_admit_s=g("prior_admit_s"),
            prior_jitter=g("prior_jitter"),
            prompt_sigma=g("prompt_sigma"),
            bound_bandwidth=g("bound_bandwidth"),
            bound_compute=g("bound_compute"),
            bound_jitter=g("bound_jitter"),
            bound_api_s=g("bound_api_s"),
            extra={k[2:]: float(v) for k, v in d.items() if k.startswith("x_")},
        )

    def prior_centre(self) -> Calibration | None:
        """The centre the fit's prior pulled towards (None: the roofline)."""
        if None in (self.prior_bandwidth, self.prior_compute, self.prior_admit_s,
                    self.prior_jitter):  # fmt: skip
            return None
        return Calibration(
            bandwidth=self.prior_bandwidth or 1.0,
            compute=self.prior_compute or 1.0,
            admit_s=self.prior_admit_s or 0.0,
            jitter=self.prior_jitter or _PRIOR_JITTER,
        )

    def at_admission_bound(self) -> Calibration | None:
        """This calibration with the step-time parameters of the fit at ADMIT_BOUND_S (None
        when there is none): a decision must hold under both (decide's robust gain)."""
        if self.bound_bandwidth is None or self.bound_compute is None or self.bound_jitter is None:
            return None
        at = self.with_step_times(
            self.bound_bandwidth, self.bound_compute, ADMIT_BOUND_S, self.bound_jitter
        )
        api_s = self.api_s if self.bound_api_s is None else self.bound_api_s
        return replace(at, api_s=api_s).without_bound()

    def with_step_times(
        self, bandwidth: float, compute: float, admit_s: float, jitter: float
    ) -> Calibration:
        """This calibration with other step-time parameters (its KV, traffic and API fits
        kept)."""
        return replace(self, bandwidth=bandwidth, compute=compute, admit_s=admit_s, jitter=jitter)

    def without_bound(self) -> Calibration:
        """This calibration without the fit at the admission-cost bound."""
        return replace(
            self, bound_bandwidth=None, bound_compute=None, bound_jitter=None, bound_api_s=None
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

    def latency_ms(self, metric: str) -> float:
        """The predicted latency of an SLO metric ("ttft", "itl" or "e2e")."""
        return {"ttft": self.ttft_ms, "itl": self.itl_ms, "e2e": self.e2e_ms}[metric]


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

    def predict(
        self, knobs: Knobs, workload: Workload, calibration: Calibration, capacity: bool = True
    ) -> Prediction:
        """`capacity=False` skips the capacity search when the knobs miss the SLO at the
        workload's rate (their capacity is then reported as 0): a search ranks such
        candidates by how far they miss, never by capacity."""
        ...


# --------------------------------------------------------------------------- analytic model


def _percentile(slo: SLO, metric: str) -> float:
    t = getattr(slo, metric)
    return DEFAULT_PERCENTILE if t is None else float(t.percentile)


def shape_of(ctx: DeploymentContext) -> DeploymentShape:
    return DeploymentShape(
        model=ctx.model,
        gpu_product=ctx.gpu_product,
        tensor_parallel_size=ctx.tensor_parallel_size,
        max_model_len=ctx.max_model_len,
        kv_cache_dtype=ctx.kv_cache_dtype,
        enable_prefix_caching=ctx.enable_prefix_caching,
    )


# How strongly the prior holds a parameter (a residual of this weight per unit of distance).
_PRIOR_WEIGHT = 0.05
# Weight of a histogram bucket's cumulative fraction against the log of the mean.
_SHAPE_WEIGHT = 2.0
# Weight of the log of the mass above a bucket bound, and the smallest mass it tells apart.
_TAIL_WEIGHT = 0.2
_TAIL_FLOOR = 0.002


def _itl_shape(itl: LatencySummary) -> list[tuple[float, float]]:
    """(bound in s, observed fraction at or under it) for the informative bucket bounds, up to
    and including the first that holds (nearly) every sample: the tail a p99 target is judged
    on, which the fit must not fill with steps the window never showed."""
    total = itl.count
    if total <= 0:
        return []
    out: list[tuple[float, float]] = []
    for bound, cum in itl.buckets:
        frac = cum / total
        if not math.isfinite(bound) or frac <= 0.01:
            continue
        out.append((bound / 1000.0, frac))
        if frac >= 0.995:
            break
    return out


def _shape_residuals(
    below: Callable[[float], float], shape: Sequence[tuple[float, float]]
) -> list[float]:
    """How far the model's ITL distribution is from the window's at each bound: the fraction
    under it, and the mass above it on a log scale (a p99 lives in the last percent, which a
    difference of fractions barely sees: a fit that put 5 % of steps above a bound the window
    never crossed cost it 0.01 in squared error, and cut the predicted capacity 10-fold)."""
    out = []
    for bound, frac in shape:
        model = below(bound)
        out.append(_SHAPE_WEIGHT * (model - frac))
        above = math.log(max(1.0 - model, _TAIL_FLOOR)) - math.log(max(1.0 - frac, _TAIL_FLOOR))
        out.append(_TAIL_WEIGHT * above)
    return out


class AnalyticModel:
    """vLLM's V1 scheduler in steady state on the deployment's physics (core/steady_state.py).

    Calibration fits the memory and compute efficiencies and the per-admission cost so that the
    model reproduces the window's mean and tail inter-token latency **at the batch the window
    actually ran** (the running-requests gauge), not at the batch Little's law would give for
    the observed throughput: both are engine physics, so a window in overload calibrates as
    well as a quiet one, and queueing is predicted rather than fitted. Capacity is the highest
    per-pod rate whose predicted SLO percentiles meet every target with the safety margin.
    """

    def __init__(self, gpu_product: str | None = None) -> None:
        self.gpu_product = gpu_product
        self.physics: Physics | None = None

    def bind(self, ctx: DeploymentContext) -> Physics:
        """The physics of this deployment (the model is bound to one deployment at a time)."""
        shape = shape_of(ctx)
        if self.physics is None or self.physics.shape != shape:
            self.physics = Physics.of(shape)
        self.gpu_product = ctx.gpu_product
        return self.physics

    def _phys(self) -> Physics:
        if self.physics is None:
            self.physics = Physics.of(
                DeploymentShape(model=FALLBACK_MODEL, gpu_product=self.gpu_product)
            )
        return self.physics

    # -- calibration -------------------------------------------------------------------------

    def calibrate(
        self,
        snapshot: Snapshot,
        knobs: Knobs,
        ctx: DeploymentContext,
        workload: Workload,
        prior: Calibration | None,
    ) -> Calibration:
        phys = self.bind(ctx)
        cal = replace(_kv_calibration(snapshot, knobs, ctx, prior, phys), fitted=False)
        kv = self._kv(knobs, cal)
        centre = _fit_centre(prior, knobs)
        problem = self._problem(snapshot, knobs, workload, kv, centre)
        if problem is None:
            return cal
        x, fit_error = _fit_step_times(problem)
        fit = replace(
            _with_params(cal, x),
            fitted=True,
            fit_error=fit_error,
            fitted_budget=float(knobs.max_num_batched_tokens),
            fitted_seqs=float(knobs.max_num_seqs),
            prior_bandwidth=None if centre is None else centre.bandwidth,
            prior_compute=None if centre is None else centre.compute,
            prior_admit_s=None if centre is None else centre.admit_s,
            prior_jitter=None if centre is None else centre.jitter,
        )
        fit = _fit_prompt_sigma(fit, self._phys().shape, snapshot, knobs, workload, kv)
        fit = self._fit_api(fit, snapshot, knobs, workload, kv, snapshot.running_mean)
        return self._with_bound(fit, problem, x, snapshot, knobs, workload, kv)

    def _with_bound(
        self,
        fit: Calibration,
        problem: FitProblem,
        x: Sequence[float],
        snapshot: Snapshot,
        knobs: Knobs,
        workload: Workload,
        kv: float | None,
    ) -> Calibration:
        """`fit` with the window's fit at the admission-cost bound (`_fit_at_admission`),
        its API shift fitted again; `fit` unchanged when the window rules the bound out."""
        y = _fit_at_admission(problem, tuple(x))
        if y is None:
            return fit
        alt = self._fit_api(
            _with_params(fit, y), snapshot, knobs, workload, kv, snapshot.running_mean
        )
        return replace(
            fit,
            bound_bandwidth=alt.bandwidth,
            bound_compute=alt.compute,
            bound_jitter=alt.jitter,
            bound_api_s=alt.api_s,
        )

    def _problem(
        self,
        snapshot: Snapshot,
        knobs: Knobs,
        workload: Workload,
        kv: float | None,
        centre: Calibration | None,
    ) -> FitProblem | None:
        """What one window tells the step-time fit (None when it has no inter-token latency).

        What the window showed of the step times: the exact mean inter-token latency, and the
        histogram's cumulative fractions at its bucket bounds (never percentiles interpolated
        inside a wide bucket). The mean step, counted: a busy engine runs 1/steps_per_s per
        step. Busy enough when requests are always running (the gauge's mean well above one).
        """
        mean_itl = snapshot.itl.mean_ms or snapshot.itl.p50_ms
        if mean_itl is None or workload.request_rate <= 0:
            return None
        running = snapshot.running_mean
        step_target = None
        if snapshot.steps_per_s and (running or 0.0) >= 4.0:
            step_target = -math.log(snapshot.steps_per_s)
        prefill = snapshot.prefill_time
        prefill_target = None
        if prefill.mean_ms and prefill.count >= PREFILL_MIN_COUNT:
            prefill_target = math.log(prefill.mean_ms / 1000.0)
        return FitProblem(
            self._phys().shape,
            _traffic(workload, workload.request_rate),
            Knobs3(knobs.max_num_batched_tokens, knobs.max_num_seqs, kv),
            running,
            math.log(mean_itl / 1000.0),
            step_target,
            tuple(_itl_shape(snapshot.itl)),
            None if centre is None else tuple(_params(centre)),
            prefill_target,
        )

    def _fit_api(
        self,
        cal: Calibration,
        snapshot: Snapshot,
        knobs: Knobs,
        workload: Workload,
        kv: float | None,
        running: float | None,
    ) -> Calibration:
        """What the engine cannot explain of the first tokens, in a window without a queue:
        the shift of the model's TTFTs that best matches the histogram's cumulative fractions
        at its own bounds (`_api_shift`), or, with every first token in one bucket, the
        median's distance."""
        ttft = snapshot.ttft.p50_ms
        if ttft is None or (snapshot.waiting_mean or 0.0) > 1.0:
            return cal
        st = steady_state(
            _traffic(workload, workload.request_rate, cal),
            Knobs3(knobs.max_num_batched_tokens, knobs.max_num_seqs, kv),
            self._curve_at(cal),
            _costs(replace(cal, api_s=0.0)),
            running=running,
        )
        if not st.stable:
            return cal
        points = [(b / 1000.0, f) for b, f in cdf_points(snapshot.ttft.buckets)]
        if points:
            return replace(cal, api_s=_api_shift(st.ttft, points))
        return replace(cal, api_s=min(API_MAX_S, max(0.0, ttft / 1000.0 - st.ttft(0.5))))

    # -- prediction --------------------------------------------------------------------------

    def predict(
        self, knobs: Knobs, workload: Workload, calibration: Calibration, capacity: bool = True
    ) -> Prediction:
        """A pure function of its arguments and the deployment's physics, remembered
        (`_prediction`): an unchanged window predicts the applied knobs again every
        reconcile, and a capacity is a bisection of ~10 steady states."""
        return _prediction(self._phys(), knobs, workload, calibration, capacity)

    def _predict(
        self, knobs: Knobs, workload: Workload, calibration: Calibration, capacity: bool
    ) -> Prediction:
        kv = self._kv(knobs, calibration)
        if self._starts(knobs) is False:
            return _cannot(kv, "vLLM would not start with these knobs (KV cache does not fit)")
        if kv is not None and kv < workload.prompt_p90 + workload.gen_p90:
            return _cannot(kv, f"KV cache of {kv:.0f} tokens cannot hold one long request")
        lat = self._latencies(knobs, workload, calibration, workload.request_rate, kv)
        ttft, itl, e2e, st = lat
        meets = st.stable and self._meets(workload, ttft, itl, e2e)
        # Capacity is at the SLO's own thresholds (what people read and benchmarks check);
        # the safety margin applies to whether a candidate is predicted to meet the SLO now.
        raw = replace(workload, safety_margin=1.0)
        meets_raw = st.stable and self._meets(raw, ttft, itl, e2e)
        wanted = capacity or meets
        cap = self._capacity(knobs, raw, calibration, kv, meets_raw) if wanted else 0.0
        reason = "" if meets else ("overloaded: " + st.why if not st.stable else "SLO missed")
        return Prediction(
            ttft_ms=ttft * 1000.0,
            itl_ms=itl * 1000.0,
            e2e_ms=e2e * 1000.0,
            kv_capacity_tokens=kv,
            preemption_rate=0.0,
            feasible=meets,
            capacity_rps=cap,
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
        self, knobs: Knobs, w: Workload, cal: Calibration, kv: float | None, meets_now: bool
    ) -> float:
        def ok(rate: float) -> bool:
            st = self._steady(knobs, w, cal, rate, kv)
            if not st.stable:
                return False
            # The inter-token latency first: where it misses, the first tokens' quantiles
            # (a longer sample path at low rates, steady_state.TAIL_PATH_ARRIVALS) are not
            # needed.
            if not self._meets(w, 0.0, st.itl(_percentile(w.slo, "itl") / 100.0), 0.0):
                return False
            ttft, itl, e2e = _quantiles(w, st)
            return self._meets(w, ttft, itl, e2e)

        rate = max(w.request_rate, 0.05)
        if meets_now:
            lo, hi = rate, rate * 1.5
            while ok(hi):
                lo, hi = hi, hi * 1.5
                if hi > 1e5:
                    return lo
        else:
            lo, hi = rate / 1.5, rate
            while not ok(lo):
                lo, hi = lo / 1.5, lo
                if lo < 1e-3:
                    return 0.0
        while hi - lo > 0.01 * lo:
            mid = math.sqrt(lo * hi)
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo

    # -- internals ---------------------------------------------------------------------------

    def _starts(self, knobs: Knobs) -> bool | None:
        phys = self._phys()
        if not phys.exact:
            return None
        kv = phys.kv_tokens(
            knobs.max_num_batched_tokens, knobs.max_num_seqs, knobs.gpu_memory_utilization
        )
        return kv is not None

    def _kv(self, knobs: Knobs, cal: Calibration) -> float | None:
        phys = self._phys()
        if phys.exact:
            kv = phys.kv_tokens(
                knobs.max_num_batched_tokens, knobs.max_num_seqs, knobs.gpu_memory_utilization
            )
            return None if kv is None else kv * cal.kv_scale
        return cal.kv_tokens_at(knobs.gpu_memory_utilization)

    def _curve_at(self, cal: Calibration) -> StepCurve:
        return _curve(self._phys().shape, cal)

    def _steady(
        self, knobs: Knobs, w: Workload, cal: Calibration, rate: float, kv: float | None
    ) -> SteadyState:
        return steady_state(
            _traffic(w, rate, cal),
            Knobs3(knobs.max_num_batched_tokens, knobs.max_num_seqs, kv),
            self._curve_at(cal),
            _costs(cal),
        )

    def _latencies(
        self, knobs: Knobs, w: Workload, cal: Calibration, rate: float, kv: float | None
    ) -> tuple[float, float, float, SteadyState]:
        """(ttft, itl, e2e) in seconds at each metric's SLO percentile, and the steady state."""
        st = self._steady(knobs, w, cal, rate, kv)
        if not st.stable:
            return math.inf, math.inf, math.inf, st
        return (*_quantiles(w, st), st)


def _quantiles(w: Workload, st: SteadyState) -> tuple[float, float, float]:
    """(ttft, itl, e2e) of a stable steady state, in seconds, at each metric's SLO
    percentile (p95 where the SLO has no target)."""
    ttft = st.ttft(_percentile(w.slo, "ttft") / 100.0)
    q_e2e = _percentile(w.slo, "e2e") / 100.0
    e2e = st.ttft(0.5) + max(0.0, st.gen_steps_p(q_e2e) - 1.0) * st.step_mean_s
    return ttft, st.itl(_percentile(w.slo, "itl") / 100.0), max(e2e, ttft)


# Predictions, shared by every deployment's model: an idle reconcile predicts the applied
# knobs on an unchanged calibration (bench.decide_cost "again": 11 steady states of 12),
# twice once the recent windows' mean spans a window (this window's fit and the mean,
# decide._fits). About 0.5 KiB an entry. At 2,048 entries 1,000 idle deployments' 2,000
# predictions no longer stayed cached: bench.scale's idle reconcile p50/p99 went from
# 9/915 ms to 19/1,644 ms.
PREDICT_CACHE = 4096


@lru_cache(maxsize=PREDICT_CACHE)
def _prediction(
    phys: Physics, knobs: Knobs, workload: Workload, calibration: Calibration, capacity: bool
) -> Prediction:
    model = AnalyticModel(phys.shape.gpu_product)
    model.physics = phys
    return model._predict(knobs, workload, calibration, capacity)


# Step-time curves, shared by every deployment's model and bounded in number: one operator
# process holds at most this many (about 1.5 KiB each), whatever the number of deployments.
# A per-model cache of 2,048 grew to ~430 MiB resident at 1,000 deployments (bench.scale):
# each calibration's iterates leave curves of their own. 1,024 hold one decision's curves
# (~500 in a calibration, ~150 in a search); 4,096 held no more hits at scale (a thousand
# deployments cycle through far more) and cost 5 MiB more (bench.decide_cost: same times).
CURVE_CACHE = 1024


@lru_cache(maxsize=CURVE_CACHE)
def _shared_curve(
    shape: DeploymentShape, bandwidth: float, compute: float, running: float, ctx: float
) -> StepCurveFn:
    """The step curve on rounded inputs, so a prediction never depends on what was cached."""
    return Physics.of(shape).step_curve(bandwidth, compute, running, ctx)


@dataclass(frozen=True)
class _SharedCurves:
    """The step curves of one physics and efficiency pair (a StepCurve): equal by value, so
    steady_state's shared evaluations (one search) recognise the same curves again."""

    shape: DeploymentShape
    bandwidth: float
    compute: float

    def __call__(self, running: float, ctx_per_seq: float) -> StepCurveFn:
        return _shared_curve(
            self.shape, self.bandwidth, self.compute, _grid(running), _grid(ctx_per_seq)
        )


def _curve(shape: DeploymentShape, cal: Calibration) -> StepCurve:
    return _SharedCurves(shape, round(cal.bandwidth, 4), round(cal.compute, 4))


def _grid(value: float) -> float:
    """`value` rounded to a 2 % logarithmic grid (cache keys for step-time curves)."""
    if value <= 1.0:
        return 1.0
    return round(math.exp(round(math.log(value) / 0.02) * 0.02), 3)


def _traffic(w: Workload, rate: float, cal: Calibration | None = None) -> Traffic:
    sigma = None if cal is None else cal.prompt_sigma
    return Traffic(
        rate=rate,
        prompt_mean=w.prompt_mean,
        prompt_sigma=lognormal_sigma(w.prompt_mean, w.prompt_p90) if sigma is None else sigma,
        gen_mean=w.gen_mean,
        gen_p90=w.gen_p90,
        prefix_hit_rate=w.prefix_hit_rate,
        arrival_cv2=w.arrival_cv2,
    )


def _costs(cal: Calibration) -> Costs:
    return Costs(
        admit_s=cal.admit_s,
        frontend_s=STEP_CALIBRATION.c_frontend_s,
        api_s=cal.api_s,
        jitter=cal.jitter,
    )


def _cannot(kv: float | None, why: str) -> Prediction:
    inf = math.inf
    return Prediction(inf, inf, inf, kv, 0.0, False, 0.0, False, why, inf)


# The fitted parameters, as the least-squares problem sees them: log efficiencies, the
# admission cost in ms and the log of the step-time jitter; their bounds and priors.
_LO = (math.log(0.2), math.log(0.2), 0.0, math.log(0.005))
_HI = (math.log(5.0), math.log(5.0), 20.0, math.log(0.3))
_PRIOR_JITTER = 0.05


def _params(cal: Calibration) -> list[float]:
    x = [math.log(cal.bandwidth), math.log(cal.compute), cal.admit_s * 1000.0, math.log(cal.jitter)]
    return [min(max(v, a + 1e-6), b - 1e-6) for v, a, b in zip(x, _LO, _HI, strict=True)]


def _with_params(cal: Calibration, x: Sequence[float]) -> Calibration:
    return cal.with_step_times(math.exp(x[0]), math.exp(x[1]), x[2] / 1000.0, math.exp(x[3]))


# Pull towards the fit at the knobs before (log efficiencies and jitter, and the admission
# cost per 2 ms). bench/model_fit's chat-8b-h100 windows: at 512/512 the window's steps all
# carry ~512 tokens and cannot tell compute from bandwidth and admission cost; fitted alone it
# put 1024/256 at +47 % and 896/512 at +32 % of the truth, with the fit at 8192/1024 as its
# prior's centre +4 % and +5 % (median 4 %). Weights 0.1 to 0.3 gave the same.
_CENTRE_WEIGHT = 0.1


def _fit_centre(prior: Calibration | None, knobs: Knobs) -> Calibration | None:
    """Where the fit's prior is centred: the roofline (None) until a fit exists; the last
    fit's own parameters when it ran at other knobs (what that window measured of the engine
    is the best prior for a window that cannot tell every parameter apart: a sequential
    Bayesian update); the last fit's centre when it ran at these knobs (the same window then
    poses the same problem, and a fit does not become its own prior)."""
    if prior is None or not prior.fitted:
        return None
    same = prior.fitted_budget == float(
        knobs.max_num_batched_tokens
    ) and prior.fitted_seqs == float(knobs.max_num_seqs)
    if same:
        return prior.prior_centre()
    return Calibration(
        bandwidth=prior.bandwidth,
        compute=prior.compute,
        admit_s=prior.admit_s,
        jitter=prior.jitter,
    )


_PRIOR_TERMS = 4  # how many terms `_prior_terms` adds to the residuals


def _prior_terms(x: Sequence[float], centre: Sequence[float] | None = None) -> list[float]:
    """Weak pulls towards the prior: the roofline's efficiencies, no admission cost, 5 %
    jitter, or the fit at the knobs before (`centre`, in `_params` units). They decide only
    what the window cannot tell apart."""
    if centre is not None:
        w = _CENTRE_WEIGHT
        return [
            w * (x[0] - centre[0]),
            w * (x[1] - centre[1]),
            w * (x[2] - centre[2]) / 2.0,
            w * (x[3] - centre[3]),
        ]
    return [
        _PRIOR_WEIGHT * x[0],
        _PRIOR_WEIGHT * x[1],
        0.2 * x[2] / 5.0,
        _PRIOR_WEIGHT * (x[3] - math.log(_PRIOR_JITTER)),
    ]


# Step-time fits, shared by every deployment's model: the fit is a pure function of its
# inputs, so a window that poses exactly the problem of one already fitted (no new samples
# since the last reconcile, or a deployment's twin) reuses that fit instead of running the
# optimiser again (~300 steady-state evaluations: most of an idle reconcile's CPU,
# docs/scale.md). Not rounded: a 0.1 % change of one input can move the optimiser to another
# basin of the rough residuals (docs/decisions.md), so rounding would change fits, not only
# reuse them. About 0.3 KiB an entry.
FIT_CACHE = 4096


@dataclass(frozen=True)
class FitProblem:
    """What one window tells the step-time fit: the deployment's physics, the traffic and
    knobs it ran, the mean batch, the log of the mean inter-token latency and of the counted
    mean step, and the ITL histogram's cumulative fractions at its informative bounds."""

    shape: DeploymentShape
    traffic: Traffic
    knobs: Knobs3
    running: float | None
    target: float
    step_target: float | None
    itl_shape: tuple[tuple[float, float], ...]
    centre: tuple[float, ...] | None = None  # the prior's centre (`_params` units)
    prefill_target: float | None = None  # log of the mean prefill time (s), when counted


def _evaluate(problem: FitProblem, x: Sequence[float]) -> SteadyState:
    """The steady state at the window's traffic, knobs and batch under parameters `x`."""
    c = _with_params(Calibration(), x)
    return steady_state(
        problem.traffic, problem.knobs, _curve(problem.shape, c), _costs(c),
        running=problem.running,
    )  # fmt: skip


def _residuals(problem: FitProblem, x: Sequence[float]) -> list[float]:
    """What the fit minimises (squared and summed): how far parameters `x` put the mean ITL,
    the mean step and the ITL histogram from the window's, and from the prior."""
    st = _evaluate(problem, x)
    prior_terms = _prior_terms(x, problem.centre)
    n = (
        1
        + 2 * len(problem.itl_shape)
        + (problem.step_target is not None)
        + (problem.prefill_target is not None)
    )
    if not st.stable:
        return [5.0] * n + prior_terms
    fit = [math.log(max(st.itl_mean_s, 1e-9)) - problem.target]
    if problem.step_target is not None:
        fit.append(math.log(max(st.step_mean_s, 1e-9)) - problem.step_target)
    fit += _shape_residuals(st.itl_below, problem.itl_shape)
    if problem.prefill_target is not None:
        fit.append(math.log(max(st.prefill_mean_s, 1e-9)) - problem.prefill_target)
    return fit + prior_terms


@lru_cache(maxsize=FIT_CACHE)
def _fit_step_times(problem: FitProblem) -> tuple[tuple[float, ...], float | None]:
    """The fitted parameters (see _params) and the fit's |log| error on the mean ITL (None
    when the fit leaves the engine unstable at the window's load)."""
    residuals = partial(_residuals, problem)
    start = _params(Calibration())
    x = tuple(_least_squares(residuals, start))
    y = tuple(_least_squares(residuals, _coarse_start(residuals, start)))
    if _sq(residuals(y)) < _sq(residuals(x)):
        x = y
    # A start on the finer line that is already better than both fits: they missed a valley
    # narrower than the grid (see _START_LINE), so the simplex runs once more from there.
    line, line_cost = _line_start(residuals, start)
    if line_cost < _sq(residuals(x)):
        z = tuple(_least_squares(residuals, line))
        if _sq(residuals(z)) < _sq(residuals(x)):
            x = z
    st = _evaluate(problem, x)
    error = abs(math.log(max(st.itl_mean_s, 1e-9)) - problem.target) if st.stable else None
    return x, error


def _sq(r: Sequence[float]) -> float:
    return float(sum(v * v for v in r))


# The highest CPU cost per admitted request (s) a decision must allow for. No window tells it
# apart from prefill compute: every admission brings the workload's mean prompt, so
# admissions and prefill tokens per step rise together, and a fit trades one for the other.
# The fit's residuals over the window's data were flat from 0 to 6 ms in held-out Mixtral-8x7B
# windows (2.4 req/s/pod) and in chat-8b-h100 windows at 16 and 28 req/s/pod alike
# (docs/decisions.md); the prior then picks ~0 ms. Where capacity does not depend on it
# (chat: 704/256 at 27.99 req/s/pod from 0 to 4 ms) the bound costs nothing; where it does
# (Mixtral's 448/256: 6.0 req/s/pod at 0 ms, 4.6 at 4 ms, 4.8 measured with 3 ms) a
# decision that ignores it commits a cliff. 4 ms is the highest cost the benchmark's
# engines are given (1.5-4 ms), and a refit at it must explain the window about as well
# as the fit did (_BOUND_TOLERANCE).
ADMIT_BOUND_S = 0.004

# How much worse than the fit, in squared residuals over the window's data, the fit at the
# bound may explain the window and still count as the same engine: 1.5x, or 0.002 (a 4.5 %
# miss of one log mean) where the fit is near exact.
_BOUND_TOLERANCE = (1.5, 0.002)


@lru_cache(maxsize=FIT_CACHE)
def _fit_at_admission(problem: FitProblem, x: tuple[float, ...]) -> tuple[float, ...] | None:
    """The window's fit (the other three parameters) with the admission cost held at
    ADMIT_BOUND_S, from the free fit `x` and from the prior; None when the free fit's own
    cost is already as high, or when the bound explains the window clearly worse."""
    bound_ms = ADMIT_BOUND_S * 1000.0
    if x[2] >= bound_ms:
        return None
    residuals = partial(_residuals, problem)
    free = (0, 1, 3)
    starts = ([x[0], x[1], bound_ms, x[3]], [*_params(Calibration())[:2], bound_ms, x[3]])
    fits = [_least_squares(residuals, start, free) for start in starts]
    terms, y = min(((residuals(v), v) for v in fits), key=lambda tv: _sq(tv[0]))
    ratio, slack = _BOUND_TOLERANCE
    data = len(terms) - _PRIOR_TERMS
    if _sq(terms[:data]) > ratio * _sq(residuals(x)[:data]) + slack:
        return None
    if not _evaluate(problem, y).stable:
        return None
    return tuple(y)


# The coarse grid of log efficiencies the fit also starts from: 0.45x to 2.3x the roofline's,
# in steps of 1.5x (5 x 5 points).
_START_GRID = slice(math.log(0.45), math.log(2.5), math.log(1.5))


# The finer line of log bandwidth efficiencies the fit also starts from (same range, steps of
# 1.1x), at the roofline's compute efficiency. Decode steps fill the bulk of the ITL
# histogram, so when they sit near a bucket bound the residuals have a valley in bandwidth
# narrower than the grid's 1.5x: a held-out RAG window on Qwen2.5-32B / 2 x L40S (decode
# steps of 63 ms against the 75 ms bound) had it at 0.75-0.87, between the grid's 0.675 and
# 1.01, and the fit settled on 1.6 with 5x the residuals of the engine's true 0.82.
_START_LINE = slice(math.log(0.45), math.log(2.5), math.log(1.1))


def _coarse_start(fn: Callable[[Sequence[float]], list[float]], x0: Sequence[float]) -> list[float]:
    """The best point of a coarse grid of the two efficiencies (the other parameters at the
    prior)."""
    from scipy.optimize import brute

    def cost(xy: Sequence[float]) -> float:
        return _sq(fn([xy[0], xy[1], *x0[2:]]))

    best = brute(cost, (_START_GRID, _START_GRID), finish=None)
    return [float(best[0]), float(best[1]), *x0[2:]]


def _line_start(
    fn: Callable[[Sequence[float]], list[float]], x0: Sequence[float]
) -> tuple[list[float], float]:
    """The best point, and its objective, of a finer line of bandwidths at the prior's
    compute, then of the grid's computes at that bandwidth (the other parameters at the
    prior)."""
    from scipy.optimize import brute

    def cost(bw: float, ce: float) -> float:
        return _sq(fn([bw, ce, *x0[2:]]))

    bw = float(np.atleast_1d(brute(lambda b: cost(b[0], x0[1]), (_START_LINE,), finish=None))[0])
    ce, value = brute(lambda c: cost(bw, c[0]), (_START_GRID,), finish=None, full_output=True)[:2]
    return [bw, float(np.atleast_1d(ce)[0]), *x0[2:]], float(value)


# The Nelder-Mead simplex's first steps from its start, in `_params` units: 10 % in each
# efficiency, 1 ms of admission cost, 30 % in jitter. Small on purpose: bench/tuning with 30 %
# steps and a restart found deeper minima of the same residuals, and predicted worse (model
# error at decisions median 13 % against 8 %; docs/decisions.md).
_SIMPLEX_STEP = (0.1, 0.1, 1.0, 0.3)


def _least_squares(
    fn: Callable[[Sequence[float]], list[float]],
    x0: Sequence[float],
    free: Sequence[int] = (0, 1, 2, 3),
) -> list[float]:
    """Minimise the sum of squared residuals with scipy's Nelder-Mead (imported here, where
    it is used). Derivative-free on purpose: the residuals come from a sample path, so they
    are piecewise smooth, and finite differences can see a flat spot where there is none.
    Not Powell: a window whose decode steps sit near a histogram bound has a valley 2 % wide
    in bandwidth, which Powell's line searches stepped over (docs/decisions.md, "The
    step-time fit by Nelder-Mead")."""
    import numpy as np
    from scipy.optimize import minimize

    full = np.asarray(x0, dtype=float)
    idx = list(free)

    def whole(v: np.ndarray) -> list[float]:
        out = full.copy()
        out[idx] = v
        return [float(a) for a in out]

    x = full[idx]
    res = minimize(
        lambda v: float(sum(r * r for r in fn(whole(v)))),
        x,
        method="Nelder-Mead",
        bounds=[(_LO[i], _HI[i]) for i in idx],
        options={
            "maxfev": 150,
            "xatol": 1e-3,
            "fatol": 1e-6,
            "initial_simplex": np.vstack([x, x + np.diag([_SIMPLEX_STEP[i] for i in idx])]),
        },
    )
    return whole(res.x)


# Prefills a window must count before their mean time joins the fit (vLLM's
# vllm:request_prefill_time_seconds: first scheduled to first token, the steps that carry a
# prompt, which the window's compute efficiency sets).
PREFILL_MIN_COUNT = 20


# The prompt spreads `_fit_prompt_sigma` tries: log-normal sigmas from 0.05 to 1.5, 16 of them
# (a grid, not a line search: the model's prefill times come in whole chunks, so its fit to
# the histogram moves in steps).
_PROMPT_SIGMAS = tuple(float(v) for v in np.geomspace(0.05, 1.5, 16))


def _fit_prompt_sigma(
    cal: Calibration,
    shape: DeploymentShape,
    snapshot: Snapshot,
    knobs: Knobs,
    workload: Workload,
    kv: float | None,
) -> Calibration:
    """The spread of prompt lengths that both the length histogram and the prefill times
    show (`cal` unchanged when the window counted too few prefills).

    vLLM's length buckets (1-2-5 tokens) are too coarse for a tail: prompts spread evenly
    over 3,000-6,000 tokens (a held-out RAG window) fill two buckets, and the log-normal
    with their mean and split has sigma 0.38 and a p95 of 8,000 tokens. Prefill times are
    the same prompts in the engine's own time, on finer buckets (0.3-2.5 s in steps of
    1.25-1.7x): that window had 98 % of them within 1.33x their mean, where sigma 0.38
    puts 83 %. Each sigma is judged on both histograms' cumulative fractions, the prefill
    times' compared at the window's mean (the spread is the question here; the step fit
    has placed the mean)."""
    prefill = snapshot.prefill_time
    if not prefill.mean_ms or prefill.count < PREFILL_MIN_COUNT:
        return cal
    mean_s = prefill.mean_ms / 1000.0
    times = [(b / 1000.0, f) for b, f in cdf_points(prefill.buckets)]
    if not times:
        return cal
    log_mean = math.log(max(1.0, workload.prompt_mean))
    spread = length_spread(snapshot.prompt_len.buckets, log_mean, 0.995)
    lengths = spread[0] if spread is not None else []
    base = _traffic(workload, workload.request_rate)
    knobs3 = Knobs3(knobs.max_num_batched_tokens, knobs.max_num_seqs, kv)
    curve, costs = _curve(shape, cal), _costs(cal)

    def loss(sigma: float) -> float:
        st = steady_state(
            replace(base, prompt_sigma=sigma), knobs3, curve, costs, running=snapshot.running_mean
        )
        if not st.stable or not math.isfinite(st.prefill_mean_s):
            return math.inf
        scale = st.prefill_mean_s / mean_s
        out = sum((st.prefill_below(b * scale) - f) ** 2 for b, f in times)
        return out + lognormal_misfit(log_mean, sigma, lengths)

    scores = [loss(v) for v in _PROMPT_SIGMAS]
    best = min(range(len(scores)), key=scores.__getitem__)
    if not math.isfinite(scores[best]):
        return cal
    return replace(cal, prompt_sigma=_PROMPT_SIGMAS[best])


# The most time outside the engine a window may show (s).
API_MAX_S = 5.0
# The model's first tokens, read at these quantiles to give its cumulative fractions.
_TTFT_QUANTILES = np.linspace(0.0025, 0.9975, 200)


def _api_shift(ttft: Callable[[float], float], points: Sequence[tuple[float, float]]) -> float:
    """The smallest shift of the model's first tokens (`ttft`: quantile -> seconds, with no
    time outside the engine) whose cumulative fractions at the histogram's bounds (`points`:
    seconds, fraction at or under) are the closest to the window's.

    A median interpolated inside a wide bucket is no measure of that time: vLLM's TTFT
    buckets go 1.0, 2.5, 5.0 s, and a held-out 32B RAG window's median of about 1.5 s read
    1.8 s there, which put 0.4 s outside an engine whose real overhead is a few
    milliseconds, and its TTFT p95 over the SLO at any rate. The bounds' counts are exact.

    The fractions move only where a bound crosses one of the model's first tokens, so the
    candidates are the shifts that match one bound exactly (the bound less the model's
    quantile at its fraction), the midpoints between them, and none."""
    model = np.sort(np.array([ttft(float(q)) for q in _TTFT_QUANTILES]))
    n = len(model)
    bounds = np.array([b for b, _ in points])
    measured = np.array([f for _, f in points])
    exact = sorted({min(API_MAX_S, max(0.0, b - ttft(f))) for b, f in points} | {0.0})
    candidates = [*exact, *((a + b) / 2.0 for a, b in itertools.pairwise(exact))]

    def loss(shift: float) -> float:
        below = np.searchsorted(model, bounds - shift, side="right") / n
        return float(np.sum((below - measured) ** 2))

    return min(sorted(candidates), key=loss)


# Predicted and measured SLO percentiles agree within this (|log| of their ratio).
AGREEMENT_TOLERANCE = 0.25


def prediction_agrees(snapshot: Snapshot, slo: SLO, pred: Prediction) -> bool:
    """Whether the predicted SLO percentiles match the window: within the tolerance of the
    interpolated percentile, or anywhere the histogram's buckets allow the percentile to be
    (an interpolated percentile inside a wide bucket is no better than the bucket)."""
    for metric, target in slo.targets():
        predicted = pred.latency_ms(metric)
        if not math.isfinite(predicted) or predicted <= 0:
            return False
        summary = snapshot.latency(metric)
        measured = summary.at(target.percentile)
        if measured is None:
            continue
        if abs(math.log(predicted / max(measured, 1e-9))) <= AGREEMENT_TOLERANCE:
            continue
        bounds = summary.fraction_bounds(predicted)
        q = target.percentile / 100.0
        if bounds is None or not (bounds[0] - 0.01 <= q <= bounds[1] + 0.01):
            return False
    return True


def slo_ratio(slo: SLO, ttft_ms: float, itl_ms: float, e2e_ms: float) -> float:
    """Worst value/threshold over the SLO's targets (0 when it has none)."""
    worst = 0.0
    for metric, value in (("ttft", ttft_ms), ("itl", itl_ms), ("e2e", e2e_ms)):
        t = getattr(slo, metric)
        if t is not None:
            worst = max(worst, value / t.threshold_ms)
    return worst


def _kv_calibration(
    snapshot: Snapshot,
    knobs: Knobs,
    ctx: DeploymentContext,
    prior: Calibration | None,
    phys: Physics,
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
    scale = base.kv_scale
    if kv_tokens and phys.exact:
        expected = phys.kv_tokens(knobs.max_num_batched_tokens, knobs.max_num_seqs, gmu)
        if expected:
            scale = kv_tokens / expected
    return replace(
        base,
        kv_scale=scale,
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


def _sim_model(name: str) -> bool:
    lower = {k.lower() for k in (*MODEL_CONFIGS, *MODEL_ALIASES)}
    short = {k.split("/")[-1].lower() for k in (*MODEL_CONFIGS, *MODEL_ALIASES)}
    return name.lower() in lower or name.lower() in short


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

    def predict(
        self, knobs: Knobs, workload: Workload, calibration: Calibration, capacity: bool = True
    ) -> Prediction:
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
            cap = self._capacity(knobs, workload, be, ce, ov, meets, api_ms)
        else:
            # Below the current rate; a rough figure (rate over the SLO overshoot) is enough for
            # the reason text, and saves a bisection nobody ranks by.
            ratio = slo_ratio(workload.slo, r.ttft_ms, r.itl_ms, r.e2e_ms) / workload.safety_margin
            cap = workload.request_rate / max(1.0, ratio) if r.stable else 0.0
        return Prediction(
            ttft_ms=r.ttft_ms,
            itl_ms=r.itl_ms,
            e2e_ms=r.e2e_ms,
            kv_capacity_tokens=r.kv_tokens,
            preemption_rate=r.preemption_rate,
            feasible=meets,
            capacity_rps=cap,
            meets_slo=meets,
            reason="" if meets else ("overloaded" if not r.stable else "SLO missed"),
            slo_ratio=slo_ratio(workload.slo, r.ttft_ms, r.itl_ms, r.e2e_ms),
        )

    # -- internals ---------------------------------------------------------------------------

    def _usable(self) -> bool:
        return (
            self.ctx is not None
            and sim_gpu_name(self.ctx.gpu_product) is not None
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

        gpu = sim_gpu_name(ctx.gpu_product)
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
            "lognormal", w.prompt_mean, lognormal_sigma(w.prompt_mean, w.prompt_p90), 1, high_p
        )
        output = LengthDist(
            "lognormal", w.gen_mean, lognormal_sigma(w.gen_mean, w.gen_p90), 1, max(1, limit // 2)
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
            burstiness=1.0 / clamp_cv2(w.arrival_cv2),
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
