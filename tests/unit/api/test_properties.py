"""Property tests: generated valid specs round-trip through the models and are accepted by the
CRD; generated near-valid specs are accepted by the CRD exactly when pydantic accepts them."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from tests.support.crd_validation import validate
from vllm_autotuner import API_VERSION
from vllm_autotuner.api import VLLMDeploymentSpec, VLLMTuningPolicySpec
from vllm_autotuner.api.crds import deployment_crd, policy_crd
from vllm_autotuner.api.deployment import K8S_NAME_PATTERN, MODEL_PATTERN, OWNED_FLAGS

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEPLOYMENT_CRD = deployment_crd()
POLICY_CRD = policy_crd()

FREE_ARGS = [
    "--enforce-eager",
    "--seed=1",
    "--scheduling-policy=priority",
    "-O3",
    "--trust-remote-code",
    "--max-logprobs=5",
    "--config-format=hf",
    "--model-impl=vllm",
]
OWNED_ARGS = [f"--{f}" for f in OWNED_FLAGS] + [
    "--max_num_seqs=8",
    "-tp",
    "--port=1",
    "--max-num-seq=8",
    "--gpu_mem",
    "--config",
    "--conf=x.yaml",
    "-t",
]

models = st.from_regex(MODEL_PATTERN, fullmatch=True).filter(lambda s: len(s) <= 253)
names = st.from_regex(K8S_NAME_PATTERN, fullmatch=True).filter(lambda s: len(s) <= 253)
percentiles = st.floats(50, 99.9)
thresholds = st.floats(0.001, 3_600_000).filter(lambda x: x > 0)
gmus = st.floats(0.01, 0.99)
fractions = st.floats(0.01, 1.0)
durations = st.sampled_from(["30s", "1m", "90s", "5m", "1h30m", "250ms", "2h"])


def objective(required: bool) -> st.SearchStrategy[dict[str, Any]]:
    threshold = {"thresholdMs": thresholds}
    if required:
        return st.fixed_dictionaries(threshold, optional={"percentile": percentiles})
    return st.fixed_dictionaries({}, optional={"percentile": percentiles, **threshold})


@st.composite
def deployment_specs(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 16))
    mns = draw(st.integers(1, 65536))
    knobs = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "maxNumSeqs": st.just(mns),
                "maxNumBatchedTokens": st.integers(mns, 1_048_576),
                "gpuMemoryUtilization": gmus,
            },
        )
    )
    rollout = draw(
        st.sampled_from(
            [{}, {"maxSurge": 1, "maxUnavailable": 0}, {"maxSurge": "25%"}, {"maxUnavailable": 2}]
        )
    )
    optional = {
        "servedModelName": st.sampled_from(["llama", "org/model-x", "a.b:c"]),
        "image": st.sampled_from(["vllm/vllm-openai:v0.33.0", "registry.local/vllm@sha256:ab"]),
        "imagePullPolicy": st.sampled_from(["Always", "IfNotPresent", "Never"]),
        "replicas": st.integers(0, 64),
        "gpu": st.fixed_dictionaries(
            {"count": st.just(count)},
            optional={"product": st.sampled_from(["H100", "H200", "A100-80GB", "L40S"]),
                      "memoryGiB": st.floats(1, 4096)},
        ),
        "engine": st.fixed_dictionaries(
            {"tensorParallelSize": st.integers(1, count)},
            optional={
                "maxModelLen": st.integers(16, 1_000_000),
                "dtype": st.sampled_from(["auto", "bfloat16", "float16"]),
                "kvCacheDtype": st.sampled_from(["auto", "fp8", "fp8_e5m2"]),
                "enablePrefixCaching": st.booleans(),
                "blockSize": st.sampled_from([8, 16, 32, 64, 128]),
                "extraArgs": st.lists(st.sampled_from(FREE_ARGS), max_size=5),
            },
        ),
        "knobs": st.just(knobs),
        "tuning": st.fixed_dictionaries(
            {},
            optional={
                "mode": st.sampled_from(["Off", "Recommend", "Auto"]),
                "policyRef": names,
                "slo": st.fixed_dictionaries(
                    {},
                    optional={"ttft": objective(False), "itl": objective(False),
                              "targetAttainment": fractions},
                ),
            },
        ),
        "service": st.fixed_dictionaries({}, optional={"port": st.integers(1, 65535)}),
        "rollout": st.just(rollout),
        "pod": st.fixed_dictionaries(
            {}, optional={"labels": st.dictionaries(st.sampled_from(["a", "b/c"]), st.just("v"))}
        ),
    }  # fmt: skip
    gpu = optional.pop("gpu")  # always present: engine.tensorParallelSize was drawn <= count
    return draw(st.fixed_dictionaries({"model": models, "gpu": gpu}, optional=optional))


@st.composite
def policy_specs(draw: st.DrawFn) -> dict[str, Any]:
    lo = draw(st.integers(1, 1000))
    window = draw(st.sampled_from(["30s", "1m", "90s", "5m", "10m"]))  # <= default verifyWindow
    return draw(
        st.fixed_dictionaries(
            {"slo": st.fixed_dictionaries({"ttft": objective(True), "itl": objective(True)})},
            optional={
                "bounds": st.fixed_dictionaries(
                    {},
                    optional={
                        "maxNumSeqs": st.fixed_dictionaries(
                            {"min": st.just(lo), "max": st.integers(lo, 65536)}
                        ),
                        "gpuMemoryUtilization": st.fixed_dictionaries(
                            {"min": st.just(0.5), "max": st.floats(0.5, 0.99)}
                        ),
                    },
                ),
                "rollout": st.fixed_dictionaries(
                    {"verifyWindow": st.just("3h")},
                    optional={"minInterval": durations, "maxPerDay": st.integers(0, 1000)},
                ),
                "evaluationWindow": st.just(window),
                "minRequestsPerWindow": st.integers(0, 10_000),
                "allowedModes": st.sampled_from([["Off"], ["Recommend", "Auto"]]),
            },
        )
    )


def _wrap(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": "x"}, "spec": spec}


def _round_trip(model: type[BaseModel], spec: dict[str, Any], crd: dict[str, Any]) -> None:
    parsed = model.model_validate(spec)
    dumped = parsed.model_dump(by_alias=True, mode="json", exclude_none=True)
    assert model.model_validate(dumped) == parsed
    assert model.model_validate_json(parsed.model_dump_json(by_alias=True)) == parsed
    assert [str(v) for v in validate(crd, _wrap(crd["spec"]["names"]["kind"], dumped))] == []


@SETTINGS
@given(deployment_specs())
def test_deployment_spec_round_trips(spec: dict[str, Any]) -> None:
    _round_trip(VLLMDeploymentSpec, spec, DEPLOYMENT_CRD)


@SETTINGS
@given(policy_specs())
def test_policy_spec_round_trips(spec: dict[str, Any]) -> None:
    _round_trip(VLLMTuningPolicySpec, spec, POLICY_CRD)


def _accepted_by_model(model: type[BaseModel], spec: dict[str, Any]) -> bool:
    try:
        model.model_validate(spec)
    except ValidationError:
        return False
    return True


@SETTINGS
@given(
    count=st.integers(1, 16),
    tp=st.integers(1, 16),
    mnbt=st.integers(1, 4096),
    mns=st.integers(1, 4096),
    gmu=st.floats(-0.1, 1.2),
    surge=st.sampled_from([0, 1, "0%", "25%", "100%", "150%", -1, "x"]),
    unavailable=st.sampled_from([0, 1, "0%", "50%", -2]),
    args=st.lists(st.sampled_from(FREE_ARGS + OWNED_ARGS), max_size=3),
)
def test_crd_and_model_agree_on_deployments(
    count: int, tp: int, mnbt: int, mns: int, gmu: float, surge: Any, unavailable: Any,
    args: list[str],
) -> None:  # fmt: skip
    spec = {
        "model": "org/m",
        "gpu": {"count": count},
        "engine": {"tensorParallelSize": tp, "extraArgs": args},
        "knobs": {"maxNumBatchedTokens": mnbt, "maxNumSeqs": mns, "gpuMemoryUtilization": gmu},
        "rollout": {"maxSurge": surge, "maxUnavailable": unavailable},
    }
    by_crd = not validate(DEPLOYMENT_CRD, _wrap("VLLMDeployment", spec))
    assert by_crd == _accepted_by_model(VLLMDeploymentSpec, spec)


@SETTINGS
@given(
    lo=st.integers(-1, 2000),
    hi=st.integers(-1, 2000),
    gmu_lo=st.floats(0, 1.0),
    gmu_hi=st.floats(0, 1.0),
    window=st.sampled_from(["0s", "30s", "5m", "1h", "5 m", "1d"]),
    verify=st.sampled_from(["0s", "1m", "10m", "2h"]),
    start=st.sampled_from(["00:00", "23:59", "24:00", "7:00"]),
    end=st.sampled_from(["00:00", "06:30"]),
    operator=st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]),
    values=st.lists(st.just("a"), max_size=2),
)
def test_crd_and_model_agree_on_policies(
    lo: int, hi: int, gmu_lo: float, gmu_hi: float, window: str, verify: str, start: str,
    end: str, operator: str, values: list[str],
) -> None:  # fmt: skip
    spec = {
        "slo": {"ttft": {"thresholdMs": 100}, "itl": {"thresholdMs": 10}},
        "bounds": {
            "maxNumSeqs": {"min": lo, "max": hi},
            "gpuMemoryUtilization": {"min": gmu_lo, "max": gmu_hi},
        },
        "evaluationWindow": window,
        "rollout": {"verifyWindow": verify, "maintenanceWindows": [{"start": start, "end": end}]},
        "namespaceSelector": {"matchExpressions": [{"key": "k", "operator": operator,
                                                    "values": values}]},
    }  # fmt: skip
    by_crd = not validate(POLICY_CRD, _wrap("VLLMTuningPolicy", spec))
    assert by_crd == _accepted_by_model(VLLMTuningPolicySpec, spec)
