"""Render the children of a VLLMDeployment: the vLLM Deployment and its Service.

Pure: the same spec, knobs and owner give the same manifests, byte for byte, so the adapter can
skip writes that change nothing and Argo CD never sees churn. The three tuned knobs come from
the tuner (status), never from the spec directly; everything else comes from the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_autotuner import (
    API_VERSION,
    DEPLOYMENT_LABEL,
    GROUP,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
)
from vllm_autotuner.api.deployment import VLLMDeploymentSpec, sets_owned_flag
from vllm_autotuner.core.tuning_types import Knobs

CONTAINER_NAME = "vllm"
CANARY_SUFFIX = "-canary"
TRACK_LABEL = f"{GROUP}/track"
# Time for the process to exit after the drain (engine shutdown, CUDA teardown).
EXIT_MARGIN_S = 30
PORT_NAME = "http"
CONTAINER_PORT = 8000
KNOBS_ANNOTATION = f"{GROUP}/knobs"

# Metadata that belongs to the tools that manage the CR, never to its children: copying Argo CD
# tracking onto children makes Argo CD prune or diff them (Argo CD resource_tracking.md).
_FOREIGN_PREFIXES = (
    "argocd.argoproj.io/",
    "kopf.zalando.org/",
    "kubectl.kubernetes.io/",
    f"{GROUP}/",
)
_FOREIGN_KEYS = frozenset({"app.kubernetes.io/instance", "app.kubernetes.io/managed-by"})

# Model loading can take many minutes (weights download, torch.compile, CUDA graphs); the
# startup probe allows 30 minutes before liveness takes over (vLLM api_server/entry.py).
STARTUP_FAILURE_THRESHOLD = 180
STARTUP_PERIOD_S = 10


def knob_args(knobs: Knobs) -> list[str]:
    """The three tuned flags as they go on the command line."""
    return [
        "--max-num-batched-tokens",
        str(knobs.max_num_batched_tokens),
        "--max-num-seqs",
        str(knobs.max_num_seqs),
        "--gpu-memory-utilization",
        format_utilization(knobs.gpu_memory_utilization),
    ]


def knob_label(knobs: Knobs) -> str:
    """A short identity of the configuration, used to tell pod revisions apart."""
    return (
        f"mnbt={knobs.max_num_batched_tokens},mns={knobs.max_num_seqs},"
        f"gmu={format_utilization(knobs.gpu_memory_utilization)}"
    )


@dataclass(frozen=True)
class Owner:
    """The VLLMDeployment that owns the children (for ownerReferences and naming)."""

    name: str
    namespace: str
    uid: str


def format_utilization(value: float) -> str:
    """Two or three decimals, no float noise: 0.92 stays "0.92" on every platform."""
    text = f"{value:.3f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def gib_quantity(gib: float) -> str:
    """A size in GiB as a Kubernetes quantity, in the largest binary unit that is exact.

    ``f"{x:g}Gi"`` writes 1e-05 GiB as ``1e-05Gi``, which no quantity grammar accepts: the API
    server refused the whole Deployment. Whole bytes in the largest exact unit always parse.
    """
    size = max(1, round(gib * 2**30))
    for unit, factor in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def child_labels(owner_name: str) -> dict[str, str]:
    return {
        DEPLOYMENT_LABEL: owner_name,
        MANAGED_BY_LABEL: MANAGED_BY_VALUE,
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/component": "inference-server",
    }


def selector_labels(owner_name: str) -> dict[str, str]:
    return {DEPLOYMENT_LABEL: owner_name}


def filter_user_metadata(values: dict[str, str] | None) -> dict[str, str]:
    """Drop tracking and tool metadata from user-supplied labels or annotations."""
    return {
        k: v
        for k, v in sorted((values or {}).items())
        if k not in _FOREIGN_KEYS and not k.startswith(_FOREIGN_PREFIXES)
    }


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "VLLMDeployment",
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def vllm_args(spec: VLLMDeploymentSpec, knobs: Knobs) -> list[str]:
    """`vllm serve` arguments: model, serving settings, engine settings, knobs, extra args."""
    engine = spec.engine
    args = [spec.model, "--port", str(CONTAINER_PORT)]
    if spec.served_model_name:
        args += ["--served-model-name", spec.served_model_name]
    if engine.tensor_parallel_size != 1:
        args += ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.dtype != "auto":
        args += ["--dtype", engine.dtype]
    if engine.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.enable_prefix_caching is True:
        args.append("--enable-prefix-caching")
    elif engine.enable_prefix_caching is False:
        args.append("--no-enable-prefix-caching")
    if engine.block_size is not None:
        args += ["--block-size", str(engine.block_size)]
    args += knob_args(knobs)
    # Every restart drains: vLLM stops taking requests and finishes those in flight for up to
    # this long (its default, 0, aborts them; vllm/entrypoints/launcher.py, v1/engine/core.py).
    args += ["--shutdown-timeout", str(spec.rollout.shutdown_timeout_seconds)]
    for extra in engine.extra_args:
        # The API refuses these already; refusing again here means a spec that bypassed
        # admission and validation (model_construct, a stale CRD) still cannot override the
        # tuner, and the rule is the API's own (prefixes and --config included).
        if sets_owned_flag(extra):
            raise ValueError(f"extraArgs may not set {extra!r}: the operator owns that flag")
        args.append(extra)
    return args


def _probe(path: str, period: int, failure_threshold: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failure_threshold,
    }


def _container(spec: VLLMDeploymentSpec, knobs: Knobs) -> dict[str, Any]:
    pod = spec.pod
    gpu_limits = {spec.gpu.resource_name: str(spec.gpu.count)}
    requests = {**pod.resources.requests, **gpu_limits}
    limits = {**pod.resources.limits, **gpu_limits}
    mounts: list[dict[str, Any]] = [m.to_k8s() for m in pod.volume_mounts]
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["vllm", "serve"],
        "args": vllm_args(spec, knobs),
        "ports": [{"name": PORT_NAME, "containerPort": CONTAINER_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": dict(sorted(requests.items())),
            "limits": dict(sorted(limits.items())),
        },
        "startupProbe": _probe("/health", STARTUP_PERIOD_S, STARTUP_FAILURE_THRESHOLD),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "volumeMounts": mounts,
    }
    if spec.rollout.pre_stop_seconds > 0:
        # Endpoints drop a terminating pod asynchronously; vLLM gets SIGTERM only after this
        # delay, so no new request is routed to a pod that has stopped taking them.
        container["lifecycle"] = {
            "preStop": {"exec": {"command": ["sleep", str(spec.rollout.pre_stop_seconds)]}}
        }
    if pod.env:
        container["env"] = [e.to_k8s() for e in pod.env]
    if pod.env_from:
        container["envFrom"] = [e.to_k8s() for e in pod.env_from]
    return container


def _pod_spec(spec: VLLMDeploymentSpec, knobs: Knobs) -> dict[str, Any]:
    placement = spec.placement
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.pod.shm_size_gi is not None:
        shm["sizeLimit"] = gib_quantity(spec.pod.shm_size_gi)
    pod_spec: dict[str, Any] = {
        "containers": [_container(spec, knobs)],
        "volumes": [*[v.to_k8s() for v in spec.pod.volumes], {"name": "dshm", "emptyDir": shm}],
        # The grace period covers the pre-stop delay, the drain and the exit, so the kubelet
        # never kills a pod that is still finishing requests.
        "terminationGracePeriodSeconds": termination_grace_s(spec),
        # vLLM never calls the Kubernetes API: a token in the pod is only something to steal
        # (a prompt-injected tool, a compromised image). Mounted only when the spec asks.
        "automountServiceAccountToken": spec.pod.automount_service_account_token is True,
    }
    if placement.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(placement.node_selector.items()))
    if placement.tolerations:
        pod_spec["tolerations"] = [t.to_k8s() for t in placement.tolerations]
    if placement.affinity is not None and placement.affinity.to_k8s():
        pod_spec["affinity"] = placement.affinity.to_k8s()
    if placement.priority_class_name:
        pod_spec["priorityClassName"] = placement.priority_class_name
    if spec.pod.service_account_name:
        pod_spec["serviceAccountName"] = spec.pod.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [dict(s) for s in spec.image_pull_secrets]
    return pod_spec


def termination_grace_s(spec: VLLMDeploymentSpec) -> int:
    return spec.rollout.pre_stop_seconds + spec.rollout.shutdown_timeout_seconds + EXIT_MARGIN_S


def canary_name(owner_name: str) -> str:
    return owner_name + CANARY_SUFFIX


def render_canary(spec: VLLMDeploymentSpec, knobs: Knobs, owner: Owner) -> dict[str, Any]:
    """The one-pod canary Deployment: the candidate knobs behind the same Service (its pods
    carry the Service's selector labels) and its own selector (the track label), so that the
    stable Deployment's ReplicaSets never count its pod."""
    d = render_deployment(spec, knobs, owner, replicas=1)
    d["metadata"]["name"] = canary_name(owner.name)
    d["metadata"]["labels"] = {**d["metadata"]["labels"], TRACK_LABEL: "canary"}
    d["spec"]["selector"] = {"matchLabels": {**selector_labels(owner.name), TRACK_LABEL: "canary"}}
    template = d["spec"]["template"]["metadata"]
    template["labels"] = dict(sorted({**template["labels"], TRACK_LABEL: "canary"}.items()))
    return d


def render_deployment(
    spec: VLLMDeploymentSpec, knobs: Knobs, owner: Owner, replicas: int | None = None
) -> dict[str, Any]:
    labels = {**filter_user_metadata(spec.pod.labels), **child_labels(owner.name)}
    pod_annotations = {
        **filter_user_metadata(spec.pod.annotations),
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(CONTAINER_PORT),
        "prometheus.io/path": "/metrics",
        KNOBS_ANNOTATION: knob_label(knobs),
    }
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": owner.name,
            "namespace": owner.namespace,
            "labels": child_labels(owner.name),
            "annotations": {KNOBS_ANNOTATION: knob_label(knobs)},
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": {
            "replicas": spec.replicas if replicas is None else replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.rollout.max_surge,
                    "maxUnavailable": spec.rollout.max_unavailable,
                },
            },
            "template": {
                "metadata": {
                    "labels": dict(sorted(labels.items())),
                    "annotations": dict(sorted(pod_annotations.items())),
                },
                "spec": _pod_spec(spec, knobs),
            },
        },
    }
    return deployment


