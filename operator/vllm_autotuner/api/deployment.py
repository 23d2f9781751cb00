"""The app team's kind: ``VLLMDeployment`` (namespaced).

The spec describes what to serve and how; the three tuned knobs are optional pins. Everything the
operator renders itself (model, port, parallelism, the knobs, and the engine fields below) must not
be set again through ``engine.extraArgs``: vLLM would take the last occurrence and silently undo
the tuner or the operator.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from vllm_autotuner.api.common import (
    MODES,
    KnobsSpec,
    LabelKey,
    LabelValue,
    Mode,
    QualifiedName,
    Rule,
    SLOOverrides,
    SpecModel,
    cel,
    cel_literal,
    section,
)
from vllm_autotuner.api.k8s import (
    Affinity,
    EnvFromSource,
    EnvVar,
    ResourceRequirements,
    Toleration,
    Volume,
    VolumeMount,
)

DEFAULT_IMAGE = "vllm/vllm-openai:v0.33.0"

MODEL_PATTERN = r"^[A-Za-z0-9./][A-Za-z0-9._~:/@+=%,-]*$"
"""HF ids ("org/name"), local paths ("/models/x") and URLs ("s3://b/k"): no whitespace, quotes,
backslashes or braces, because the value becomes a CLI argument and a PromQL label value."""

SERVED_MODEL_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._:/-]*[A-Za-z0-9])?$"
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
NO_WHITESPACE_PATTERN = r"^[^\s]+$"
EXTRA_ARG_PATTERN = r"^[ -~]*$"
"""Printable ASCII: no NUL, CR or LF (a second argument in disguise), no escape sequences,
bidirectional overrides or line separators that make a log or `kubectl get` lie."""
PERCENT_OR_INT_PATTERN = r"^(100|[1-9]?[0-9])%$"

OWNED_FLAGS: tuple[str, ...] = (
    # rendered from the spec
    "model",
    "served-model-name",
    "host",
    "port",
    "tensor-parallel-size",
    "max-model-len",
    "dtype",
    "kv-cache-dtype",
    "enable-prefix-caching",
    "no-enable-prefix-caching",
    "block-size",
    "shutdown-timeout",  # the drain of every restart (spec.rollout.shutdownTimeoutSeconds)
    # the tuned knobs, their aliases, and flags that silently override them (vLLM arg_utils.py)
    "max-num-batched-tokens",
    "max-num-scheduled-tokens",
    "max-num-seqs",
    "gpu-memory-utilization",
    "device-memory-utilization",
    "kv-cache-memory-bytes",
    "kv-cache-memory",
    "num-gpu-blocks-override",  # fixes the KV cache size whatever gpu-memory-utilization says
    "max-num-active-seqs",  # caps the running set below the tuned max-num-seqs
)
"""Flags without the leading dashes. vLLM's parser also accepts underscores (--max_num_seqs)."""

SHORT_OWNED_FLAGS: tuple[str, ...] = ("tp",)
"""vLLM's short alias -tp for --tensor-parallel-size."""

CONFIG_FLAG = "config"
"""``vllm serve --config FILE`` turns the keys of a YAML file into flags, so the file could set
any owned flag (``kv_cache_memory_bytes`` makes vLLM ignore the tuned --gpu-memory-utilization);
extraArgs may not name it, or abbreviate it, any more than an owned flag."""


def _any_prefix(names: tuple[str, ...]) -> str:
    """RE2 (and Python) syntax for any non-empty prefix of any of ``names``.

    vLLM's parser is argparse with ``allow_abbrev``: an unambiguous prefix of a long option
    selects it (``--max-num-seq=1`` sets --max-num-seqs), and which prefixes are unambiguous
    depends on every flag of the running vLLM version, which the operator cannot know. So every
    prefix is refused, down to one letter; no vLLM flag we know of is itself a prefix of an
    owned one (the old ``--device`` was, and without it ``--device`` would abbreviate
    --device-memory-utilization). Built as a trie with nested optional groups, so the pattern
    grows with the total length of the names, not with the number of prefixes. A dash also
    matches an underscore: vLLM turns underscores in flag names into dashes before parsing.
    """
    trie: dict[str, Any] = {}
    for name in names:
        if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name):
            raise ValueError(f"not a flag name: {name!r}")  # keeps the CEL literal escape-free
        node = trie
        for char in name:
            node = node.setdefault(char, {})

    def branches(node: dict[str, Any]) -> str:
        out = []
        for char, child in sorted(node.items()):
            atom = "[-_]" if char == "-" else char
            out.append(atom + (f"(?:{branches(child)})?" if child else ""))
        return "|".join(out)

    return branches(trie)


