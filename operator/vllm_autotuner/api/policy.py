"""The platform team's kind: ``VLLMTuningPolicy`` (cluster-scoped).

A policy bounds what the tuner may do (knob ranges and step sizes), how often and when it may
roll out, how much evidence it needs, and which SLO the deployments must meet.
"""

from __future__ import annotations

from typing import Annotated, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from vllm_autotuner.api.common import (
    GMU_MAX,
    MNBT_MAX,
    MNS_MAX,
    MODES,
    GpuMemoryUtilization,
    LabelSelector,
    Mode,
    PolicySLO,
    Rule,
    SpecModel,
    cel,
    section,
)
from vllm_autotuner.api.durations import Duration, duration_seconds

MIN_LE_MAX = Rule(
    rule="!has(self.min) || !has(self.max) || self.min <= self.max",
    message="min must be <= max",
)
WINDOW_START_NE_END = Rule(
    rule="self.start != self.end",
    message="a maintenance window needs start != end (end < start spans midnight)",
)
DURATION_POSITIVE = Rule(
    rule="duration(self) > duration('0s')",
    message="duration must be greater than zero",
)
BUDGET_COVERS_SEQS = Rule(
    rule=(
        "!has(self.maxNumBatchedTokens) || !has(self.maxNumSeqs)"
        " || !has(self.maxNumBatchedTokens.max) || !has(self.maxNumSeqs.min)"
        " || self.maxNumBatchedTokens.max >= self.maxNumSeqs.min"
    ),
    message=(
        "bounds.maxNumBatchedTokens.max must be >= bounds.maxNumSeqs.min: vLLM refuses to start"
        " with fewer batched tokens than sequences, so no configuration would be allowed"
    ),
)
VERIFY_COVERS_WINDOW = Rule(
    rule=(
        "!has(self.rollout) || !has(self.rollout.verifyWindow) || !has(self.evaluationWindow)"
        " || duration(self.rollout.verifyWindow) >= duration(self.evaluationWindow)"
    ),
    message="rollout.verifyWindow must be >= evaluationWindow (a verdict needs a full window)",
    field_path=".rollout.verifyWindow",
)

DEFAULT_MNBT = (256, 32768, 8192)
"""256 keeps ITL low on small models; 32768 is 2x vLLM's largest default tier (16384,
vLLM arg_utils.py); one step may move at most a default tier's worth (8192)."""
DEFAULT_MNS = (8, 1024, 256)
"""1024 is vLLM's default on H100/H200/B200 (vLLM arg_utils.py); a step is one A100-tier default."""
DEFAULT_GMU = (0.5, 0.95, 0.03)
"""0.95 leaves headroom over vLLM's 0.92 default; 0.03 steps keep OOM probes small."""


def _check_min_max(lo: float, hi: float) -> None:
    if lo > hi:
        raise ValueError(MIN_LE_MAX.message)


class MaxNumBatchedTokensBounds(SpecModel):
    """Range and largest single step for --max-num-batched-tokens."""

    model_config = ConfigDict(json_schema_extra=cel(MIN_LE_MAX))

    min: int = Field(default=DEFAULT_MNBT[0], ge=1, le=MNBT_MAX)
    max: int = Field(default=DEFAULT_MNBT[1], ge=1, le=MNBT_MAX)
    max_step: int = Field(default=DEFAULT_MNBT[2], gt=0, le=MNBT_MAX, alias="maxStep")

    @model_validator(mode="after")
    def _ordered(self) -> MaxNumBatchedTokensBounds:
        _check_min_max(self.min, self.max)
        return self


class MaxNumSeqsBounds(SpecModel):
    """Range and largest single step for --max-num-seqs."""

    model_config = ConfigDict(json_schema_extra=cel(MIN_LE_MAX))

    min: int = Field(default=DEFAULT_MNS[0], ge=1, le=MNS_MAX)
    max: int = Field(default=DEFAULT_MNS[1], ge=1, le=MNS_MAX)
    max_step: int = Field(default=DEFAULT_MNS[2], gt=0, le=MNS_MAX, alias="maxStep")

    @model_validator(mode="after")
    def _ordered(self) -> MaxNumSeqsBounds:
        _check_min_max(self.min, self.max)
        return self


class GpuMemoryUtilizationBounds(SpecModel):
    """Range and largest single step for --gpu-memory-utilization (steps only go up slowly)."""

    model_config = ConfigDict(json_schema_extra=cel(MIN_LE_MAX))

    min: GpuMemoryUtilization = Field(default=DEFAULT_GMU[0])
    max: GpuMemoryUtilization = Field(default=DEFAULT_GMU[1])
    max_step: float = Field(default=DEFAULT_GMU[2], gt=0, le=GMU_MAX, alias="maxStep")

    @model_validator(mode="after")
    def _ordered(self) -> GpuMemoryUtilizationBounds:
        _check_min_max(self.min, self.max)
        return self


