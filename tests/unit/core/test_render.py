"""Rendering of the vLLM Deployment and Service from a VLLMDeployment spec."""

from __future__ import annotations

import re
from typing import Any

import pytest

from vllm_autotuner import DEPLOYMENT_LABEL, MANAGED_BY_LABEL
from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_autotuner.core import render
from vllm_autotuner.core.tuning_types import Knobs

OWNER = render.Owner(name="llama", namespace="team-a", uid="0f1e2d3c")
KNOBS = Knobs(max_num_batched_tokens=4096, max_num_seqs=128, gpu_memory_utilization=0.9)


def spec(**overrides: Any) -> VLLMDeploymentSpec:
    base: dict[str, Any] = {"model": "meta-llama/Llama-3.1-8B-Instruct"}
    base.update(overrides)
    return VLLMDeploymentSpec.model_validate(base)


def container(manifest: dict[str, Any]) -> dict[str, Any]:
    containers = manifest["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def flag_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def test_args_carry_model_port_and_exactly_the_given_knobs() -> None:
    args = container(render.render_deployment(spec(), KNOBS, OWNER))["args"]
    assert args[0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert flag_value(args, "--port") == "8000"
    assert flag_value(args, "--max-num-batched-tokens") == "4096"
    assert flag_value(args, "--max-num-seqs") == "128"
    assert flag_value(args, "--gpu-memory-utilization") == "0.9"
    assert args.count("--max-num-seqs") == 1


def test_engine_settings_become_flags_only_when_not_default() -> None:
    plain = container(render.render_deployment(spec(), KNOBS, OWNER))["args"]
    for flag in ("--tensor-parallel-size", "--dtype", "--kv-cache-dtype", "--max-model-len"):
        assert flag not in plain
    tuned = spec(
        servedModelName="llama-8b",
        gpu={"count": 4},
        engine={
            "tensorParallelSize": 4,
            "maxModelLen": 8192,
            "kvCacheDtype": "fp8",
            "enablePrefixCaching": False,
            "extraArgs": ["--enforce-eager", "--swap-space=8"],
        },
    )
    args = container(render.render_deployment(tuned, KNOBS, OWNER))["args"]
    assert flag_value(args, "--tensor-parallel-size") == "4"
    assert flag_value(args, "--max-model-len") == "8192"
    assert flag_value(args, "--kv-cache-dtype") == "fp8"
    assert flag_value(args, "--served-model-name") == "llama-8b"
    assert "--no-enable-prefix-caching" in args
    assert args[-2:] == ["--enforce-eager", "--swap-space=8"]


def test_utilization_is_printed_without_float_noise() -> None:
    assert render.format_utilization(0.92) == "0.92"
    assert render.format_utilization(0.9) == "0.9"
    assert render.format_utilization(0.925) == "0.925"
    assert render.format_utilization(1.0) == "1.0"


def test_probes_allow_slow_model_loading_and_use_health() -> None:
    c = container(render.render_deployment(spec(), KNOBS, OWNER))
    startup = c["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"


def test_gpus_requested_and_limited() -> None:
    c = container(render.render_deployment(spec(gpu={"count": 2}), KNOBS, OWNER))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "2"


def test_labels_selector_and_owner_reference() -> None:
    d = render.render_deployment(spec(), KNOBS, OWNER)
    assert d["metadata"]["labels"][DEPLOYMENT_LABEL] == "llama"
    assert d["metadata"]["labels"][MANAGED_BY_LABEL] == "vllm-autotuner"
    selector = d["spec"]["selector"]["matchLabels"]
    template_labels = d["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    (ref,) = d["metadata"]["ownerReferences"]
    assert ref == {
        "apiVersion": "vllm.autotuner.io/v1alpha1",
        "kind": "VLLMDeployment",
        "name": "llama",
        "uid": "0f1e2d3c",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def test_tracking_labels_and_annotations_are_never_copied() -> None:
    s = spec(
        pod={
            "labels": {"team": "a", "app.kubernetes.io/instance": "argo-app"},
            "annotations": {"argocd.argoproj.io/tracking-id": "x", "note": "kept"},
        }
    )
    d = render.render_deployment(s, KNOBS, OWNER)
    labels = d["spec"]["template"]["metadata"]["labels"]
    annotations = d["spec"]["template"]["metadata"]["annotations"]
    assert labels["team"] == "a"
    assert "app.kubernetes.io/instance" not in labels
    assert "argocd.argoproj.io/tracking-id" not in annotations
    assert annotations["note"] == "kept"
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"


def test_default_strategy_is_surge_free() -> None:
    d = render.render_deployment(spec(), KNOBS, OWNER)
    assert d["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


def test_service_targets_the_pods_port() -> None:
    svc = render.render_service(spec(service={"port": 80}), OWNER)
    assert svc["spec"]["selector"] == {DEPLOYMENT_LABEL: "llama"}
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}
    ]


def test_rendering_is_deterministic_and_knob_changes_change_the_template() -> None:
    a = render.render_deployment(spec(), KNOBS, OWNER)
    b = render.render_deployment(spec(), KNOBS, OWNER)
    assert a == b
    other = Knobs(max_num_batched_tokens=2048, max_num_seqs=128, gpu_memory_utilization=0.9)
    c = render.render_deployment(spec(), other, OWNER)
    key = render.KNOBS_ANNOTATION
    assert (
        a["spec"]["template"]["metadata"]["annotations"][key]
        != c["spec"]["template"]["metadata"]["annotations"][key]
    )


@pytest.mark.parametrize(
    "arg", ["--max-num-seqs=4", "--max-num-seq=4", "--gpu_mem", "--config", "--conf=x.yaml", "-t"]
)
def test_owned_flags_in_extra_args_are_refused_even_past_admission(arg: str) -> None:
    """Whole, abbreviated (argparse's allow_abbrev), underscored, --config, short."""
    s = spec().model_copy(deep=True)
    s.engine.extra_args.append(arg)
    with pytest.raises(ValueError, match=re.escape(repr(arg))):
        render.render_deployment(s, KNOBS, OWNER)


def test_drift_ignores_server_defaults_but_sees_hand_edits() -> None:
    desired = render.render_deployment(spec(), KNOBS, OWNER)
    live: dict[str, Any] = {
        **desired,
        "metadata": {**desired["metadata"], "uid": "u", "resourceVersion": "7"},
        "status": {"readyReplicas": 1},
    }
    live["spec"] = {**desired["spec"], "revisionHistoryLimit": 10, "progressDeadlineSeconds": 600}
    assert not render.drifted(desired, live)
    edited = render.render_deployment(spec(), KNOBS, OWNER)
    edited["spec"]["template"]["spec"]["containers"][0]["args"][-1] = "0.5"
    assert render.drifted(desired, edited)
    assert render.drifted(desired, {**desired, "spec": {**desired["spec"], "replicas": 3}})
