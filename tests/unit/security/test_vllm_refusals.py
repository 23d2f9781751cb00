"""Class 6: what vLLM refuses at start-up is refused before a pod is rendered.

vLLM's own checks (vllm/config/scheduler.py SchedulerConfig.verify_max_model_len,
vllm/config/cache.py gpu_memory_utilization in (0, 1], ModelConfig.verify_with_parallel_config):
  - max_num_batched_tokens >= max_num_seqs;
  - max_num_batched_tokens >= max_model_len when chunked prefill is off;
  - the attention heads divisible by the tensor-parallel size;
  - 0 < gpu_memory_utilization <= 1 (and the operator renders three decimals).
A spec or policy that can only lead to one of these must be refused at admission, by policy
validation (Valid=False), or by the operator with a condition; never rendered.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.support.crd_validation import validate
from tests.unit.security.hostile_objects import conditions, deployment, policy, reconcile
from vllm_autotuner.api import VLLMDeployment
from vllm_autotuner.api.crds import render_crds
from vllm_autotuner.controller import policy_status_patch, utcnow
from vllm_autotuner.core import render

CRDS = {c["spec"]["names"]["kind"]: c for c in render_crds()}

# ---------------------------------------------------------------- knobs vLLM would refuse

TINY_GMU = [1e-9, 1e-6, 0.0004, 0.0049, 0.009]


@pytest.mark.parametrize("gmu", TINY_GMU, ids=[f"gmu-{g:g}" for g in TINY_GMU])
def test_a_utilization_that_renders_as_zero_is_refused(gmu: float) -> None:
    obj = deployment(("spec.knobs", {"gpuMemoryUtilization": gmu}))
    assert validate(CRDS["VLLMDeployment"], obj)
    with pytest.raises(ValidationError):
        VLLMDeployment.model_validate(obj)
    kube, _ = reconcile(obj)
    assert kube.applied == []


@given(st.floats(min_value=0.01, max_value=0.99))
def test_every_admitted_utilization_renders_above_zero(gmu: float) -> None:
    assert 0 < float(render.format_utilization(gmu)) <= 1


# ---------------------------------------------------------------- policies that allow nothing

INFEASIBLE_POLICIES: dict[str, dict[str, Any]] = {
    "budget-below-seqs": {
        "maxNumBatchedTokens": {"min": 16, "max": 64},
        "maxNumSeqs": {"min": 128, "max": 256},
    },
    "budget-below-default-seqs": {"maxNumBatchedTokens": {"min": 1, "max": 4}},
    "budget-point-below-seqs": {
        "maxNumBatchedTokens": {"min": 100, "max": 100},
        "maxNumSeqs": {"min": 101, "max": 101},
    },
    "gmu-bounds-tiny": {"gpuMemoryUtilization": {"min": 1e-6, "max": 0.001}},
    "gmu-min-tiny": {"gpuMemoryUtilization": {"min": 0.0001, "max": 0.9}},
}


@pytest.mark.parametrize("bounds", INFEASIBLE_POLICIES.values(), ids=list(INFEASIBLE_POLICIES))
def test_a_policy_that_only_allows_refused_knobs_is_not_valid(bounds: dict[str, Any]) -> None:
    obj = policy(("spec.bounds", bounds))
    assert validate(CRDS["VLLMTuningPolicy"], obj)
    valid = {c["type"]: c for c in policy_status_patch(obj, utcnow())["conditions"]}["Valid"]
    assert valid["status"] == "False"
    kube, _ = reconcile(deployment(), policies={"default": obj["spec"]})
    assert kube.applied == []
    assert conditions(kube)["PolicyResolved"]["reason"] == "PolicyInvalid"


# ---------------------------------------------------------------- the model's own limits

REFUSED_ENGINES = [
    ("qwen7b-tp8", "Qwen/Qwen2.5-7B-Instruct", 8, {}),  # 28 heads
    ("qwen7b-lowercase-tp8", "qwen2.5-7b-instruct", 8, {}),
    ("qwen32b-tp16", "Qwen/Qwen2.5-32B-Instruct", 16, {}),  # 40 heads
    ("llama8b-tp3", "meta-llama/Llama-3.1-8B-Instruct", 3, {}),  # 32 heads
    ("llama8b-tp6", "meta-llama/Llama-3.1-8B-Instruct", 6, {}),
    ("llama70b-tp5", "meta-llama/Llama-3.1-70B-Instruct", 5, {}),  # 64 heads
    ("mixtral-tp12", "mistralai/Mixtral-8x7B-Instruct-v0.1", 12, {}),
    ("llama2-context", "meta-llama/Llama-2-7b-hf", 1, {"maxModelLen": 8192}),
    ("mistral-context", "mistralai/Mistral-7B-Instruct-v0.3", 1, {"maxModelLen": 65536}),
]


@pytest.mark.parametrize(
    ("model", "tp", "engine"),
    [c[1:] for c in REFUSED_ENGINES],
    ids=[c[0] for c in REFUSED_ENGINES],
)
def test_an_engine_vllm_refuses_for_the_model_is_not_rendered(
    model: str, tp: int, engine: dict[str, Any]
) -> None:
    obj = deployment(
        ("spec.model", model),
        ("spec.gpu", {"count": 16, "product": "H100"}),
        ("spec.engine", {"tensorParallelSize": tp, **engine}),
    )
    kube, outcome = reconcile(obj)
    assert kube.applied == []
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "VLLMWouldRefuse")
    assert "vLLM refuses" in degraded["message"]
    assert any(e.reason == "VLLMWouldRefuse" for e in outcome.events)


ACCEPTED_ENGINES = [
    ("qwen7b-tp4", "Qwen/Qwen2.5-7B-Instruct", 4, {}),
    ("llama8b-tp16", "meta-llama/Llama-3.1-8B-Instruct", 16, {}),
    ("llama2-context-fits", "meta-llama/Llama-2-7b-hf", 1, {"maxModelLen": 4096}),
    ("uncatalogued-tp3", "/models/my-own", 3, {}),
]


@pytest.mark.parametrize(
    ("model", "tp", "engine"),
    [c[1:] for c in ACCEPTED_ENGINES],
    ids=[c[0] for c in ACCEPTED_ENGINES],
)
def test_engines_vllm_accepts_are_rendered(model: str, tp: int, engine: dict[str, Any]) -> None:
    obj = deployment(
        ("spec.model", model),
        ("spec.gpu", {"count": 16, "product": "H100"}),
        ("spec.engine", {"tensorParallelSize": tp, **engine}),
    )
    kube, _ = reconcile(obj)
    assert [m["kind"] for m in kube.applied] == ["Deployment", "Service"]


# ---------------------------------------------------------------- chunked prefill off

CHUNKED_OFF = [
    ["--no-enable-chunked-prefill"],
    ["--no_enable_chunked_prefill"],
    ["--no-enable-chunked"],
    ["--enable-chunked-prefill=false"],
    ["--enable-chunked-prefill=False"],
    ["--enable_chunked_prefill=0"],
    ["--enable-chunked=no"],
    ["--enable-chunked-prefill=OFF"],
]


@pytest.mark.parametrize("args", CHUNKED_OFF, ids=[a[0] for a in CHUNKED_OFF])
def test_turning_chunked_prefill_off_is_refused_at_admission(args: list[str]) -> None:
    """Without chunked prefill vLLM refuses any budget below max-model-len, which the tuner's
    bounds allow: the flag would turn the tuner's moves into start-up failures."""
    obj = deployment(("spec.engine", {"maxModelLen": 32768, "extraArgs": args}))
    assert validate(CRDS["VLLMDeployment"], obj)
    with pytest.raises(ValidationError):
        VLLMDeployment.model_validate(obj)
    kube, _ = reconcile(obj)
    assert kube.applied == []


def test_chunked_prefill_off_with_the_value_in_the_next_entry_is_refused_by_the_operator() -> None:
    """vLLM before 0.10 read ``--enable-chunked-prefill false``; CEL cannot see two entries."""
    obj = deployment(("spec.engine", {"extraArgs": ["--enable-chunked-prefill", "false"]}))
    with pytest.raises(ValidationError):
        VLLMDeployment.model_validate(obj)
    kube, _ = reconcile(obj)
    assert kube.applied == []
    assert conditions(kube)["Degraded"]["reason"] == "InvalidSpec"


def test_turning_chunked_prefill_on_is_fine() -> None:
    obj = deployment(("spec.engine", {"extraArgs": ["--enable-chunked-prefill", "--seed", "0"]}))
    assert validate(CRDS["VLLMDeployment"], obj) == []
    kube, _ = reconcile(obj)
    assert [m["kind"] for m in kube.applied] == ["Deployment", "Service"]
