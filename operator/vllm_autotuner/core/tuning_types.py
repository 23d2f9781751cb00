"""The tuner's own value types, independent of the CRD models.

The API models (pydantic, `vllm_autotuner.api`) describe what users write; these frozen
dataclasses describe what the pure tuner reasons about. Keeping them separate lets the core be
tested without the API and lets the API evolve its spelling; the lead maps one to the other.

`TuningState` is the only type that round-trips through the cluster (status.tuning), so it and
the types it holds have `to_dict()` / `from_dict()` with camelCase keys and ISO-8601 times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, time, timedelta
from typing import Any, Literal, cast
from zoneinfo import ZoneInfo

from .memory import GMU_EPSILON as GMU_EPSILON
from .memory import ProvenMemory

Mode = Literal["Off", "Recommend", "Auto"]
Phase = Literal[
    "Idle",
    "Observing",
    "Candidate",
    "RollingOut",
    "Verifying",
    "Promoting",
    "Committed",
    "RolledBack",
    "Holding",
]
# The phases of a trial in flight (supervised until it commits or rolls back).
TRIAL_PHASES: tuple[str, ...] = ("RollingOut", "Verifying", "Promoting")
Action = Literal["hold", "recommend", "rollout", "verify", "promote", "commit", "rollback"]
# How a trial runs: on every pod at once (before/after verdict), or first on one canary pod
# beside the baseline pods (paired verdict, then promotion to every pod).
Strategy = Literal["Rolling", "Canary"]
TrialOutcome = Literal["Pending", "Committed", "RolledBack", "Crashed", "NotReady", "OOMKilled"]
EventType = Literal["Normal", "Warning"]
# Why a configuration is remembered as bad. The first three are hidden constraints (memory,
# start-up): they forbid a whole neighbourhood. A regression only forbids the exact knobs.
InfeasibleKind = Literal["OOMKilled", "Crashed", "NotReady", "Regression"]


# --------------------------------------------------------------------------------------- knobs


@dataclass(frozen=True, order=True)
class Knobs:
    """The three vLLM flags the tuner owns."""

    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory_utilization: float

    def same_as(self, other: Knobs | None) -> bool:
        """Equality that tolerates float noise from a JSON round trip."""
        return (
            other is not None
            and self.max_num_batched_tokens == other.max_num_batched_tokens
            and self.max_num_seqs == other.max_num_seqs
            and abs(self.gpu_memory_utilization - other.gpu_memory_utilization) < GMU_EPSILON
        )

    def describe(self) -> str:
        return (
            f"maxNumBatchedTokens={self.max_num_batched_tokens} "
            f"maxNumSeqs={self.max_num_seqs} "
            f"gpuMemoryUtilization={self.gpu_memory_utilization:.2f}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "maxNumBatchedTokens": self.max_num_batched_tokens,
            "maxNumSeqs": self.max_num_seqs,
            "gpuMemoryUtilization": round(self.gpu_memory_utilization, 4),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Knobs:
        return cls(
            max_num_batched_tokens=int(d["maxNumBatchedTokens"]),
            max_num_seqs=int(d["maxNumSeqs"]),
            gpu_memory_utilization=float(d["gpuMemoryUtilization"]),
        )


@dataclass(frozen=True)
class KnobBounds:
    """Where one knob may go, and how far a single rollout may move it."""

    min: float
    max: float
    max_step: float

    def contains(self, value: float) -> bool:
        return self.min - GMU_EPSILON <= value <= self.max + GMU_EPSILON


@dataclass(frozen=True)
class Bounds:
    mnbt: KnobBounds
    mns: KnobBounds
    gmu: KnobBounds

    def contains(self, k: Knobs) -> bool:
        return (
            self.mnbt.contains(k.max_num_batched_tokens)
            and self.mns.contains(k.max_num_seqs)
            and self.gmu.contains(k.gpu_memory_utilization)
        )

    def within_step(self, frm: Knobs, to: Knobs) -> bool:
        """True when `to` is at most one rollout's step away from `frm` on every knob."""
        return (
            abs(to.max_num_batched_tokens - frm.max_num_batched_tokens)
            <= self.mnbt.max_step + GMU_EPSILON
            and abs(to.max_num_seqs - frm.max_num_seqs) <= self.mns.max_step + GMU_EPSILON
            and abs(to.gpu_memory_utilization - frm.gpu_memory_utilization)
            <= self.gmu.max_step + GMU_EPSILON
        )