class KnobBounds(SpecModel):
    """Where the tuner may search."""

    model_config = ConfigDict(json_schema_extra=cel(BUDGET_COVERS_SEQS))

    max_num_batched_tokens: MaxNumBatchedTokensBounds = section(
        MaxNumBatchedTokensBounds, alias="maxNumBatchedTokens"
    )
    max_num_seqs: MaxNumSeqsBounds = section(MaxNumSeqsBounds, alias="maxNumSeqs")
    gpu_memory_utilization: GpuMemoryUtilizationBounds = section(
        GpuMemoryUtilizationBounds, alias="gpuMemoryUtilization"
    )

    @model_validator(mode="after")
    def _budget_covers_seqs(self) -> KnobBounds:
        if self.max_num_batched_tokens.max < self.max_num_seqs.min:
            raise ValueError(BUDGET_COVERS_SEQS.message)
        return self


Weekday = Literal["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
CLOCK_PATTERN = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"


class MaintenanceWindow(SpecModel):
    """A daily time range in which rollouts may start."""

    model_config = ConfigDict(json_schema_extra=cel(WINDOW_START_NE_END))

    days: list[Weekday] = Field(
        default_factory=list,
        max_length=7,
        description="Days the window opens; empty means every day.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    start: str = Field(pattern=CLOCK_PATTERN, max_length=5, description="HH:MM, 24-hour clock.")
    end: str = Field(pattern=CLOCK_PATTERN, max_length=5, description="HH:MM; may be < start.")
    timezone: str = Field(
        default="UTC",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_+\-/]+$",
        description="IANA time zone name.",
    )

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, tz: str) -> str:
        # The pattern admits any path-like name; only a zone the tz database knows can be used
        # to place a window (an unknown one would fail at the first rollout, not at admission).
        try:
            ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown IANA time zone {tz!r} (e.g. UTC, Europe/Paris)") from None
        return tz

    @field_validator("days")
    @classmethod
    def _unique_days(cls, days: list[str]) -> list[str]:
        if len(set(days)) != len(days):
            raise ValueError("days must not repeat")
        return days

    @model_validator(mode="after")
    def _not_empty(self) -> MaintenanceWindow:
        if self.start == self.end:
            raise ValueError(WINDOW_START_NE_END.message)
        return self


def _positive_duration(text: str) -> str:
    if duration_seconds(text) <= 0:
        raise ValueError(DURATION_POSITIVE.message)
    return text


PositiveDuration = Annotated[
    Duration, AfterValidator(_positive_duration), Field(json_schema_extra=cel(DURATION_POSITIVE))
]


class RolloutPolicy(SpecModel):
    """How often, when and how carefully changes are rolled out."""

    min_interval: Duration = Field(
        default="15m", alias="minInterval", description="Least time between two rollouts."
    )
    max_per_day: int = Field(default=8, ge=0, le=1000, alias="maxPerDay")
    maintenance_windows: list[MaintenanceWindow] = Field(
        default_factory=list,
        alias="maintenanceWindows",
        max_length=32,
        description="When rollouts may start; empty means any time.",
    )
    verify_window: PositiveDuration = Field(
        default="10m",
        alias="verifyWindow",
        description="How long a candidate is watched before it is committed.",
    )
    ready_timeout: PositiveDuration = Field(
        default="20m",
        alias="readyTimeout",
        description="How long new pods may take to become ready (model load included).",
    )
    headroom_timeout: PositiveDuration = Field(
        default="1h",
        alias="headroomTimeout",
        description="How long a rollout may wait for the pods that stay to have room for the "
        "traffic while one restarts (without surge). A violated SLO goes earlier, once the "
        "gain lost by waiting equals the overload's cost; past this bound a rollout that may "
        "not go is given up.",
    )


class VLLMTuningPolicySpec(SpecModel):
    """The platform team's limits for every deployment that refers to this policy."""

    model_config = ConfigDict(json_schema_extra=cel(VERIFY_COVERS_WINDOW))

    slo: PolicySLO
    bounds: KnobBounds = section(KnobBounds)
    rollout: RolloutPolicy = section(RolloutPolicy)
    min_requests_per_window: int = Field(
        default=200,
        ge=0,
        le=100_000_000,
        alias="minRequestsPerWindow",
        description="Fewer requests than this in a window means no decision (not enough evidence).",
    )
    evaluation_window: PositiveDuration = Field(
        default="5m",
        alias="evaluationWindow",
        description="Length of the metrics window a decision is based on.",
    )
    allowed_modes: list[Mode] = Field(
        default_factory=lambda: list(MODES),
        alias="allowedModes",
        min_length=1,
        max_length=3,
        json_schema_extra={"x-kubernetes-list-type": "set", "default": list(MODES)},
    )
    namespace_selector: LabelSelector = Field(
        default_factory=LabelSelector,
        alias="namespaceSelector",
        description="Namespaces whose deployments may use this policy; empty means all.",
    )

    @field_validator("allowed_modes")
    @classmethod
    def _unique_modes(cls, modes: list[Mode]) -> list[Mode]:
        if len(set(modes)) != len(modes):
            raise ValueError("allowedModes must not repeat")
        return modes

    @model_validator(mode="after")
    def _verify_covers_window(self) -> VLLMTuningPolicySpec:
        if duration_seconds(self.rollout.verify_window) < duration_seconds(self.evaluation_window):
            raise ValueError(VERIFY_COVERS_WINDOW.message)
        return self