def flag_pattern(long_names: tuple[str, ...], short_flags: tuple[str, ...] = ()) -> str:
    """Long options: ``--`` then a name that abbreviates one of ``long_names``, ended by
    the end of the argument, ``=`` (its value) or ``.`` (vLLM's dotted form --flag.key=value,
    which passes the key before the dot as the flag). Short options: anything that starts like
    one (``-tp``, ``-tp=8``, ``-tp8``, and ``-t``, which argparse resolves to -tp)."""
    pattern = f"^(?:--(?:{_any_prefix(long_names)})(?:[=.]|$)"
    if short_flags:
        pattern += f"|-(?:{'|'.join(sorted({f[0] for f in short_flags}))})"
    return pattern + ")"


def _python(pattern: str) -> re.Pattern[str]:
    # RE2's `$` is the end of the text; Python's also matches before a final newline, so Python
    # reads it as \Z and both engines give the same answer for every string.
    return re.compile(pattern.replace("$", r"\Z"))


OWNED_FLAG_PATTERN = flag_pattern((*OWNED_FLAGS, CONFIG_FLAG), SHORT_OWNED_FLAGS)
_OWNED_FLAG = _python(OWNED_FLAG_PATTERN)

CHANGES_MEANING_FLAGS: tuple[str, ...] = (
    # chunked prefill off: every prompt must then fit in one step, so vLLM refuses a token
    # budget below max-model-len, and the tuner's budget would no longer bound a step
    "no-enable-chunked-prefill",
    # concurrent partial prefills: split the budget between prompts by a second threshold
    "long-prefill-token-threshold",
    "max-num-partial-prefills",
    "max-long-partial-prefills",
    # data and pipeline parallelism: more GPUs than spec.gpu.count asks for, and one engine
    # per rank with its own copy of every tuned knob
    "data-parallel-size",
    "data-parallel-size-local",
    "data-parallel-rank",
    "data-parallel-start-rank",
    "data-parallel-address",
    "data-parallel-rpc-port",
    "data-parallel-backend",
    "data-parallel-hybrid-lb",
    "data-parallel-external-lb",
    "pipeline-parallel-size",
    # rewrites the model's config (heads, context, layers): the KV cache per token changes
    "hf-overrides",
    # another scheduler, or several steps per schedule: the budget means something else
    "scheduler-cls",
    "num-scheduler-steps",
)
"""Flags that change what the tuned knobs mean, or make vLLM refuse values the tuner may
choose (docs/security.md, T9). Refused in extraArgs like the owned ones, prefixes included."""
SHORT_CHANGES_MEANING_FLAGS: tuple[str, ...] = ("dp", "dpl", "dpn", "dpa", "dpp", "dpr", "pp")
"""vLLM's short forms of the data- and pipeline-parallel flags (-dp, -pp ...)."""


FALSE_WORDS = "false|0|no|off|f|n"
KEEPS_MEANING_PATTERN = (
    flag_pattern(CHANGES_MEANING_FLAGS, SHORT_CHANGES_MEANING_FLAGS)
    + f"|^--(?:{_any_prefix(('enable-chunked-prefill',))})=(?i:{FALSE_WORDS})$"
)
_CHANGES_MEANING = _python(KEEPS_MEANING_PATTERN)
_FALSE = re.compile(f"(?i:{FALSE_WORDS})")
_CHUNKED_PREFILL = _python(flag_pattern(("enable-chunked-prefill",)))


