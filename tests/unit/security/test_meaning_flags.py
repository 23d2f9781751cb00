"""Class 9: extraArgs and env must not change what the tuned knobs mean.

The tuner models one vLLM V1 engine per pod on spec.gpu.count GPUs, scheduling one token budget
per step with chunked prefill. Flags and environment variables that break that picture are
refused (docs/security.md, T9, has the list and why each is refused or accepted), in every
spelling argparse accepts: ``=value``, the value in the next entry, underscores, abbreviations,
vLLM's dotted form, and the short forms. Control characters never reach argv.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from tests.support.crd_validation import crd_schema, validate
from tests.unit.security.hostile_objects import deployment, reconcile
from vllm_autotuner.api import VLLMDeployment
from vllm_autotuner.api.crds import render_crds

CRD = render_crds()[0]

REFUSED_FLAGS = [
    "no-enable-chunked-prefill",
    "long-prefill-token-threshold",
    "max-num-partial-prefills",
    "max-long-partial-prefills",
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
    "hf-overrides",
    "scheduler-cls",
    "num-scheduler-steps",
]
SPELLINGS = [
    ["--long-prefill-token-threshold", "512"],
    ["--max_num_partial_prefills=4"],
    ["--long-prefill=512"],
    ["--max-long-partial=2"],
    ["--hf-over", '{"num_attention_heads": 8}'],
    ["--hf-overrides.num_attention_heads=8"],
    ["--hf_overrides={}"],
    ["--data-parallel=2"],
    ["--data_parallel_size", "2"],
    ["--pipeline-parallel=2"],
    ["--scheduler-c=my.Scheduler"],
    ["-dp=2"],
    ["-dp", "2"],
    ["-dp2"],
    ["-dpl=1"],
    ["-pp=2"],
    ["-pp", "2"],
]
ENV_NAMES = [
    "VLLM_USE_V1",
    "VLLM_DP_SIZE",
    "VLLM_DP_RANK",
    "VLLM_DP_RANK_LOCAL",
    "VLLM_DP_MASTER_IP",
    "VLLM_DP_MASTER_PORT",
    "VLLM_PP_LAYER_PARTITION",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
    "VLLM_CPU_KVCACHE_SPACE",
    "CUDA_VISIBLE_DEVICES",
]
CONTROL = {
    "escape": "--served-note=\x1b[2J",
    "tab": "--seed=\t1",
    "delete": "--seed=1\x7f",
    "vertical-tab": "--seed=1\x0b",
    "form-feed": "--seed=1\x0c",
    "line-separator": "--seed=1\u2028--max-num-seqs=1",
    "bidi-override": "--seed=\u202e1",
    "non-ascii": "--tokenizer=mod\u00e8le",
    "bell": "--seed=1\x07",
}


def _refused_everywhere(obj: dict[str, Any]) -> None:
    assert validate(CRD, obj), "admission accepted it"
    with pytest.raises(ValidationError):
        VLLMDeployment.model_validate(obj)
    kube, _ = reconcile(obj)
    assert kube.applied == [], "rendered it"


@pytest.mark.parametrize("flag", REFUSED_FLAGS)
def test_a_flag_that_changes_what_the_knobs_mean_is_refused(flag: str) -> None:
    _refused_everywhere(deployment(("spec.engine", {"extraArgs": [f"--{flag}=2"]})))


@pytest.mark.parametrize("args", SPELLINGS, ids=[" ".join(a) for a in SPELLINGS])
def test_every_spelling_of_such_a_flag_is_refused(args: list[str]) -> None:
    _refused_everywhere(deployment(("spec.engine", {"extraArgs": args})))


@pytest.mark.parametrize("name", ENV_NAMES)
def test_an_env_variable_that_changes_what_the_knobs_mean_is_refused(name: str) -> None:
    _refused_everywhere(deployment(("spec.pod", {"env": [{"name": name, "value": "1"}]})))


@pytest.mark.parametrize("arg", CONTROL.values(), ids=list(CONTROL))
def test_control_and_non_ascii_characters_never_reach_argv(arg: str) -> None:
    _refused_everywhere(deployment(("spec.engine", {"extraArgs": [arg]})))


ACCEPTED = [
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
    ["--kv-transfer-config={}"],
    ["--cpu-offload-gb=8"],
    ["--enforce-eager"],
    ["--async-scheduling"],
    ["--enable-chunked-prefill"],
    ["--hf-token=x", "--hf-config-path=/c"],
    ["--max-logprobs=5", "--max-loras=2"],
]


@pytest.mark.parametrize("args", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_flags_the_tuner_can_live_with_are_accepted(args: list[str]) -> None:
    """Accepted and not modelled: measured verdicts still decide every rollout (T9)."""
    obj = deployment(("spec.engine", {"extraArgs": args}))
    assert validate(CRD, obj) == []
    kube, _ = reconcile(obj)
    container = next(m for m in kube.applied if m["kind"] == "Deployment")["spec"]["template"][
        "spec"
    ]["containers"][0]
    assert container["args"][-len(args) :] == args


def test_the_new_rules_stay_within_the_api_servers_cel_budget() -> None:
    """cel-go estimates ``s.matches(re)`` as ceil(0.1 * maxLength(s)) * ceil(0.25 * len(re));
    a CRD whose rule costs more than 10,000,000 over its list is refused (10x headroom kept)."""
    items = crd_schema(CRD)["properties"]["spec"]["properties"]["engine"]["properties"]["extraArgs"]
    for rule in items["items"]["x-kubernetes-validations"]:
        per_call = math.ceil(0.1 * items["items"]["maxLength"]) * math.ceil(
            0.25 * len(rule["rule"])
        )
        assert items["maxItems"] * per_call < 10_000_000 // 10, rule["message"]
