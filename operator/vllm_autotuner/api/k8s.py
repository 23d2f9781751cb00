"""Typed Kubernetes sub-objects a VLLMDeployment passes to its pod: scheduling, env, volumes.

They used to be free-form (``x-kubernetes-preserve-unknown-fields``), which let one object carry
any depth and any shape: a ``placement.affinity`` nested a few thousand levels deep was admitted
by the API server and then made the operator's watch fail to decode it, for every tenant
(docs/security.md, T8). Typed, every field has a known depth, every list a ``maxItems`` and every
string a ``maxLength``, unknown fields are pruned by the API server and refused by these models,
and values the API server would refuse for the rendered Deployment (invalid label keys,
quantities, names) are refused here first, with the field's path.

The models cover the fields of core/v1 that an inference pod uses; they render back to exactly
the Kubernetes JSON (``to_k8s``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from vllm_autotuner.api.common import (
    QUALIFIED_NAME_PATTERN,
    LabelKey,
    LabelSelector,
    LabelValue,
    QualifiedName,
    Rule,
    SpecModel,
    cel,
    cel_literal,
    prefix_fits,
)

# ---------------------------------------------------------------------------- names and values

DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
"""RFC 1123 label: volume names, and (with a leading letter) Service names."""
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
QUANTITY_PATTERN = (
    r"^[+]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""resource.Quantity without a sign (a negative request or limit is refused by the API server)."""
ABSOLUTE_PATH_PATTERN = r"^/[^\x00-\x1f\x7f]*$"
RELATIVE_PATH_PATTERN = r"^[^/\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"
PRINTABLE_PATTERN = r"^[^\x00-\x1f\x7f]*$"
NO_DOTDOT = Rule(
    rule=f"!self.matches({cel_literal('(^|/)[.][.](/|$)')})",
    message="must not contain a '..' path element",
)


def _no_dotdot(path: str) -> str:
    if ".." in path.split("/"):
        raise ValueError(NO_DOTDOT.message)
    return path


DnsLabel = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)]
DnsSubdomain = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
ResourceName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=317,
        pattern=QUALIFIED_NAME_PATTERN,
        description="resource name (cpu, memory, nvidia.com/gpu)",
    ),
    AfterValidator(prefix_fits),
]
ShortText = Annotated[str, Field(max_length=1024, pattern=PRINTABLE_PATTERN)]

QUANTITY_VALID = Rule(
    rule=f"type(self) == int ? self >= 0 : self.matches({cel_literal(QUANTITY_PATTERN)})",
    message="must be a non-negative quantity such as 500m, 8, 16Gi or 1.5G",
)
_QUANTITY = re.compile(QUANTITY_PATTERN)


def _quantity(value: int | str) -> int | str:
    if isinstance(value, bool) or (isinstance(value, int) and value < 0):
        raise ValueError(QUANTITY_VALID.message)
    if isinstance(value, str) and not _QUANTITY.fullmatch(value):
        raise ValueError(QUANTITY_VALID.message)
    return value


# OpenAPI keywords, not CEL: kube-apiserver estimates a CEL rule on an int-or-string as if the
# string could fill a whole request (it ignores maxLength there), and the regex over the maps
# and lists of quantities then exceeds the CRD's cost budget more than 100 times. `pattern`,
# `minimum` and `maxLength` each apply to their own type, as in controller-gen's Quantity.
Quantity = Annotated[
    int | Annotated[str, Field(max_length=64)],
    AfterValidator(_quantity),
    Field(
        json_schema_extra={
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
            "minimum": 0,
            "maxLength": 64,
        }
    ),
]

_SUFFIXES: dict[str, int | Decimal] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip


def quantity_value(value: int | str) -> Decimal:
    """A Kubernetes quantity as a number (``16Gi`` -> 17179869184), to compare two of them."""
    if isinstance(value, int):
        return Decimal(value)
    text = value.lstrip("+")
    number = text.rstrip("KMGTPEinumk")
    suffix = text[len(number) :]
    try:
        if suffix in _SUFFIXES and not re.search(r"[eE]", number):
            return Decimal(number) * Decimal(_SUFFIXES[suffix])
        return Decimal(text)
    except (InvalidOperation, KeyError):
        raise ValueError(QUANTITY_VALID.message) from None