def changes_knob_meaning(arg: str, following: str | None = None) -> bool:
    """Whether ``arg`` (followed by the list entry ``following``) turns on a vLLM feature that
    changes what the tuned knobs mean; see CHANGES_MEANING_FLAGS."""
    if _CHANGES_MEANING.search(arg):
        return True
    # vLLM before 0.10 read ``--enable-chunked-prefill false`` (a value in the next entry).
    split_false = following is not None and _FALSE.fullmatch(following) is not None
    return split_false and "=" not in arg and _CHUNKED_PREFILL.search(arg) is not None


_PERCENT = re.compile(PERCENT_OR_INT_PATTERN)


def sets_owned_flag(arg: str) -> bool:
    """Whether vLLM could read ``arg`` as an owned flag, an abbreviation of one, or --config.

    The CRD's CEL rule runs the same pattern (CEL ``matches`` is an unanchored RE2 search, like
    ``re.search`` here), and render() calls this again, so the three checks cannot drift apart.
    A flag's value in the next list element (``["--max-num-seq", "1"]``) is caught by the flag.
    """
    return _OWNED_FLAG.search(arg) is not None


EXTRA_ARG_NOT_OWNED = Rule(
    rule=f"!self.matches('{OWNED_FLAG_PATTERN}')",
    message=(
        "extraArgs must not set flags the operator owns (model, port, host, parallelism, dtype,"
        " block size, prefix caching, max-model-len and the tuned knobs), nor any prefix of one"
        " (vLLM accepts abbreviations), nor --config (a config file could set them);"
        " use the spec fields"
    ),
)
CHILD_NAME_PATTERN = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
CHILD_NAME = Rule(
    rule=(
        f"!has(self.metadata.name) || self.metadata.name.matches({cel_literal(CHILD_NAME_PATTERN)})"
    ),
    message=(
        "metadata.name names the Service and the Deployment: it must be a DNS-1035 label"
        " (lower-case letters, digits and '-', starting with a letter, at most 63 characters)"
    ),
    # No fieldPath: kube-apiserver accepts one only if it names a field of the CRD's schema,
    # and a CRD's schema leaves metadata undeclared.
)
_CHILD_NAME = re.compile(CHILD_NAME_PATTERN)


def child_name_problem(name: str) -> str | None:
    """Why the API server would refuse children named ``name`` (None when it would not)."""
    return None if _CHILD_NAME.fullmatch(name) else f"{CHILD_NAME.message}; got {name[:80]!r}"


SHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
VOLUMES_NOT_RESERVED = Rule(
    rule=f"!has(self.volumes) || self.volumes.all(v, v.name != '{SHM_VOLUME}')",
    message=f"the volume name {SHM_VOLUME} is the operator's own (/dev/shm)",
    field_path=".volumes",
)
MOUNTS_NOT_RESERVED = Rule(
    rule=(
        f"!has(self.volumeMounts) || self.volumeMounts.all(m, m.name != '{SHM_VOLUME}'"
        f" && !m.mountPath.matches('^{SHM_PATH}/*$'))"
    ),
    message="/dev/shm and the volume dshm are the operator's own; use pod.shmSizeGi",
    field_path=".volumeMounts",
)
VOLUME_NAMES_UNIQUE = Rule(
    rule="!has(self.volumes) || self.volumes.all(v, self.volumes.exists_one(w, w.name == v.name))",
    message="volume names must be unique",
    field_path=".volumes",
)
MOUNTS_NAME_VOLUMES = Rule(
    rule=(
        "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes)"
        " && self.volumes.exists(v, v.name == m.name))"
    ),
    message="every volumeMount must name one of pod.volumes",
    field_path=".volumeMounts",
)
MOUNT_PATHS_UNIQUE = Rule(
    rule=(
        "!has(self.volumeMounts) || self.volumeMounts.all(m,"
        " self.volumeMounts.exists_one(n, n.mountPath == m.mountPath))"
    ),
    message="volumeMount paths must be unique",
    field_path=".volumeMounts",
)
EXTRA_ARG_KEEPS_MEANING = Rule(
    rule=f"!self.matches({cel_literal(KEEPS_MEANING_PATTERN)})",
    message=(
        "extraArgs must not set flags that change what the tuned knobs mean (chunked prefill"
        " off, partial prefills, data or pipeline parallelism, --hf-overrides, another"
        " scheduler: docs/security.md, T9), nor any prefix of one"
    ),
)
TP_LE_GPU_COUNT = Rule(
    rule=(
        "!has(self.engine) || !has(self.engine.tensorParallelSize)"
        " || self.engine.tensorParallelSize <= (has(self.gpu) && has(self.gpu.count)"
        " ? self.gpu.count : 1)"
    ),
    message="engine.tensorParallelSize must be <= gpu.count",
    field_path=".engine.tensorParallelSize",
)
ROLLOUT_NOT_BOTH_ZERO = Rule(
    rule=(
        "!((!has(self.maxSurge) || (type(self.maxSurge) == int ? self.maxSurge == 0"
        " : self.maxSurge == '0%')) && has(self.maxUnavailable)"
        " && (type(self.maxUnavailable) == int ? self.maxUnavailable == 0"
        " : self.maxUnavailable == '0%'))"
    ),
    message="rollout.maxSurge and rollout.maxUnavailable must not both be zero",
)
INT_OR_PERCENT = Rule(
    rule=f"type(self) == int ? self >= 0 : self.matches('{PERCENT_OR_INT_PATTERN}')",
    message="must be a non-negative integer or a percentage such as 25%",
)


IntOrPercent = Annotated[
    int | Annotated[str, Field(max_length=4)],
    Field(json_schema_extra={"x-kubernetes-int-or-string": True, **cel(INT_OR_PERCENT)}),
]


def _is_zero(value: int | str) -> bool:
    return value == 0 or value == "0%"


class LocalObjectReference(SpecModel):
    """corev1.LocalObjectReference, for image pull secrets."""

    name: str = Field(min_length=1, max_length=253, pattern=K8S_NAME_PATTERN)


class GPUSpec(SpecModel):
    """What the pod asks for, and which GPU it lands on (vLLM's defaults depend on it)."""

    count: int = Field(default=1, ge=1, le=16, description="GPUs per replica.")
    resource_name: QualifiedName = Field(default="nvidia.com/gpu", alias="resourceName")
    product: str | None = Field(
        default=None,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._-]*$",
        description="GPU product, e.g. H100, H200, A100-80GB, A100-40GB, L40S, B200.",
    )
    memory_gib: float | None = Field(
        default=None,
        alias="memoryGiB",
        gt=0,
        le=4096,
        description="Per-GPU memory; overrides the product's for vLLM's default-tier choice.",
    )


class Placement(SpecModel):
    """Scheduling constraints, passed to the pod template as Kubernetes spells them."""

    node_selector: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, alias="nodeSelector", max_length=64
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    affinity: Affinity | None = None
    priority_class_name: str | None = Field(
        default=None, alias="priorityClassName", max_length=253, pattern=K8S_NAME_PATTERN
    )


ExtraArg = Annotated[
    str,
    Field(
        max_length=256,
        pattern=EXTRA_ARG_PATTERN,
        json_schema_extra=cel(EXTRA_ARG_NOT_OWNED, EXTRA_ARG_KEEPS_MEANING),
    ),
]


