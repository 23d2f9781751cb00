"""Status of both kinds. Only the operator writes it; it is where tuning state survives restarts.

Every field is optional so that partial status (a fresh object, an older operator) still parses,
and so the operator can patch only what changed.
"""

from __future__ import annotations

from datetime import date
from typing import Literal

from pydantic import Field

from vllm_autotuner.api.common import (
    Condition,
    GpuMemoryUtilization,
    Knobs,
    MaxNumBatchedTokens,
    Mode,
    StatusModel,
    Timestamp,
    conditions_field,
)

TuningPhase = Literal[
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
TrialOutcome = Literal["Pending", "Committed", "RolledBack", "Crashed", "NotReady", "OOMKilled"]

MAX_TRIALS = 20
MAX_INFEASIBLE = 50
MAX_PROOFS = 8  # core/memory.py keeps at most as many


class Prediction(StatusModel):
    """What the performance model expects from a configuration."""

    capacity_rps: float | None = Field(default=None, alias="capacityRps", ge=0)
    ttft_ms: float | None = Field(default=None, alias="ttftMs", ge=0)
    itl_ms: float | None = Field(default=None, alias="itlMs", ge=0)


class Recommendation(StatusModel):
    """The best configuration found, published in every mode except Off."""

    knobs: Knobs | None = None
    reason: str | None = Field(default=None, max_length=4096)
    predicted: Prediction | None = None
    gain_pct: float | None = Field(default=None, alias="gainPct")
    time: Timestamp | None = None


class DecisionRecord(StatusModel):
    """The last thing the control loop decided, in words a person can read."""

    time: Timestamp | None = None
    action: str | None = Field(default=None, max_length=64)
    reason: str | None = Field(default=None, max_length=4096)


class Measurement(StatusModel):
    """What Prometheus showed while a trial ran."""

    request_rate: float | None = Field(default=None, alias="requestRate", ge=0)
    ttft_ms: float | None = Field(default=None, alias="ttftMs", ge=0)
    itl_ms: float | None = Field(default=None, alias="itlMs", ge=0)
    e2e_ms: float | None = Field(default=None, alias="e2eMs", ge=0)
    slo_attainment: float | None = Field(default=None, alias="sloAttainment", ge=0, le=1)
    capacity_rps: float | None = Field(default=None, alias="capacityRps", ge=0)


class Trial(StatusModel):
    """One configuration that was rolled out, and how it ended."""

    id: int = Field(ge=0)
    knobs: Knobs | None = None
    started_at: Timestamp | None = Field(default=None, alias="startedAt")
    ended_at: Timestamp | None = Field(default=None, alias="endedAt")
    outcome: TrialOutcome = "Pending"
    reason: str | None = Field(default=None, max_length=4096)
    measured: Measurement | None = None
    baseline: Measurement | None = Field(
        default=None,
        description="A canary trial's baseline pods over the same window: what the verdict "
        "compared the canary with.",
    )
    baseline_knobs: Knobs | None = Field(
        default=None, alias="baselineKnobs", description="The knobs the baseline pods ran."
    )


class InfeasibleConfig(StatusModel):
    """A configuration that crashed, OOM-ed or never got ready; its neighbourhood is avoided."""

    knobs: Knobs
    reason: str | None = Field(default=None, max_length=4096)
    time: Timestamp | None = None
    kind: Literal["OOMKilled", "Crashed", "NotReady", "Regression"] | None = Field(
        default=None,
        description="Hidden constraints (OOMKilled, Crashed, NotReady) forbid a neighbourhood; "
        "a Regression forbids only these exact knobs.",
    )


class MemoryProof(StatusModel):
    """A token budget and gpu_memory_utilization that served a whole window without a crash."""

    max_num_batched_tokens: MaxNumBatchedTokens = Field(alias="maxNumBatchedTokens")
    gpu_memory_utilization: GpuMemoryUtilization = Field(alias="gpuMemoryUtilization")


class CanaryAnalysis(StatusModel):
    """The canary pod against the baseline pods over the same window (same traffic)."""

    since: Timestamp | None = None
    window_seconds: float | None = Field(default=None, alias="windowSeconds", ge=0)
    baseline: Measurement | None = None
    canary: Measurement | None = None
    verdict: Literal["Pending", "Promote", "Reject"] | None = None
    reason: str | None = Field(default=None, max_length=4096)


class ModelCheck(StatusModel):
    """The performance model's prediction for the applied knobs next to what was measured."""

    time: Timestamp | None = None
    knobs: Knobs | None = None
    measured_rate_rps: float | None = Field(default=None, alias="measuredRateRps", ge=0)
    predicted_capacity_rps: float | None = Field(
        default=None,
        alias="predictedCapacityRps",
        ge=0,
        description="Requests/s one pod can serve within the SLO with the applied knobs.",
    )
    predicted_slo_ratio: float | None = Field(default=None, alias="predictedSloRatio", ge=0)
    measured_slo_ratio: float | None = Field(default=None, alias="measuredSloRatio", ge=0)
    fit_error: float | None = Field(default=None, alias="fitError", ge=0)
    agrees: bool | None = Field(
        default=None, description="Whether the predicted SLO percentiles match the measured."
    )
    arrival_cv2: float | None = Field(
        default=None,
        alias="arrivalCv2",
        ge=0,
        description="Burstiness the model assumed: squared coefficient of variation of the "
        "gaps between one pod's arrivals (1 = Poisson, more = bursts), from the window's "
        "first-token counts per scrape interval.",
    )


class TuningStatus(StatusModel):
    """The tuner's persistent state: enough to resume after an operator restart."""

    phase: TuningPhase | None = None
    applied: Knobs | None = Field(default=None, description="Knobs in effect now.")
    last_good: Knobs | None = Field(default=None, alias="lastGood")
    candidate: Knobs | None = None
    strategy: Literal["Rolling", "Canary"] | None = Field(
        default=None, description="How the trial in flight runs: on every pod, or one canary."
    )
    recommendation: Recommendation | None = None
    last_decision: DecisionRecord | None = Field(default=None, alias="lastDecision")
    rollout_started_at: Timestamp | None = Field(default=None, alias="rolloutStartedAt")
    verify_until: Timestamp | None = Field(default=None, alias="verifyUntil")
    last_rollout_at: Timestamp | None = Field(default=None, alias="lastRolloutAt")
    rollouts_today: int | None = Field(default=None, alias="rolloutsToday", ge=0)
    rollout_day: date | None = Field(default=None, alias="rolloutDay")
    stable_gpu_memory_utilization: float | None = Field(
        default=None,
        alias="stableGpuMemoryUtilization",
        gt=0,
        le=1,
        description="The highest gpuMemoryUtilization proven stable, at any token budget.",
    )
    proven_memory: list[MemoryProof] = Field(
        default_factory=list,
        alias="provenMemory",
        max_length=MAX_PROOFS,
        description="The memory proven stable: each entry's gpuMemoryUtilization is safe at "
        "its maxNumBatchedTokens and below. A rollout past these is a memory experiment.",
    )
    trials: list[Trial] = Field(default_factory=list, max_length=MAX_TRIALS)
    infeasible: list[InfeasibleConfig] = Field(default_factory=list, max_length=MAX_INFEASIBLE)
    baseline: Measurement | None = Field(
        default=None, description="What lastGood measured: the yardstick for verification."
    )
    calibration: dict[str, float] = Field(
        default_factory=dict,
        max_length=32,
        description="The performance model's fitted parameters for this deployment.",
    )
    peak_rate: float | None = Field(default=None, alias="peakRate", ge=0)
    peak_rate_at: Timestamp | None = Field(default=None, alias="peakRateAt")
    headroom_wait_since: Timestamp | None = Field(default=None, alias="headroomWaitSince")
    analysis: CanaryAnalysis | None = None
    model: ModelCheck | None = None


class ObservedMetrics(StatusModel):
    """The latest snapshot summarised; printer columns read the P95 fields."""

    time: Timestamp | None = None
    window_seconds: float | None = Field(default=None, alias="windowSeconds", ge=0)
    request_rate: float | None = Field(default=None, alias="requestRate", ge=0)
    ttft_p95_ms: float | None = Field(default=None, alias="ttftP95Ms", ge=0)
    itl_p95_ms: float | None = Field(default=None, alias="itlP95Ms", ge=0)
    e2e_p95_ms: float | None = Field(default=None, alias="e2eP95Ms", ge=0)
    ttft_percentile_ms: float | None = Field(
        default=None, alias="ttftPercentileMs", ge=0, description="TTFT at the SLO's percentile."
    )
    itl_percentile_ms: float | None = Field(
        default=None, alias="itlPercentileMs", ge=0, description="ITL at the SLO's percentile."
    )
    kv_cache_usage: float | None = Field(default=None, alias="kvCacheUsage", ge=0, le=1)
    preemption_rate: float | None = Field(default=None, alias="preemptionRate", ge=0)
    running: float | None = Field(default=None, ge=0)
    waiting: float | None = Field(default=None, ge=0)
    slo_met: bool | None = Field(default=None, alias="sloMet")
    knobs: Knobs | None = Field(
        default=None, description="The knobs of the revision these numbers were measured on."
    )


class CapacityStatus(StatusModel):
    """What one replica can carry: the number a replica autoscaler divides the load by."""

    per_replica_rps: float | None = Field(
        default=None,
        alias="perReplicaRps",
        ge=0,
        description="Requests/s one replica serves within the SLO (with the policy's safety "
        "margin) with the applied knobs, from the performance model calibrated on this "
        "deployment's own metrics. Scale on load / perReplicaRps.",
    )
    knobs: Knobs | None = Field(default=None, description="The knobs it is for.")
    source: Literal["Model", "Verified", "Trial"] | None = Field(
        default=None,
        description="Model: predicted for the applied knobs from the latest window. Verified: "
        "measured when these knobs were committed (until the next window is judged). Trial: "
        "while a trial runs: during a canary, the count's pods weighted (a canary pod that takes "
        "a stable pod's place at the lower of its capacity and the last good knobs'; a surge "
        "canary pod adds nothing); during a rolling trial or a promotion, the lower of the last "
        "good knobs' and the candidate's.",
    )
    time: Timestamp | None = None


class ScalingStatus(StatusModel):
    """How the replica count moves (an autoscaler, or a person): the tuner holds its verdicts
    while it moves and never judges a window that spans a change."""

    owner: Literal["VLLMDeployment", "Deployment"] | None = Field(
        default=None,
        description="Where the replica count lives: spec.replicas of the VLLMDeployment, or the "
        "owned Deployment's (an autoscaler on it; the operator leaves it alone).",
    )
    replicas: int | None = Field(default=None, ge=0, description="The count asked for now.")
    previous_replicas: int | None = Field(
        default=None, alias="previousReplicas", ge=0, description="The count before the change."
    )
    changed_at: Timestamp | None = Field(
        default=None, alias="changedAt", description="When the operator saw the count change."
    )
    settled_at: Timestamp | None = Field(
        default=None,
        alias="settledAt",
        description="When the pods reached the count after the change (absent while it moves).",
    )


class HandledRequests(StatusModel):
    """The one-shot requests (annotations vllm.autotuner.io/promote, abort, retry) the operator
    has acted on, by their values: a request whose value is here is never acted on again."""

    promote: str | None = Field(default=None, max_length=64)
    abort: str | None = Field(default=None, max_length=64)
    retry: str | None = Field(default=None, max_length=64)


class VLLMDeploymentStatus(StatusModel):
    """Written by the operator only (GitOps: the spec stays the user's)."""

    observed_generation: int | None = Field(default=None, alias="observedGeneration", ge=0)
    conditions: list[Condition] = conditions_field()
    replicas: int | None = Field(
        default=None, ge=0, description="Pods now, stable and canary (the scale subresource's)."
    )
    selector: str | None = Field(
        default=None,
        max_length=1024,
        description="Label selector of every pod (the scale subresource's, for HPA and KEDA).",
    )
    ready_replicas: int | None = Field(default=None, alias="readyReplicas", ge=0)
    updated_replicas: int | None = Field(default=None, alias="updatedReplicas", ge=0)
    policy: str | None = Field(default=None, max_length=253, description="Resolved policy name.")
    mode: Mode | None = Field(default=None, description="Effective mode after the policy's cap.")
    tuning: TuningStatus | None = None
    observed: ObservedMetrics | None = None
    paused: bool | None = Field(
        default=None,
        description="Tuning is paused by the annotation vllm.autotuner.io/pause: nothing is "
        "rolled out until it is removed.",
    )
    handled_requests: HandledRequests | None = Field(default=None, alias="handledRequests")
    capacity: CapacityStatus | None = None
    scaling: ScalingStatus | None = None


class VLLMTuningPolicyStatus(StatusModel):
    """A policy reports whether it is usable (condition Valid)."""

    observed_generation: int | None = Field(default=None, alias="observedGeneration", ge=0)
    conditions: list[Condition] = conditions_field()