class K8sModel(SpecModel):
    """A core/v1 sub-object: unknown fields refused, rendered back with Kubernetes' names."""

    def to_k8s(self) -> dict[str, Any]:
        dumped: dict[str, Any] = _without_empty(self.model_dump(by_alias=True, exclude_none=True))
        return dumped


def _without_empty(value: Any) -> Any:
    """Drop empty lists and maps the user never wrote, so the rendered object stays minimal."""
    if isinstance(value, dict):
        return {k: _without_empty(v) for k, v in value.items() if v != [] and v != {}}
    if isinstance(value, list):
        return [_without_empty(v) for v in value]
    return value


def exactly_one(*names: str, what: str) -> Rule:
    """CEL: exactly one of the optional fields ``names`` is set."""
    terms = " + ".join(f"(has(self.{n}) ? 1 : 0)" for n in names)
    message = f"exactly one of {', '.join(names)} must be set {what}"
    return Rule(rule=f"{terms} == 1", message=message)


def _count_set(model: BaseModel, names: tuple[str, ...]) -> int:
    return sum(getattr(model, n) is not None for n in names)


# ---------------------------------------------------------------------------- scheduling

TolerationOperator = Literal["Exists", "Equal"]
TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]
TOLERATION_EXISTS_NO_VALUE = Rule(
    rule="!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
    message="a toleration with operator Exists must not have a value",
)


class Toleration(K8sModel):
    model_config = ConfigDict(json_schema_extra=cel(TOLERATION_EXISTS_NO_VALUE))

    key: QualifiedName | None = None
    operator: TolerationOperator | None = None
    value: LabelValue | None = None
    effect: TaintEffect | None = None
    toleration_seconds: int | None = Field(
        default=None,
        alias="tolerationSeconds",
        ge=0,
        le=315_360_000,  # ten years
    )

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(TOLERATION_EXISTS_NO_VALUE.message)
        return self


NodeOperator = Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]


class NodeSelectorRequirement(K8sModel):
    key: QualifiedName
    operator: NodeOperator
    values: list[LabelValue] = Field(default_factory=list, max_length=64)


class NodeSelectorTerm(K8sModel):
    match_expressions: list[NodeSelectorRequirement] = Field(
        default_factory=list, alias="matchExpressions", max_length=32
    )
    match_fields: list[NodeSelectorRequirement] = Field(
        default_factory=list, alias="matchFields", max_length=32
    )


class NodeSelector(K8sModel):
    node_selector_terms: list[NodeSelectorTerm] = Field(
        alias="nodeSelectorTerms", min_length=1, max_length=16
    )


class PreferredSchedulingTerm(K8sModel):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(K8sModel):
    required: NodeSelector | None = Field(
        default=None, alias="requiredDuringSchedulingIgnoredDuringExecution"
    )
    preferred: list[PreferredSchedulingTerm] = Field(
        default_factory=list, alias="preferredDuringSchedulingIgnoredDuringExecution", max_length=32
    )


class PodAffinityTerm(K8sModel):
    label_selector: LabelSelector | None = Field(default=None, alias="labelSelector")
    namespace_selector: LabelSelector | None = Field(default=None, alias="namespaceSelector")
    namespaces: list[DnsLabel] = Field(default_factory=list, max_length=32)
    topology_key: QualifiedName = Field(alias="topologyKey")
    match_label_keys: list[LabelKey] = Field(
        default_factory=list, alias="matchLabelKeys", max_length=32
    )
    mismatch_label_keys: list[LabelKey] = Field(
        default_factory=list, alias="mismatchLabelKeys", max_length=32
    )


class WeightedPodAffinityTerm(K8sModel):
    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm = Field(alias="podAffinityTerm")