# ------------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class SLOTarget:
    """`percentile` is in percent (95.0 means p95); `threshold_ms` is the limit at it."""

    percentile: float
    threshold_ms: float


@dataclass(frozen=True)
class SLO:
    ttft: SLOTarget | None = None
    itl: SLOTarget | None = None
    e2e: SLOTarget | None = None

    def targets(self) -> list[tuple[str, SLOTarget]]:
        out: list[tuple[str, SLOTarget]] = []
        for name in ("ttft", "itl", "e2e"):
            t = getattr(self, name)
            if t is not None:
                out.append((name, t))
        return out


@dataclass(frozen=True)
class MaintenanceWindow:
    """A weekly window. `days` are the weekdays the window *starts* on (0 = Monday), in `tz`.

    A window whose end is not after its start runs past midnight into the next day.
    """

    days: frozenset[int]
    start: time
    end: time
    tz: str = "UTC"

    def contains(self, now: datetime) -> bool:
        local = now.astimezone(ZoneInfo(self.tz))
        t = local.time().replace(tzinfo=None)
        if self.start < self.end:
            return local.weekday() in self.days and self.start <= t < self.end
        # Runs past midnight: either the evening of a listed day or the morning after it.
        if local.weekday() in self.days and t >= self.start:
            return True
        yesterday = (local - timedelta(days=1)).weekday()
        return yesterday in self.days and t < self.end


@dataclass(frozen=True)
class RolloutRules:
    min_interval_s: float = 1800.0
    max_per_day: int = 4
    maintenance_windows: tuple[MaintenanceWindow, ...] = ()
    verify_window_s: float = 600.0
    ready_timeout_s: float = 900.0
    # How long a rollout may wait for the pods that stay to have room for the traffic.
    headroom_timeout_s: float = 3600.0


@dataclass(frozen=True)
class TuningPolicy:
    """The effective policy for one deployment (already merged; mode already capped).

    `safety_margin` scales every SLO threshold a candidate must be predicted to meet;
    `min_gain_pct` is the predicted capacity gain below which a rollout is not worth its risk;
    `gmu_rise_step` caps how far gpu_memory_utilization may rise above the last stable value.
    """

    slo: SLO
    bounds: Bounds
    rollout: RolloutRules = RolloutRules()
    min_requests_per_window: int = 200
    evaluation_window_s: float = 300.0
    mode: Mode = "Recommend"
    safety_margin: float = 0.9
    min_gain_pct: float = 5.0
    gmu_rise_step: float = 0.02


@dataclass(frozen=True)
class RolloutSettings:
    """How a change may be rolled out on this deployment's cluster (spec.rollout).

    `max_surge`: pods a rollout may add beyond the replica count (0 on full GPU nodes).
    `canary`: with two replicas or more, a candidate runs first on one pod.
    `shutdown_timeout_s`: vLLM's --shutdown-timeout, the drain of every restart.
    `pre_stop_s`: the pre-stop delay that lets endpoints drop a pod before SIGTERM.
    `load_time_s`: the expected time from a pod's start to ready (weights, compile, graphs).
    """

    max_surge: int = 0
    canary: bool = True
    shutdown_timeout_s: float = 120.0
    pre_stop_s: float = 5.0
    load_time_s: float = 300.0