class EngineSpec(SpecModel):
    """vLLM engine settings that are not tuned."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=16, alias="tensorParallelSize")
    max_model_len: int | None = Field(default=None, ge=16, le=16_777_216, alias="maxModelLen")
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"] = Field(
        default="auto", alias="kvCacheDtype"
    )
    enable_prefix_caching: bool | None = Field(default=None, alias="enablePrefixCaching")
    block_size: Literal[8, 16, 32, 64, 128] | None = Field(default=None, alias="blockSize")
    extra_args: list[ExtraArg] = Field(
        default_factory=list,
        alias="extraArgs",
        max_length=64,
        description="More vLLM arguments, passed as separate argv entries (never through a shell).",
    )

    @field_validator("extra_args")
    @classmethod
    def _not_owned(cls, args: list[str]) -> list[str]:
        for i, arg in enumerate(args):
            if sets_owned_flag(arg):
                raise ValueError(f"{EXTRA_ARG_NOT_OWNED.message} (got {arg!r})")
            if changes_knob_meaning(arg, args[i + 1] if i + 1 < len(args) else None):
                raise ValueError(f"{EXTRA_ARG_KEEPS_MEANING.message} (got {arg!r})")
        return args


class TuningSpec(SpecModel):
    """How far the operator may go on its own, and against which policy."""

    mode: Mode = Field(default="Auto", description=f"One of {', '.join(MODES)}.")
    policy_ref: str = Field(
        default="default",
        alias="policyRef",
        min_length=1,
        max_length=253,
        pattern=K8S_NAME_PATTERN,
        description="Name of a cluster-scoped VLLMTuningPolicy.",
    )
    slo: SLOOverrides | None = Field(default=None, description="May only tighten the policy.")


class PodSettings(SpecModel):
    """Pod-level additions, typed as core/v1 types so that depth and size are bounded."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            VOLUMES_NOT_RESERVED,
            MOUNTS_NOT_RESERVED,
            VOLUME_NAMES_UNIQUE,
            MOUNTS_NAME_VOLUMES,
            MOUNT_PATHS_UNIQUE,
        )
    )

    env: list[EnvVar] = Field(default_factory=list, max_length=256)
    env_from: list[EnvFromSource] = Field(default_factory=list, alias="envFrom", max_length=64)
    volumes: list[Volume] = Field(default_factory=list, max_length=64)
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, alias="volumeMounts", max_length=64
    )
    annotations: dict[LabelKey, Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=48
    )
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64)
    resources: ResourceRequirements = section(
        ResourceRequirements, "Extra cpu/memory requests and limits."
    )
    service_account_name: str | None = Field(
        default=None, alias="serviceAccountName", max_length=253, pattern=K8S_NAME_PATTERN
    )
    shm_size_gi: float | None = Field(
        default=None, alias="shmSizeGi", gt=0, le=1024, description="Size of /dev/shm in GiB."
    )
    automount_service_account_token: bool | None = Field(
        default=None,
        alias="automountServiceAccountToken",
        description="Mount the ServiceAccount's API token into the vLLM pods (off unless true).",
    )

    @model_validator(mode="after")
    def _volumes_fit_the_pod(self) -> PodSettings:
        """The API server refuses a pod whose volumes collide; refuse it here, with why."""
        names = [v.name for v in self.volumes]
        if SHM_VOLUME in names:
            raise ValueError(VOLUMES_NOT_RESERVED.message)
        if len(set(names)) != len(names):
            raise ValueError(VOLUME_NAMES_UNIQUE.message)
        paths = [m.mount_path for m in self.volume_mounts]
        if any(
            m.name == SHM_VOLUME or m.mount_path.rstrip("/") == SHM_PATH for m in self.volume_mounts
        ):
            raise ValueError(MOUNTS_NOT_RESERVED.message)
        if any(m.name not in names for m in self.volume_mounts):
            raise ValueError(MOUNTS_NAME_VOLUMES.message)
        if len(set(paths)) != len(paths):
            raise ValueError(MOUNT_PATHS_UNIQUE.message)
        return self


class ServiceSpec(SpecModel):
    """The Service in front of the vLLM pods."""

    port: int = Field(default=8000, ge=1, le=65535)
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"