class PodAffinity(K8sModel):
    """podAffinity and podAntiAffinity have the same shape."""

    required: list[PodAffinityTerm] = Field(
        default_factory=list, alias="requiredDuringSchedulingIgnoredDuringExecution", max_length=32
    )
    preferred: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, alias="preferredDuringSchedulingIgnoredDuringExecution", max_length=32
    )


class Affinity(K8sModel):
    node_affinity: NodeAffinity | None = Field(default=None, alias="nodeAffinity")
    pod_affinity: PodAffinity | None = Field(default=None, alias="podAffinity")
    pod_anti_affinity: PodAffinity | None = Field(default=None, alias="podAntiAffinity")


# ---------------------------------------------------------------------------- environment

EnvName = Annotated[str, Field(min_length=1, max_length=256, pattern=ENV_NAME_PATTERN)]
ENV_VALUE_OR_FROM = Rule(
    rule="!(has(self.value) && has(self.valueFrom))",
    message="an env entry has either value or valueFrom, not both",
)


class KeySelector(K8sModel):
    name: DnsSubdomain
    key: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]
    optional: bool | None = None


class ObjectFieldSelector(K8sModel):
    api_version: str | None = Field(default=None, alias="apiVersion", max_length=64)
    field_path: ShortText = Field(alias="fieldPath", min_length=1)


class ResourceFieldSelector(K8sModel):
    container_name: DnsLabel | None = Field(default=None, alias="containerName")
    resource: ShortText = Field(min_length=1)
    divisor: Quantity | None = None


ENV_SOURCE_ONE = exactly_one(
    "secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef", what="in valueFrom"
)


class EnvVarSource(K8sModel):
    model_config = ConfigDict(json_schema_extra=cel(ENV_SOURCE_ONE))

    secret_key_ref: KeySelector | None = Field(default=None, alias="secretKeyRef")
    config_map_key_ref: KeySelector | None = Field(default=None, alias="configMapKeyRef")
    field_ref: ObjectFieldSelector | None = Field(default=None, alias="fieldRef")
    resource_field_ref: ResourceFieldSelector | None = Field(default=None, alias="resourceFieldRef")

    @model_validator(mode="after")
    def _one(self) -> EnvVarSource:
        names = ("secret_key_ref", "config_map_key_ref", "field_ref", "resource_field_ref")
        if _count_set(self, names) != 1:
            raise ValueError(ENV_SOURCE_ONE.message)
        return self


ENV_CHANGES_MEANING: tuple[str, ...] = (
    "VLLM_USE_V1",  # the V0 engine schedules differently (no chunked prefill by default)
    "VLLM_DP_SIZE",
    "VLLM_DP_RANK",
    "VLLM_DP_RANK_LOCAL",
    "VLLM_DP_MASTER_IP",
    "VLLM_DP_MASTER_PORT",
    "VLLM_PP_LAYER_PARTITION",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN",  # a context beyond the model's, past vLLM's own check
    "VLLM_CPU_KVCACHE_SPACE",  # the CPU backend's KV size, in place of the tuned utilisation
    "CUDA_VISIBLE_DEVICES",  # hides GPUs the pod was given: tensor parallelism fails
)
"""Environment variables vLLM reads (vllm/envs.py) that change what the knobs mean."""
ENV_KEEPS_MEANING = Rule(
    rule=f"!(self.name in [{', '.join(cel_literal(n) for n in ENV_CHANGES_MEANING)}])",
    message=(
        f"env must not set {', '.join(ENV_CHANGES_MEANING)}: they change what the tuned"
        " knobs mean (docs/security.md, T9)"
    ),
)


class EnvVar(K8sModel):
    """A value is a string: YAML's ``1`` or ``true`` is refused instead of reaching the API server,
    which refuses the whole Deployment for it."""

    model_config = ConfigDict(json_schema_extra=cel(ENV_VALUE_OR_FROM, ENV_KEEPS_MEANING))

    name: EnvName
    value: Annotated[str, Field(max_length=32768)] | None = None
    value_from: EnvVarSource | None = Field(default=None, alias="valueFrom")

    @model_validator(mode="after")
    def _value_or_from(self) -> EnvVar:
        if self.name in ENV_CHANGES_MEANING:
            raise ValueError(ENV_KEEPS_MEANING.message)
        if self.value is not None and self.value_from is not None:
            raise ValueError(ENV_VALUE_OR_FROM.message)
        return self