def render_service(spec: VLLMDeploymentSpec, owner: Owner) -> dict[str, Any]:
    service: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": owner.name,
            "namespace": owner.namespace,
            "labels": child_labels(owner.name),
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": {
            "type": spec.service.type,
            "selector": selector_labels(owner.name),
            "ports": [
                {
                    "name": PORT_NAME,
                    "port": spec.service.port,
                    "targetPort": PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }
    return service


def drifted(desired: Any, live: Any) -> bool:
    """Whether the live object differs from what we render, in the fields we render.

    The API server adds defaults and other managers add fields; those are not drift. A field we
    set that now has another value (a hand edit, an old revision) is, and triggers an apply.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return True
        return any(drifted(value, live.get(key)) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return True
        return any(drifted(d, lv) for d, lv in zip(desired, live, strict=True))
    if isinstance(desired, bool) or isinstance(live, bool):
        return desired is not live
    if isinstance(desired, int | float) and isinstance(live, int | float):
        return float(desired) != float(live)
    return bool(desired != live)


def drift_paths(desired: Any, live: Any, prefix: str = "") -> list[str]:
    """The fields (dotted paths) where `drifted` finds a difference, for messages to people."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return [prefix or "."]
        found: list[str] = []
        for key, value in desired.items():
            found += drift_paths(value, live.get(key), f"{prefix}.{key}" if prefix else key)
        return found
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return [prefix]
        found = []
        for i, (d, lv) in enumerate(zip(desired, live, strict=True)):
            found += drift_paths(d, lv, f"{prefix}[{i}]")
        return found
    return [prefix] if drifted(desired, live) else []
