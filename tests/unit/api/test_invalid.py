"""A table of invalid objects: each must be rejected by the CRD (schema or a CEL rule, with the
expected message) AND by the pydantic model, at the same place or with the same message."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from tests.support.crd_validation import validate
from tests.unit.api.conftest import example_documents
from vllm_autotuner.api import VLLMDeployment, VLLMTuningPolicy
from vllm_autotuner.api.common import MNBT_GE_MNS, SELECTOR_VALUES_PRESENT
from vllm_autotuner.api.deployment import (
    INT_OR_PERCENT,
    ROLLOUT_NOT_BOTH_ZERO,
    TP_LE_GPU_COUNT,
)
from vllm_autotuner.api.policy import (
    DURATION_POSITIVE,
    MIN_LE_MAX,
    VERIFY_COVERS_WINDOW,
    WINDOW_START_NE_END,
)

DELETE = object()
BASES = {name.split(":")[0]: doc for name, doc in example_documents()}
DEPLOYMENT = BASES["llama-3.1-8b-h100.yaml"]
POLICY = BASES["policy-default.yaml"]
MODELS: dict[str, type[BaseModel]] = {
    "VLLMDeployment": VLLMDeployment,
    "VLLMTuningPolicy": VLLMTuningPolicy,
}


@dataclass(frozen=True)
class Case:
    """``changes`` are (dotted path, value or DELETE) applied to a valid base object.

    ``cel`` is the expected CEL message; ``schema`` a fragment of the expected OpenAPI error.
    """

    id: str
    base: dict[str, Any]
    changes: tuple[tuple[str, Any], ...]
    cel: str | None = None
    schema: str | None = None


def changed(base: dict[str, Any], changes: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    obj = copy.deepcopy(base)
    for path, value in changes:
        *parents, leaf = path.split(".")
        node = obj
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return obj


D, P = DEPLOYMENT, POLICY
CASES = [
    # --- VLLMDeployment: schema
    Case("model-whitespace", D, (("spec.model", "meta llama/x"),), schema="does not match"),
    Case("model-missing", D, (("spec.model", DELETE),), schema="'model' is a required property"),
    Case("model-empty", D, (("spec.model", ""),), schema="should be non-empty"),
    Case("model-quote", D, (("spec.model", 'a"b'),), schema="does not match"),
    Case("replicas-too-many", D, (("spec.replicas", 65),), schema="greater than the maximum"),
    Case("gpu-count-zero", D, (("spec.gpu.count", 0),), schema="less than the minimum"),
    Case("gmu-zero", D, (("spec.knobs", {"gpuMemoryUtilization": 0}),), schema="less than"),
    Case("gmu-one", D, (("spec.knobs", {"gpuMemoryUtilization": 1.0}),), schema="maximum"),
    Case("mnbt-huge", D, (("spec.knobs", {"maxNumBatchedTokens": 2**21}),), schema="maximum"),
    Case("mode-unknown", D, (("spec.tuning.mode", "Aggressive"),), schema="is not one of"),
    Case("mode-yaml-off", D, (("spec.tuning.mode", False),), schema="is not of type 'string'"),
    Case("percentile", D, (("spec.tuning.slo", {"ttft": {"percentile": 99.99}}),), schema="max"),
    Case("block-size", D, (("spec.engine.blockSize", 24),), schema="is not one of"),
    Case("kv-dtype", D, (("spec.engine.kvCacheDtype", "int4"),), schema="is not one of"),
    Case("arg-newline", D, (("spec.engine.extraArgs", ["--x\n--port=1"]),), schema="match"),
    Case("args-too-many", D, (("spec.engine.extraArgs", ["--x"] * 65),), schema="too long"),
    Case("unknown-field", D, (("spec.engine.maxNumSeqs", 8),), schema="Additional properties"),
    Case("service-port", D, (("spec.service.port", 0),), schema="less than the minimum"),
    Case("served-name", D, (("spec.servedModelName", "bad name"),), schema="does not match"),
    Case("pull-policy", D, (("spec.imagePullPolicy", "Sometimes"),), schema="is not one of"),
    # --- VLLMDeployment: CEL
    Case("tp-gt-gpus", D, (("spec.engine.tensorParallelSize", 4),), cel=TP_LE_GPU_COUNT.message),
    Case(
        "mnbt-lt-mns",
        D,
        (("spec.knobs", {"maxNumBatchedTokens": 128, "maxNumSeqs": 256}),),
        cel=MNBT_GE_MNS.message,
    ),
    Case("arg-mns", D, (("spec.engine.extraArgs", ["--max-num-seqs", "64"]),), cel="owns"),
    Case("arg-gmu-eq", D, (("spec.engine.extraArgs", ["--gpu-memory-utilization=0.95"]),), "owns"),
    Case(
        "arg-underscore", D, (("spec.engine.extraArgs", ["--max_num_batched_tokens=4096"]),), "owns"
    ),
    Case("arg-tp-short", D, (("spec.engine.extraArgs", ["-tp", "2"]),), cel="owns"),
    Case("arg-port", D, (("spec.engine.extraArgs", ["--enforce-eager", "--port=9000"]),), "owns"),
    Case("arg-kv-bytes", D, (("spec.engine.extraArgs", ["--kv-cache-memory-bytes=8G"]),), "owns"),
    Case(
        "rollout-zero",
        D,
        (("spec.rollout", {"maxSurge": 0, "maxUnavailable": 0}),),
        cel=ROLLOUT_NOT_BOTH_ZERO.message,
    ),
    Case(
        "rollout-zero-pct",
        D,
        (("spec.rollout", {"maxSurge": "0%", "maxUnavailable": 0}),),
        cel=ROLLOUT_NOT_BOTH_ZERO.message,
    ),
    Case(
        "rollout-default-surge-zero",
        D,
        (("spec.rollout", {"maxUnavailable": "0%"}),),
        cel=ROLLOUT_NOT_BOTH_ZERO.message,
    ),
    Case("surge-150pct", D, (("spec.rollout.maxSurge", "150%"),), cel=INT_OR_PERCENT.message),
    Case("unavail-neg", D, (("spec.rollout.maxUnavailable", -1),), cel=INT_OR_PERCENT.message),
    # --- VLLMTuningPolicy: schema
    Case("itl-missing", P, (("spec.slo.itl", DELETE),), schema="'itl' is a required property"),
    Case("threshold-zero", P, (("spec.slo.ttft.thresholdMs", 0),), schema="less than or equal"),
    Case("gmu-max-1", P, (("spec.bounds.gpuMemoryUtilization.max", 1.0),), schema="maximum"),
    Case("step-zero", P, (("spec.bounds.maxNumBatchedTokens.maxStep", 0),), schema="less than"),
    Case("interval-words", P, (("spec.rollout.minInterval", "15 minutes"),), schema="match"),
    Case("per-day-neg", P, (("spec.rollout.maxPerDay", -1),), schema="less than the minimum"),
    Case(
        "window-clock",
        P,
        (("spec.rollout.maintenanceWindows", [{"start": "25:00", "end": "03:00"}]),),
        schema="does not match",
    ),
    Case(
        "window-days-repeat",
        P,
        (
            (
                "spec.rollout.maintenanceWindows",
                [{"days": ["Mon", "Mon"], "start": "01:00", "end": "03:00"}],
            ),
        ),
        schema="non-unique",
    ),
    Case("modes-empty", P, (("spec.allowedModes", []),), schema="should be non-empty"),
    Case("modes-repeat", P, (("spec.allowedModes", ["Auto", "Auto"]),), schema="non-unique"),
    # --- VLLMTuningPolicy: CEL
    Case(
        "mns-min-gt-max",
        P,
        (("spec.bounds.maxNumSeqs", {"min": 512, "max": 256}),),
        cel=MIN_LE_MAX.message,
    ),
    Case(
        "gmu-min-gt-default-max",
        P,
        (("spec.bounds.gpuMemoryUtilization", {"min": 0.97}),),
        cel=MIN_LE_MAX.message,
    ),
    Case("verify-zero", P, (("spec.rollout.verifyWindow", "0s"),), cel=DURATION_POSITIVE.message),
    Case("eval-zero", P, (("spec.evaluationWindow", "0m"),), cel=DURATION_POSITIVE.message),
    Case(
        "verify-shorter-than-window",
        P,
        (("spec.evaluationWindow", "20m"), ("spec.rollout.verifyWindow", "10m")),
        cel=VERIFY_COVERS_WINDOW.message,
    ),
    Case(
        "window-empty",
        P,
        (("spec.rollout.maintenanceWindows", [{"start": "02:00", "end": "02:00"}]),),
        cel=WINDOW_START_NE_END.message,
    ),
    Case(
        "selector-in-without-values",
        P,
        (("spec.namespaceSelector", {"matchExpressions": [{"key": "team", "operator": "In"}]}),),
        cel=SELECTOR_VALUES_PRESENT.message,
    ),
    Case(
        "selector-exists-with-values",
        P,
        (
            (
                "spec.namespaceSelector",
                {"matchExpressions": [{"key": "team", "operator": "Exists", "values": ["a"]}]},
            ),
        ),
        cel=SELECTOR_VALUES_PRESENT.message,
    ),
]


def test_table_is_large_and_balanced() -> None:
    assert len(CASES) >= 20
    assert sum(c.cel is not None for c in CASES) >= 10
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_crd_rejects(case: Case, crds_by_kind: dict[str, dict[str, Any]]) -> None:
    obj = changed(case.base, case.changes)
    messages = [v.message for v in validate(crds_by_kind[obj["kind"]], obj)]
    expected = case.cel if case.cel is not None else case.schema
    assert expected is not None
    assert any(expected in m for m in messages), messages
    assert not any(m.startswith("CEL evaluation error") for m in messages), messages


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_model_rejects(case: Case, crds_by_kind: dict[str, dict[str, Any]]) -> None:
    obj = changed(case.base, case.changes)
    with pytest.raises(ValidationError) as caught:
        MODELS[obj["kind"]].model_validate(obj)
    if case.cel is not None:
        assert case.cel in str(caught.value)
    else:
        # Same place: pydantic's error location lies at or below the schema violation's path.
        schema_paths = [v.path for v in validate(crds_by_kind[obj["kind"]], obj)]
        pydantic_paths = [
            "." + ".".join(str(p) for p in error["loc"]) for error in caught.value.errors()
        ]
        assert any(p.startswith(s) for p in pydantic_paths for s in schema_paths), (
            pydantic_paths,
            schema_paths,
        )