class LocalRef(K8sModel):
    name: DnsSubdomain
    optional: bool | None = None


ENV_FROM_ONE = exactly_one("configMapRef", "secretRef", what="in an envFrom entry")


class EnvFromSource(K8sModel):
    model_config = ConfigDict(json_schema_extra=cel(ENV_FROM_ONE))

    prefix: Annotated[str, Field(max_length=253, pattern=ENV_NAME_PATTERN)] | None = None
    config_map_ref: LocalRef | None = Field(default=None, alias="configMapRef")
    secret_ref: LocalRef | None = Field(default=None, alias="secretRef")

    @model_validator(mode="after")
    def _one(self) -> EnvFromSource:
        if _count_set(self, ("config_map_ref", "secret_ref")) != 1:
            raise ValueError(ENV_FROM_ONE.message)
        return self


# ---------------------------------------------------------------------------- volumes

MOUNT_SUBPATH_ONE = Rule(
    rule="!(has(self.subPath) && has(self.subPathExpr))",
    message="subPath and subPathExpr are mutually exclusive",
)
SubPath = Annotated[
    str,
    Field(max_length=1024, pattern=RELATIVE_PATH_PATTERN, json_schema_extra=cel(NO_DOTDOT)),
    AfterValidator(_no_dotdot),
]


class VolumeMount(K8sModel):
    model_config = ConfigDict(json_schema_extra=cel(MOUNT_SUBPATH_ONE))

    name: DnsLabel
    mount_path: Annotated[str, Field(max_length=1024, pattern=ABSOLUTE_PATH_PATTERN)] = Field(
        alias="mountPath"
    )
    read_only: bool | None = Field(default=None, alias="readOnly")
    sub_path: SubPath | None = Field(default=None, alias="subPath")
    sub_path_expr: SubPath | None = Field(default=None, alias="subPathExpr")
    mount_propagation: Literal["None", "HostToContainer", "Bidirectional"] | None = Field(
        default=None, alias="mountPropagation"
    )
    recursive_read_only: Literal["Disabled", "IfPossible", "Enabled"] | None = Field(
        default=None, alias="recursiveReadOnly"
    )

    @model_validator(mode="after")
    def _one_sub_path(self) -> VolumeMount:
        if self.sub_path is not None and self.sub_path_expr is not None:
            raise ValueError(MOUNT_SUBPATH_ONE.message)
        return self


class KeyToPath(K8sModel):
    key: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]
    path: SubPath
    mode: int | None = Field(default=None, ge=0, le=0o777)


class EmptyDirSource(K8sModel):
    medium: Literal["", "Memory"] | None = None
    size_limit: Quantity | None = Field(default=None, alias="sizeLimit")


HostPathType = Literal[
    "", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice",
    "BlockDevice",
]  # fmt: skip


class HostPathSource(K8sModel):
    path: Annotated[str, Field(max_length=1024, pattern=ABSOLUTE_PATH_PATTERN)]
    type: HostPathType | None = None


class PVCSource(K8sModel):
    claim_name: DnsSubdomain = Field(alias="claimName")
    read_only: bool | None = Field(default=None, alias="readOnly")


class ConfigMapSource(K8sModel):
    name: DnsSubdomain
    items: list[KeyToPath] = Field(default_factory=list, max_length=64)
    default_mode: int | None = Field(default=None, alias="defaultMode", ge=0, le=0o777)
    optional: bool | None = None


class SecretSource(K8sModel):
    secret_name: DnsSubdomain = Field(alias="secretName")
    items: list[KeyToPath] = Field(default_factory=list, max_length=64)
    default_mode: int | None = Field(default=None, alias="defaultMode", ge=0, le=0o777)
    optional: bool | None = None


