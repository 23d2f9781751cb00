"""Objects at the edges of validity: accepted by the CRD (no CEL evaluation error, so every
has() guard works) and by pydantic. Without these, a rule that rejects too much goes unnoticed."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.crd_validation import crd_schema, evaluate_rule, iter_nodes, validate
from tests.unit.api.test_invalid import DELETE, DEPLOYMENT, MODELS, POLICY, changed

D, P = DEPLOYMENT, POLICY
EDGES: list[tuple[str, dict[str, Any], tuple[tuple[str, Any], ...]]] = [
    ("minimal-deployment", {"apiVersion": D["apiVersion"], "kind": D["kind"],
                            "metadata": {"name": "m"}, "spec": {"model": "org/m"}}, ()),
    ("minimal-policy", {"apiVersion": P["apiVersion"], "kind": P["kind"],
                        "metadata": {"name": "p"},
                        "spec": {"slo": {"ttft": {"thresholdMs": 1}, "itl": {"thresholdMs": 1}}}},
     ()),
    ("only-mns-pinned", D, (("spec.knobs", {"maxNumSeqs": 64}),)),
    ("only-mnbt-pinned", D, (("spec.knobs", {"maxNumBatchedTokens": 64}),)),
    ("mnbt-equals-mns", D, (("spec.knobs", {"maxNumBatchedTokens": 64, "maxNumSeqs": 64}),)),
    ("gmu-at-max", D, (("spec.knobs", {"gpuMemoryUtilization": 0.99}),)),
    ("tp-equals-gpus", D, (("spec.gpu.count", 8), ("spec.engine.tensorParallelSize", 8))),
    ("no-engine-no-gpu", D, (("spec.engine", DELETE), ("spec.gpu", DELETE))),
    ("surge-only", D, (("spec.rollout", {"maxSurge": "25%", "maxUnavailable": 0}),)),
    ("rollout-empty", D, (("spec.rollout", {}),)),
    ("unavail-100pct", D, (("spec.rollout", {"maxUnavailable": "100%"}),)),
    ("free-args", D, (("spec.engine.extraArgs", ["--enforce-eager", "--models-dir=/x",
                                                 "--portable", "-O3", "--max-model-lens"]),)),
    ("model-local-path", D, (("spec.model", "/models/llama-3.1-8b"),)),
    ("model-s3", D, (("spec.model", "s3://bucket/llama/8b"),)),
    ("replicas-zero", D, (("spec.replicas", 0),)),
    ("slo-override-partial", D, (("spec.tuning.slo", {"itl": {"thresholdMs": 20}}),)),
    ("mode-off-quoted", D, (("spec.tuning.mode", "Off"),)),
    ("bounds-point", P, (("spec.bounds.maxNumSeqs", {"min": 64, "max": 64}),)),
    ("bounds-partial", P, (("spec.bounds.gpuMemoryUtilization", {"max": 0.9}),)),
    ("window-overnight", P, (("spec.rollout.maintenanceWindows",
                              [{"days": ["Sat", "Sun"], "start": "22:00", "end": "04:00",
                                "timezone": "Europe/Berlin"}]),)),
    ("min-interval-zero", P, (("spec.rollout.minInterval", "0s"),)),
    ("verify-equals-window", P, (("spec.evaluationWindow", "90s"),
                                 ("spec.rollout.verifyWindow", "1m30s"))),
    ("selector", P, (("spec.namespaceSelector",
                      {"matchLabels": {"team": "ml"},
                       "matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["dev"]},
                                            {"key": "gpu", "operator": "Exists"}]}),)),
    ("one-mode", P, (("spec.allowedModes", ["Recommend"]),)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "base", "changes"), EDGES, ids=[e[0] for e in EDGES])
def test_edge_is_accepted(
    name: str,
    base: dict[str, Any],
    changes: tuple[tuple[str, Any], ...],
    crds_by_kind: dict[str, dict[str, Any]],
) -> None:
    obj = changed(base, changes)
    assert [str(v) for v in validate(crds_by_kind[obj["kind"]], obj)] == []
    MODELS[obj["kind"]].model_validate(obj)


@pytest.mark.parametrize("kind", ["VLLMDeployment", "VLLMTuningPolicy"])
def test_object_rules_tolerate_missing_optional_fields(
    kind: str, crds_by_kind: dict[str, dict[str, Any]]
) -> None:
    """Each object rule, bound to an object holding only its required fields, evaluates cleanly
    (true or false, never "no such key"): the has() guards cover every optional field."""
    checked = 0
    for path, node in iter_nodes(crd_schema(crds_by_kind[kind])):
        rules = node.get("x-kubernetes-validations", [])
        if node.get("type") != "object" or not rules:
            continue
        minimal = {name: _sample(node["properties"][name]) for name in node.get("required", [])}
        for rule in rules:
            verdict = evaluate_rule(rule["rule"], node, minimal)
            assert isinstance(verdict, bool), (path, rule["rule"], verdict)
            checked += 1
    assert checked >= 3


def _sample(node: dict[str, Any]) -> Any:
    """Some value of the node's type; only its presence matters to has() guards."""
    if "enum" in node:
        return node["enum"][0]
    return {"string": "00:00", "integer": 1, "number": 1.0, "boolean": True, "array": []}.get(
        node.get("type", "object"), {}
    )
