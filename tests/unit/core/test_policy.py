"""Policy resolution: a VLLMDeployment may only tighten its policy."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_autotuner.api.policy import VLLMTuningPolicySpec
from vllm_autotuner.core.policy import cap_mode, resolve
from vllm_autotuner.core.starting_point import starting_knobs

POLICY: dict[str, Any] = {
    "slo": {
        "ttft": {"percentile": 95, "thresholdMs": 500},
        "itl": {"percentile": 95, "thresholdMs": 50},
    },
}


def dep(**tuning: Any) -> VLLMDeploymentSpec:
    return VLLMDeploymentSpec.model_validate({"model": "m", "tuning": tuning})


def pol(**extra: Any) -> VLLMTuningPolicySpec:
    return VLLMTuningPolicySpec.model_validate({**POLICY, **extra})


def test_policy_slo_applies_when_no_override() -> None:
    r = resolve(dep(), "default", pol(), "ns", {})
    assert r.ok and r.mode == "Auto" and r.slo is not None
    assert (r.slo.ttft.percentile, r.slo.ttft.threshold_ms) == (95, 500)
    assert (r.slo.itl.percentile, r.slo.itl.threshold_ms) == (95, 50)


def test_tighter_override_wins() -> None:
    r = resolve(dep(slo={"itl": {"percentile": 99, "thresholdMs": 40}}), "default", pol(), "ns", {})
    assert r.ok and r.slo is not None
    assert (r.slo.itl.percentile, r.slo.itl.threshold_ms) == (99, 40)
    assert (r.slo.ttft.percentile, r.slo.ttft.threshold_ms) == (95, 500)


def test_partial_override_takes_the_rest_from_the_policy() -> None:
    r = resolve(dep(slo={"ttft": {"thresholdMs": 300}}), "default", pol(), "ns", {})
    assert r.ok and r.slo is not None
    assert (r.slo.ttft.percentile, r.slo.ttft.threshold_ms) == (95, 300)


@pytest.mark.parametrize(
    "override",
    [
        {"itl": {"percentile": 95, "thresholdMs": 80}},  # higher threshold
        {"itl": {"percentile": 90, "thresholdMs": 50}},  # lower percentile
        {"ttft": {"thresholdMs": 501}},
    ],
)
def test_looser_override_is_refused_with_a_reason(override: dict[str, Any]) -> None:
    r = resolve(dep(slo=override), "default", pol(), "ns", {})
    assert not r.ok
    assert r.reason == "SLOLooserThanPolicy"
    assert "looser than the policy" in r.message


def test_missing_policy_blocks_every_mode_off_included() -> None:
    """The platform's bounds bind in every mode (docs/decisions.md, who chooses the policy)."""
    r = resolve(dep(mode="Auto", policyRef="gone"), "gone", None, "ns", {})
    assert not r.ok and r.reason == "PolicyNotFound" and "'gone'" in r.message
    off = resolve(dep(mode="Off", policyRef="gone"), "gone", None, "ns", {})
    assert not off.ok and off.reason == "PolicyNotFound"


def test_mode_is_capped_by_allowed_modes() -> None:
    assert cap_mode("Auto", ["Off", "Recommend"]) == "Recommend"
    assert cap_mode("Auto", ["Off"]) == "Off"
    assert cap_mode("Recommend", ["Off", "Recommend", "Auto"]) == "Recommend"
    assert cap_mode("Recommend", ["Auto"]) == "Off"
    r = resolve(dep(mode="Auto"), "default", pol(allowedModes=["Off", "Recommend"]), "ns", {})
    assert r.ok and r.mode == "Recommend" and r.reason == "ModeCapped"


def test_namespace_selector_is_enforced() -> None:
    policy = pol(namespaceSelector={"matchLabels": {"gpu": "yes"}})
    assert resolve(dep(), "default", policy, "ns", {"gpu": "yes"}).ok
    r = resolve(dep(), "default", policy, "ns", {"gpu": "no"})
    assert not r.ok and r.reason == "NamespaceNotSelected"
    expr = pol(
        namespaceSelector={
            "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]
        }
    )
    assert resolve(dep(), "default", expr, "ns", {"tier": "b"}).ok
    assert not resolve(dep(), "default", expr, "ns", {"tier": "c"}).ok
    assert not resolve(dep(), "default", expr, "ns", {}).ok


def test_starting_knobs_follow_vllm_defaults_per_gpu() -> None:
    h100 = VLLMDeploymentSpec.model_validate({"model": "m", "gpu": {"product": "H100"}})
    a100 = VLLMDeploymentSpec.model_validate({"model": "m", "gpu": {"product": "A100-80GB"}})
    k = starting_knobs(h100, None).knobs
    assert (k.max_num_batched_tokens, k.max_num_seqs, k.gpu_memory_utilization) == (
        8192,
        1024,
        0.92,
    )
    k = starting_knobs(a100, None).knobs
    assert (k.max_num_batched_tokens, k.max_num_seqs) == (2048, 256)


def test_starting_knobs_pinned_values_win_and_are_clamped_into_bounds() -> None:
    spec = VLLMDeploymentSpec.model_validate(
        {
            "model": "m",
            "gpu": {"product": "H100"},
            "knobs": {"maxNumSeqs": 64, "gpuMemoryUtilization": 0.99},
        }
    )
    free = starting_knobs(spec, None)
    assert free.knobs.max_num_seqs == 64 and free.knobs.gpu_memory_utilization == 0.99
    assert free.notes == ()
    bounded = starting_knobs(
        spec,
        pol(bounds={"gpuMemoryUtilization": {"min": 0.5, "max": 0.95, "maxStep": 0.05}}),
    )
    assert bounded.knobs.gpu_memory_utilization == 0.95
    assert any("gpuMemoryUtilization" in n for n in bounded.notes)