@dataclass(frozen=True)
class DeploymentContext:
    """What the tuner knows about the deployment besides its knobs (from the CR spec)."""

    model: str
    gpu_product: str | None = None
    gpu_memory_gib: float | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    replicas: int = 1
    rollout: RolloutSettings = RolloutSettings()
    # A replica autoscaler owns the count (spec.autoscaling.target): more capacity per replica
    # means fewer replicas at the same load (core/economics.py).
    autoscaled: bool = False


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to emit: `reason` is CamelCase, `message` is for people."""

    type: EventType
    reason: str
    message: str


# -------------------------------------------------------------------------------------- state


def _iso(t: datetime | None) -> str | None:
    if t is None:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _parse(s: Any) -> datetime | None:
    if s is None:
        return None
    if isinstance(s, datetime):
        return s if s.tzinfo else s.replace(tzinfo=UTC)
    text = str(s)
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    t = datetime.fromisoformat(text)
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _opt_float(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return None if math.isnan(f) else f


def _round(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


@dataclass(frozen=True)
class Measured:
    """What a configuration achieved over one evaluation window (per pod, load-aware)."""

    request_rate: float
    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None
    slo_attainment: float | None = None
    capacity_rps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "requestRate": _round(self.request_rate),
            "ttftMs": _round(self.ttft_ms),
            "itlMs": _round(self.itl_ms),
            "e2eMs": _round(self.e2e_ms),
            "sloAttainment": _round(self.slo_attainment, 4),
            "capacityRps": _round(self.capacity_rps),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Measured:
        return cls(
            request_rate=float(d.get("requestRate") or 0.0),
            ttft_ms=_opt_float(d.get("ttftMs")),
            itl_ms=_opt_float(d.get("itlMs")),
            e2e_ms=_opt_float(d.get("e2eMs")),
            slo_attainment=_opt_float(d.get("sloAttainment")),
            capacity_rps=_opt_float(d.get("capacityRps")),
        )


@dataclass(frozen=True)
class Trial:
    id: int
    knobs: Knobs
    started_at: datetime
    ended_at: datetime | None = None
    outcome: TrialOutcome = "Pending"
    reason: str = ""
    measured: Measured | None = None
    # A canary's baseline pods over the same window, and the knobs they ran: the paired
    # measurement the trial's verdict compared against.
    baseline: Measured | None = None
    baseline_knobs: Knobs | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "knobs": self.knobs.to_dict(),
            "startedAt": _iso(self.started_at),
            "endedAt": _iso(self.ended_at),
            "outcome": self.outcome,
            "reason": self.reason,
            "measured": None if self.measured is None else self.measured.to_dict(),
            "baseline": None if self.baseline is None else self.baseline.to_dict(),
            "baselineKnobs": None if self.baseline_knobs is None else self.baseline_knobs.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Trial:
        started = _parse(d["startedAt"])
        assert started is not None
        m, b, bk = d.get("measured"), d.get("baseline"), d.get("baselineKnobs")
        return cls(
            id=int(d["id"]),
            knobs=Knobs.from_dict(d["knobs"]),
            started_at=started,
            ended_at=_parse(d.get("endedAt")),
            outcome=cast(TrialOutcome, d.get("outcome", "Pending")),
            reason=str(d.get("reason", "")),
            measured=None if m is None else Measured.from_dict(m),
            baseline=None if b is None else Measured.from_dict(b),
            baseline_knobs=None if bk is None else Knobs.from_dict(bk),
        )


@dataclass(frozen=True)
class InfeasibleConfig:
    knobs: Knobs
    reason: str
    time: datetime
    kind: InfeasibleKind = "Crashed"

    def to_dict(self) -> dict[str, Any]:
        return {
            "knobs": self.knobs.to_dict(),
            "reason": self.reason,
            "time": _iso(self.time),
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InfeasibleConfig:
        t = _parse(d["time"])
        assert t is not None
        return cls(
            knobs=Knobs.from_dict(d["knobs"]),
            reason=str(d.get("reason", "")),
            time=t,
            kind=cast(InfeasibleKind, d.get("kind", "Crashed")),
        )


@dataclass(frozen=True)
class Predicted:
    capacity_rps: float
    ttft_ms: float | None
    itl_ms: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacityRps": _round(self.capacity_rps),
            "ttftMs": _round(self.ttft_ms),
            "itlMs": _round(self.itl_ms),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Predicted:
        return cls(
            capacity_rps=float(d.get("capacityRps") or 0.0),
            ttft_ms=_opt_float(d.get("ttftMs")),
            itl_ms=_opt_float(d.get("itlMs")),
        )


@dataclass(frozen=True)
class Recommendation:
    knobs: Knobs
    reason: str
    predicted: Predicted
    gain_pct: float
    time: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "knobs": self.knobs.to_dict(),
            "reason": self.reason,
            "predicted": self.predicted.to_dict(),
            "gainPct": round(self.gain_pct, 2),
            "time": _iso(self.time),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recommendation:
        t = _parse(d["time"])
        assert t is not None
        return cls(
            knobs=Knobs.from_dict(d["knobs"]),
            reason=str(d.get("reason", "")),
            predicted=Predicted.from_dict(d.get("predicted") or {}),
            gain_pct=float(d.get("gainPct") or 0.0),
            time=t,
        )


@dataclass(frozen=True)
class DecisionRecord:
    time: datetime
    action: Action
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"time": _iso(self.time), "action": self.action, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DecisionRecord:
        t = _parse(d["time"])
        assert t is not None
        return cls(time=t, action=cast(Action, d["action"]), reason=str(d.get("reason", "")))


@dataclass(frozen=True)
class ModelCheck:
    """The model's prediction for the applied knobs next to what the window measured, so a
    person (and the tuner) can see when the model is off. Per pod."""

    time: datetime
    knobs: Knobs
    measured_rate_rps: float
    predicted_capacity_rps: float
    predicted_slo_ratio: float | None
    measured_slo_ratio: float | None
    fit_error: float | None
    # The predicted SLO percentiles at the measured load are what the window's histograms
    # show (within MODEL_SLO_TOLERANCE, or inside the bucket that holds the measurement).
    agrees: bool = False
    # The burstiness the model assumed: the squared coefficient of variation of the gaps
    # between one pod's arrivals (1: Poisson), from the window's first-token counts.
    arrival_cv2: float = 1.0

    @property
    def trusted(self) -> bool:
        """The model explains the window: it reproduced the step times it was fitted on and
        its SLO percentiles at the measured load agree with the measurement."""
        fit_ok = self.fit_error is not None and self.fit_error <= MODEL_FIT_TOLERANCE
        return fit_ok and self.agrees

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": _iso(self.time),
            "knobs": self.knobs.to_dict(),
            "measuredRateRps": _round(self.measured_rate_rps),
            "predictedCapacityRps": _round(self.predicted_capacity_rps),
            "predictedSloRatio": _round(_finite(self.predicted_slo_ratio)),
            "measuredSloRatio": _round(_finite(self.measured_slo_ratio)),
            "fitError": _round(self.fit_error, 4),
            "agrees": self.agrees,
            "arrivalCv2": _round(self.arrival_cv2),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelCheck:
        t = _parse(d["time"])
        assert t is not None
        return cls(
            time=t,
            knobs=Knobs.from_dict(d["knobs"]),
            measured_rate_rps=float(d.get("measuredRateRps") or 0.0),
            predicted_capacity_rps=float(d.get("predictedCapacityRps") or 0.0),
            predicted_slo_ratio=_opt_float(d.get("predictedSloRatio")),
            measured_slo_ratio=_opt_float(d.get("measuredSloRatio")),
            fit_error=_opt_float(d.get("fitError")),
            agrees=bool(d.get("agrees", False)),
            arrival_cv2=float(d.get("arrivalCv2") or 1.0),
        )


# A fit that misses its own window by more than this (|log| of the worst residual), or an
# SLO verdict more than this far from the measured one, is not trusted to jump.
MODEL_FIT_TOLERANCE = 0.15
MODEL_SLO_TOLERANCE = 0.25


def _finite(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else None


@dataclass(frozen=True)
class CanaryAnalysis:
    """The paired comparison of the canary pod with the baseline pods over one window."""

    since: datetime
    window_s: float
    baseline: Measured
    canary: Measured
    verdict: str  # Pending | Promote | Reject
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "since": _iso(self.since),
            "windowSeconds": round(self.window_s, 1),
            "baseline": self.baseline.to_dict(),
            "canary": self.canary.to_dict(),
            "verdict": self.verdict,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CanaryAnalysis:
        t = _parse(d["since"])
        assert t is not None
        return cls(
            since=t,
            window_s=float(d.get("windowSeconds") or 0.0),
            baseline=Measured.from_dict(d.get("baseline") or {}),
            canary=Measured.from_dict(d.get("canary") or {}),
            verdict=str(d.get("verdict", "Pending")),
            reason=str(d.get("reason", "")),
        )


@dataclass(frozen=True)
class Commands:
    """What a person asked for through the VLLMDeployment's annotations (core/commands.py).

    `paused` holds while the annotation is there; the others are one-shot requests not yet
    acted on. promote and abort are for a running canary.
    """

    paused: bool = False
    promote_requested: bool = False
    abort_requested: bool = False
    retry_requested: bool = False


MAX_TRIALS = 20
MAX_INFEASIBLE = 50


@dataclass(frozen=True)
class TuningState:
    """Everything the tuner must remember between reconciles (status.tuning).

    `applied` is what the Deployment should run now; `last_good` the last verified config;
    `candidate` the one on trial. `baseline` is what `last_good` measured, the yardstick a
    candidate is verified against. `calibration` is the performance model's fitted parameters.
    `last_rollout_at` drives the cooldown; `rollouts_today` counts rollouts on `rollout_day`
    (a UTC date, YYYY-MM-DD).
    """

    applied: Knobs
    last_good: Knobs
    phase: Phase = "Idle"
    candidate: Knobs | None = None
    # How the trial in flight runs (meaningful in RollingOut, Verifying and Promoting). During
    # a canary, `applied` stays the baseline's knobs and `candidate` runs on the canary pod.
    strategy: Strategy = "Rolling"
    recommendation: Recommendation | None = None
    last_decision: DecisionRecord | None = None
    rollout_started_at: datetime | None = None
    verify_until: datetime | None = None
    last_rollout_at: datetime | None = None
    rollouts_today: int = 0
    rollout_day: str | None = None
    # The (token budget, gpu_memory_utilization) pairs proven stable (core/memory.py); the
    # last good knobs count as proven besides (memory()).
    proven_memory: ProvenMemory = field(default_factory=ProvenMemory)
    trials: tuple[Trial, ...] = ()
    infeasible: tuple[InfeasibleConfig, ...] = ()
    baseline: Measured | None = None
    calibration: Mapping[str, float] = field(default_factory=dict)
    # The highest per-pod request rate seen lately, and when: a change made while the SLO is
    # met must hold at this load, not only at today's trough.
    peak_rate: float | None = None
    peak_rate_at: datetime | None = None
    # Since when a rollout waits for the pods that stay to have room for the traffic.
    headroom_wait_since: datetime | None = None
    analysis: CanaryAnalysis | None = None
    model_check: ModelCheck | None = None

    @classmethod
    def initial(cls, knobs: Knobs) -> TuningState:
        """The state of a deployment that just started on `knobs` (not yet proven stable)."""
        return cls(applied=knobs, last_good=knobs)

    def memory(self) -> ProvenMemory:
        """The memory proven stable: the recorded proofs and the last good knobs."""
        return self.proven_memory.with_proof(self.last_good)

    def stable_gmu(self) -> float:
        """The highest gpu_memory_utilization proven stable, at any token budget."""
        return self.memory().highest()

    def with_trial(self, trial: Trial) -> TuningState:
        trials = (*tuple(t for t in self.trials if t.id != trial.id), trial)
        trials = tuple(sorted(trials, key=lambda t: t.id))[-MAX_TRIALS:]
        return replace(self, trials=trials)

    def with_infeasible(self, entry: InfeasibleConfig) -> TuningState:
        return replace(self, infeasible=(*self.infeasible, entry)[-MAX_INFEASIBLE:])

    def next_trial_id(self) -> int:
        return max((t.id for t in self.trials), default=0) + 1

    def current_trial(self) -> Trial | None:
        return self.trials[-1] if self.trials and self.trials[-1].outcome == "Pending" else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "applied": self.applied.to_dict(),
            "lastGood": self.last_good.to_dict(),
            "candidate": None if self.candidate is None else self.candidate.to_dict(),
            "strategy": self.strategy,
            "recommendation": (
                None if self.recommendation is None else self.recommendation.to_dict()
            ),
            "lastDecision": None if self.last_decision is None else self.last_decision.to_dict(),
            "rolloutStartedAt": _iso(self.rollout_started_at),
            "verifyUntil": _iso(self.verify_until),
            "lastRolloutAt": _iso(self.last_rollout_at),
            "rolloutsToday": self.rollouts_today,
            "rolloutDay": self.rollout_day,
            "stableGpuMemoryUtilization": self.stable_gmu(),
            "provenMemory": self.memory().to_list(),
            "trials": [t.to_dict() for t in self.trials],
            "infeasible": [i.to_dict() for i in self.infeasible],
            "baseline": None if self.baseline is None else self.baseline.to_dict(),
            "calibration": {k: float(v) for k, v in sorted(self.calibration.items())},
            "peakRate": _round(self.peak_rate),
            "peakRateAt": _iso(self.peak_rate_at),
            "headroomWaitSince": _iso(self.headroom_wait_since),
            "analysis": None if self.analysis is None else self.analysis.to_dict(),
            "model": None if self.model_check is None else self.model_check.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TuningState:
        cand = d.get("candidate")
        rec = d.get("recommendation")
        last = d.get("lastDecision")
        base = d.get("baseline")
        return cls(
            phase=cast(Phase, d.get("phase", "Idle")),
            applied=Knobs.from_dict(d["applied"]),
            last_good=Knobs.from_dict(d.get("lastGood") or d["applied"]),
            candidate=None if cand is None else Knobs.from_dict(cand),
            strategy=cast(Strategy, d.get("strategy") or "Rolling"),
            recommendation=None if rec is None else Recommendation.from_dict(rec),
            last_decision=None if last is None else DecisionRecord.from_dict(last),
            rollout_started_at=_parse(d.get("rolloutStartedAt")),
            verify_until=_parse(d.get("verifyUntil")),
            last_rollout_at=_parse(d.get("lastRolloutAt")),
            rollouts_today=int(d.get("rolloutsToday") or 0),
            rollout_day=d.get("rolloutDay"),
            proven_memory=_proven_memory(d),
            trials=tuple(Trial.from_dict(t) for t in d.get("trials") or ()),
            infeasible=tuple(InfeasibleConfig.from_dict(i) for i in d.get("infeasible") or ()),
            baseline=None if base is None else Measured.from_dict(base),
            calibration={str(k): float(v) for k, v in (d.get("calibration") or {}).items()},
            peak_rate=_opt_float(d.get("peakRate")),
            peak_rate_at=_parse(d.get("peakRateAt")),
            headroom_wait_since=_parse(d.get("headroomWaitSince")),
            analysis=None if not d.get("analysis") else CanaryAnalysis.from_dict(d["analysis"]),
            model_check=None if not d.get("model") else ModelCheck.from_dict(d["model"]),
        )


def _proven_memory(d: Mapping[str, Any]) -> ProvenMemory:
    """provenMemory; from a status written before it, the one utilization it kept, at the
    last good token budget (the only budget that status can vouch for)."""
    if d.get("provenMemory"):
        return ProvenMemory.from_list(d["provenMemory"])
    stable = _opt_float(d.get("stableGpuMemoryUtilization"))
    if stable is None:
        return ProvenMemory()
    last = Knobs.from_dict(d.get("lastGood") or d["applied"])
    return ProvenMemory.of([(last.max_num_batched_tokens, stable)])


# ----------------------------------------------------------------------------------- observe


@dataclass(frozen=True)
class PodHealth:
    """One pod of the deployment, as the Kubernetes adapter sees it.

    `waiting_reason` is the container's state.waiting.reason (e.g. "CrashLoopBackOff");
    `last_termination_reason` is lastState.terminated.reason (e.g. "OOMKilled", "Error");
    `revision_knobs` the knobs the pod was rendered with (None when unknown).
    """

    ready: bool
    restarts: int = 0
    waiting_reason: str | None = None
    last_termination_reason: str | None = None
    revision_knobs: Knobs | None = None
    name: str = ""