class RolloutStrategy(SpecModel):
    """Rolling-update limits; surge 0 suits full GPU nodes, where an extra pod cannot schedule."""

    model_config = ConfigDict(json_schema_extra=cel(ROLLOUT_NOT_BOTH_ZERO))

    max_surge: IntOrPercent = Field(default=0, alias="maxSurge")
    max_unavailable: IntOrPercent = Field(default=1, alias="maxUnavailable")
    shutdown_timeout_seconds: int = Field(
        default=120,
        ge=0,
        le=3600,
        alias="shutdownTimeoutSeconds",
        description="vLLM's --shutdown-timeout: on every restart a pod stops taking requests "
        "and finishes those in flight for up to this long (0 aborts them).",
    )
    pre_stop_seconds: int = Field(
        default=5,
        ge=0,
        le=300,
        alias="preStopSeconds",
        description="Delay before vLLM gets SIGTERM, so that endpoints drop the pod first.",
    )
    canary: bool = Field(
        default=True,
        description="With two replicas or more, try a candidate on one pod first, beside the "
        "baseline pods, and promote it only if it wins.",
    )

    @field_validator("max_surge", "max_unavailable")
    @classmethod
    def _non_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError(INT_OR_PERCENT.message)
        if isinstance(value, str) and not _PERCENT.fullmatch(value):
            raise ValueError(INT_OR_PERCENT.message)
        return value

    @model_validator(mode="after")
    def _not_both_zero(self) -> RolloutStrategy:
        if _is_zero(self.max_surge) and _is_zero(self.max_unavailable):
            raise ValueError(ROLLOUT_NOT_BOTH_ZERO.message)
        return self


AutoscalingTarget = Literal["VLLMDeployment", "Deployment"]


class AutoscalingSpec(SpecModel):
    """Whether a replica autoscaler (HPA, KEDA, llm-d's) owns the replica count, and which
    object it scales. The operator never writes a replica count that an autoscaler owns
    (docs/autoscaling.md)."""

    target: AutoscalingTarget | None = Field(
        default=None,
        description="Unset: no autoscaler; spec.replicas is yours (Git). VLLMDeployment: an "
        "autoscaler writes spec.replicas here through the scale subresource; the operator "
        "splits it between the stable and canary Deployments. Deployment: an autoscaler scales "
        "the owned Deployment itself; the operator never sets its spec.replicas (spec.replicas "
        "here is only the size it is created with), and a canary is one extra pod, so it needs "
        "rollout.maxSurge (without surge trials are rolling). With either, the tuner counts a "
        "capacity gain as the replicas the autoscaler will save.",
    )


class VLLMDeploymentSpec(SpecModel):
    """What the app team asks for."""

    model_config = ConfigDict(json_schema_extra=cel(TP_LE_GPU_COUNT))

    model: str = Field(
        min_length=1,
        max_length=253,
        pattern=MODEL_PATTERN,
        description="HF model id, local path or URL passed to vLLM as --model.",
    )
    served_model_name: str | None = Field(
        default=None, alias="servedModelName", max_length=253, pattern=SERVED_MODEL_NAME_PATTERN
    )
    image: str = Field(
        default=DEFAULT_IMAGE, min_length=1, max_length=512, pattern=NO_WHITESPACE_PATTERN
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", alias="imagePullPolicy"
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, alias="imagePullSecrets", max_length=16
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=64,
        description="Pods (the scale subresource's spec replicas). With autoscaling.target "
        "Deployment, only the size the owned Deployment is created with.",
    )
    gpu: GPUSpec = section(GPUSpec)
    placement: Placement = section(Placement)
    engine: EngineSpec = section(EngineSpec)
    knobs: KnobsSpec = section(
        KnobsSpec, "Where tuning starts; unset knobs start at vLLM's per-GPU defaults."
    )
    tuning: TuningSpec = section(TuningSpec)
    pod: PodSettings = section(PodSettings)
    service: ServiceSpec = section(ServiceSpec)
    rollout: RolloutStrategy = section(RolloutStrategy)
    autoscaling: AutoscalingSpec = section(AutoscalingSpec)

    @model_validator(mode="after")
    def _tp_le_gpu_count(self) -> VLLMDeploymentSpec:
        if self.engine.tensor_parallel_size > self.gpu.count:
            raise ValueError(TP_LE_GPU_COUNT.message)
        return self
