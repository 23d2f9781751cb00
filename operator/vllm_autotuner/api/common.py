"""Building blocks shared by both kinds: the tuned knobs, SLOs, label selectors, conditions.

Every cross-field rule exists twice on purpose: as a CEL rule in the CRD (so ``kubectl apply``
and Argo CD fail early) and as a pydantic validator (so the operator never acts on an object
that slipped past an older CRD). Both raise the same ``Rule.message``, and the tests check that
they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, model_validator


@dataclass(frozen=True)
class Rule:
    """One ``x-kubernetes-validations`` entry; ``message`` is also the pydantic error text."""

    rule: str
    message: str
    field_path: str | None = None
    reason: str | None = None

    def as_schema(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path is not None:
            out["fieldPath"] = self.field_path
        if self.reason is not None:
            out["reason"] = self.reason
        return out


def cel_literal(text: str) -> str:
    """``text`` as a single-quoted CEL string literal (backslashes and quotes escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def cel(*rules: Rule) -> dict[str, Any]:
    """The ``json_schema_extra`` that carries rules into the generated CRD."""
    return {"x-kubernetes-validations": [r.as_schema() for r in rules]}


def section(factory: Any, description: str | None = None, alias: str | None = None) -> Any:
    """A sub-object that always exists: ``default: {}`` lets the API server fill its defaults."""
    return Field(
        default_factory=factory,
        alias=alias,
        description=description,
        json_schema_extra={"default": {}},
    )


class SpecModel(BaseModel):
    """Spec objects reject unknown fields: a typo in Git should fail, not be ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StatusModel(BaseModel):
    """Status objects ignore unknown fields so an older operator can read a newer one's status."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


Mode = Literal["Off", "Recommend", "Auto"]
MODES: tuple[Mode, ...] = ("Off", "Recommend", "Auto")

GMU_MAX = 0.99
"""vLLM accepts (0, 1]; above 0.99 nothing is left for activations, CUDA graphs or NCCL."""
GMU_MIN = 0.01
"""vLLM refuses 0, and ``--gpu-memory-utilization`` is rendered with three decimals: a smaller
value would be written as 0.0. Below 1% of a GPU no model's weights fit anyway."""

MNBT_MAX = 1_048_576
MNS_MAX = 65_536

MaxNumBatchedTokens = Annotated[int, Field(ge=1, le=MNBT_MAX)]
MaxNumSeqs = Annotated[int, Field(ge=1, le=MNS_MAX)]
GpuMemoryUtilization = Annotated[float, Field(ge=GMU_MIN, le=GMU_MAX)]


class Knobs(StatusModel):
    """The three values the tuner moves; any subset may be known at a given moment."""

    max_num_batched_tokens: MaxNumBatchedTokens | None = Field(
        default=None, alias="maxNumBatchedTokens", description="--max-num-batched-tokens"
    )
    max_num_seqs: MaxNumSeqs | None = Field(
        default=None, alias="maxNumSeqs", description="--max-num-seqs"
    )
    gpu_memory_utilization: GpuMemoryUtilization | None = Field(
        default=None, alias="gpuMemoryUtilization", description="--gpu-memory-utilization"
    )


MNBT_GE_MNS = Rule(
    rule=(
        "!has(self.maxNumBatchedTokens) || !has(self.maxNumSeqs)"
        " || self.maxNumBatchedTokens >= self.maxNumSeqs"
    ),
    message="maxNumBatchedTokens must be >= maxNumSeqs (vLLM refuses to start otherwise)",
)


class KnobsSpec(Knobs):
    """Knobs a user pins; unset ones come from the tuner or from vLLM's per-GPU defaults."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=cel(MNBT_GE_MNS))

    @model_validator(mode="after")
    def _mnbt_ge_mns(self) -> KnobsSpec:
        mnbt, mns = self.max_num_batched_tokens, self.max_num_seqs
        if mnbt is not None and mns is not None and mnbt < mns:
            raise ValueError(MNBT_GE_MNS.message)
        return self


Percentile = Annotated[float, Field(ge=50, le=99.9)]
ThresholdMs = Annotated[float, Field(gt=0, le=3_600_000)]


class LatencyObjective(SpecModel):
    """A latency target: the given percentile must stay under ``thresholdMs``."""

    percentile: Percentile = Field(default=95.0, description="Percentile, 50..99.9.")
    threshold_ms: ThresholdMs = Field(alias="thresholdMs", description="Milliseconds.")


class LatencyObjectiveOverride(SpecModel):
    """A deployment's override of a policy objective; unset parts inherit from the policy."""

    percentile: Percentile | None = Field(default=None, description="Percentile, 50..99.9.")
    threshold_ms: ThresholdMs | None = Field(
        default=None, alias="thresholdMs", description="Milliseconds."
    )


TargetAttainment = Annotated[float, Field(gt=0, le=1)]


class PolicySLO(SpecModel):
    """The platform team's SLO; deployments may only tighten it."""

    ttft: LatencyObjective = Field(description="Time to first token.")
    itl: LatencyObjective = Field(description="Inter-token latency.")
    e2e: LatencyObjective | None = Field(default=None, description="End-to-end request latency.")
    target_attainment: TargetAttainment | None = Field(
        default=None,
        alias="targetAttainment",
        description="Fraction of evaluation windows that must meet the SLO (0..1].",
    )


class SLOOverrides(SpecModel):
    """Per-deployment tightening of the policy's SLO; the operator rejects loosening."""

    ttft: LatencyObjectiveOverride | None = None
    itl: LatencyObjectiveOverride | None = None
    e2e: LatencyObjectiveOverride | None = None
    target_attainment: TargetAttainment | None = Field(default=None, alias="targetAttainment")


QUALIFIED_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
"""A label or annotation key, a resource name, a topology key: ``[prefix/]name``."""
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"


def prefix_fits(key: str) -> str:
    """The prefix of a qualified name is a DNS subdomain of at most 253 characters."""
    if "/" in key and len(key.split("/", 1)[0]) > 253:
        raise ValueError("the prefix of a qualified name must be at most 253 characters")
    return key


QualifiedName = Annotated[
    str,
    Field(min_length=1, max_length=317, pattern=QUALIFIED_NAME_PATTERN),
    AfterValidator(prefix_fits),
]
LabelKey = Annotated[
    str,
    Field(
        min_length=1,
        max_length=317,
        pattern=QUALIFIED_NAME_PATTERN,
        description="label key ([prefix/]name)",
    ),
    AfterValidator(prefix_fits),
]
"""A map key: the CRD checks it with a CEL rule on the map (OpenAPI has no key schema)."""
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]