class CSISource(K8sModel):
    driver: DnsSubdomain
    read_only: bool | None = Field(default=None, alias="readOnly")
    fs_type: Annotated[str, Field(max_length=64, pattern=r"^[a-z0-9]*$")] | None = Field(
        default=None, alias="fsType"
    )
    volume_attributes: dict[str, ShortText] = Field(
        default_factory=dict, alias="volumeAttributes", max_length=64
    )
    node_publish_secret_ref: LocalRef | None = Field(default=None, alias="nodePublishSecretRef")


class NFSSource(K8sModel):
    server: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:\[\]-]+$")]
    path: Annotated[str, Field(max_length=1024, pattern=ABSOLUTE_PATH_PATTERN)]
    read_only: bool | None = Field(default=None, alias="readOnly")


class ImageSource(K8sModel):
    """An OCI image as a read-only volume (Kubernetes 1.31+): model weights shipped as an image."""

    reference: Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\s]+$")]
    pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, alias="pullPolicy"
    )


class ClaimResources(K8sModel):
    requests: dict[ResourceName, Quantity] = Field(default_factory=dict, max_length=8)
    limits: dict[ResourceName, Quantity] = Field(default_factory=dict, max_length=8)


class ClaimSpec(K8sModel):
    access_modes: list[
        Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]
    ] = Field(alias="accessModes", min_length=1, max_length=4)
    storage_class_name: DnsSubdomain | None = Field(default=None, alias="storageClassName")
    volume_mode: Literal["Filesystem", "Block"] | None = Field(default=None, alias="volumeMode")
    resources: ClaimResources


class ClaimMetadata(K8sModel):
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    annotations: dict[LabelKey, Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=32
    )


class ClaimTemplate(K8sModel):
    metadata: ClaimMetadata | None = None
    spec: ClaimSpec


class EphemeralSource(K8sModel):
    volume_claim_template: ClaimTemplate = Field(alias="volumeClaimTemplate")


VOLUME_SOURCES = (
    "emptyDir", "hostPath", "persistentVolumeClaim", "configMap", "secret", "csi", "nfs",
    "image", "ephemeral",
)  # fmt: skip
VOLUME_SOURCE_ONE = exactly_one(*VOLUME_SOURCES, what="in a volume")


class Volume(K8sModel):
    """A pod volume with one of the sources inference pods use (weights, caches, secrets)."""

    model_config = ConfigDict(json_schema_extra=cel(VOLUME_SOURCE_ONE))

    name: DnsLabel
    empty_dir: EmptyDirSource | None = Field(default=None, alias="emptyDir")
    host_path: HostPathSource | None = Field(default=None, alias="hostPath")
    persistent_volume_claim: PVCSource | None = Field(default=None, alias="persistentVolumeClaim")
    config_map: ConfigMapSource | None = Field(default=None, alias="configMap")
    secret: SecretSource | None = None
    csi: CSISource | None = None
    nfs: NFSSource | None = None
    image: ImageSource | None = None
    ephemeral: EphemeralSource | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Volume:
        fields = tuple(n for n in type(self).model_fields if n != "name")
        if _count_set(self, fields) != 1:
            raise ValueError(VOLUME_SOURCE_ONE.message)
        return self


# ---------------------------------------------------------------------------- resources


class ResourceRequirements(K8sModel):
    """Extra requests and limits (cpu, memory, ...); the GPUs come from spec.gpu."""

    requests: dict[ResourceName, Quantity] = Field(default_factory=dict, max_length=16)
    limits: dict[ResourceName, Quantity] = Field(default_factory=dict, max_length=16)

    @model_validator(mode="after")
    def _requests_within_limits(self) -> ResourceRequirements:
        for name, request in self.requests.items():
            limit = self.limits.get(name)
            if limit is not None and quantity_value(request) > quantity_value(limit):
                raise ValueError(
                    f"the request for {name} ({request}) must not exceed its limit ({limit})"
                )
        return self