SELECTOR_VALUES_PRESENT = Rule(
    rule=(
        "self.operator in ['In', 'NotIn']"
        " ? (has(self.values) && size(self.values) > 0)"
        " : (!has(self.values) || size(self.values) == 0)"
    ),
    message="values must be non-empty for In and NotIn, and empty for Exists and DoesNotExist",
)


class LabelSelectorRequirement(SpecModel):
    """metav1.LabelSelectorRequirement."""

    model_config = ConfigDict(json_schema_extra=cel(SELECTOR_VALUES_PRESENT))

    key: QualifiedName
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[LabelValue] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _values_match_operator(self) -> LabelSelectorRequirement:
        wants_values = self.operator in ("In", "NotIn")
        if wants_values != bool(self.values):
            raise ValueError(SELECTOR_VALUES_PRESENT.message)
        return self


class LabelSelector(SpecModel):
    """metav1.LabelSelector; an empty selector matches everything."""

    match_labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, alias="matchLabels", max_length=64
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, alias="matchExpressions", max_length=32
    )


CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"

ConditionType = Literal[
    "Ready", "Tuning", "SLOMet", "MetricsAvailable", "Degraded", "PolicyResolved"
]


class Condition(StatusModel):
    """metav1.Condition, field for field, so kubectl, kstatus and Argo CD read it natively."""

    type: str = Field(max_length=316, pattern=CONDITION_TYPE_PATTERN)
    status: Literal["True", "False", "Unknown"]
    observed_generation: int | None = Field(default=None, alias="observedGeneration", ge=0)
    last_transition_time: AwareDatetime = Field(alias="lastTransitionTime")
    reason: str = Field(min_length=1, max_length=1024, pattern=CONDITION_REASON_PATTERN)
    message: str = Field(default="", max_length=32768)


def conditions_field() -> Any:
    """Conditions as a map-list keyed by type, as metav1 declares them."""
    return Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


Timestamp = AwareDatetime
"""Timezone-aware on purpose: a naive datetime would serialize without an offset (not RFC 3339)."""
