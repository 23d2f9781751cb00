"""The generated CRDs: structural, accepted by Kubernetes' own schema, named and columned as
documented, CEL rules that compile and stay cheap, and crds/ in sync with the models."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.crd_validation import (
    all_rules,
    compile_rule,
    crd_schema,
    iter_nodes,
    structural_problems,
)
from vllm_autotuner import GROUP, VERSION
from vllm_autotuner.api.crds import (
    HEADER,
    crd_filename,
    render_crd_yaml,
    render_crds,
    render_crds_yaml,
    write_crds,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
KINDS = ["VLLMDeployment", "VLLMTuningPolicy"]


def newest_kubernetes_version() -> str:
    """The newest schema set kubernetes-validate ships (CEL is GA since 1.29)."""
    return str(kubernetes_validate.latest_version())


@pytest.mark.parametrize("kind", KINDS)
def test_schema_is_structural(kind: str, crds_by_kind: dict[str, dict[str, Any]]) -> None:
    assert structural_problems(crd_schema(crds_by_kind[kind])) == []


def test_structural_check_can_fail() -> None:
    broken = {
        "type": "object",
        "properties": {"a": {"anyOf": [{"type": "string"}]}, "b": {"$ref": "#/x"}},
        "additionalProperties": False,
    }
    assert len(structural_problems(broken)) >= 4


@pytest.mark.parametrize("kind", KINDS)
def test_kubernetes_accepts_crd(kind: str, crds_by_kind: dict[str, dict[str, Any]]) -> None:
    kubernetes_validate.validate(crds_by_kind[kind], newest_kubernetes_version(), strict=True)


def test_kubernetes_validation_can_fail(crds_by_kind: dict[str, dict[str, Any]]) -> None:
    crd = copy.deepcopy(crds_by_kind["VLLMDeployment"])
    spec = crd_schema(crd)["properties"]["spec"]
    spec["properties"]["replicas"]["exclusiveMinimum"] = 0  # JSON Schema 2020 form: invalid here
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(crd, newest_kubernetes_version(), strict=True)


@pytest.mark.parametrize(
    ("kind", "plural", "short", "scope"),
    [
        ("VLLMDeployment", "vllmdeployments", "vllmd", "Namespaced"),
        ("VLLMTuningPolicy", "vllmtuningpolicies", "vtp", "Cluster"),
    ],
)
def test_names_and_scope(
    kind: str, plural: str, short: str, scope: str, crds_by_kind: dict[str, dict[str, Any]]
) -> None:
    crd = crds_by_kind[kind]
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{plural}.{GROUP}"
    assert spec["group"] == GROUP
    assert spec["scope"] == scope
    assert spec["names"]["kind"] == kind
    assert spec["names"]["plural"] == plural
    assert spec["names"]["singular"] == kind.lower()
    assert spec["names"]["shortNames"] == [short]
    assert spec["names"]["categories"] == ["vllm"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == (VERSION, True, True)
    if kind == "VLLMDeployment":
        # HPA, KEDA and kubectl scale target the VLLMDeployment through /scale.
        scale = version["subresources"]["scale"]
        assert version["subresources"]["status"] == {}
        assert scale == {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
        for path in scale.values():
            node = _resolve(version["schema"]["openAPIV3Schema"], path)
            assert node is not None, path
        replicas = _resolve(version["schema"]["openAPIV3Schema"], ".status.replicas")
        selector = _resolve(version["schema"]["openAPIV3Schema"], ".status.selector")
        assert replicas is not None and replicas["type"] == "integer"
        assert selector is not None and selector["type"] == "string"
    else:
        assert version["subresources"] == {"status": {}}


def _resolve(schema: dict[str, Any], json_path: str) -> dict[str, Any] | None:
    """The schema node a simple printer-column path points to (None for metadata)."""
    if json_path.startswith(".metadata."):
        return None
    if json_path.startswith(".status.conditions[?("):
        conditions = schema["properties"]["status"]["properties"]["conditions"]
        node: dict[str, Any] = conditions["items"]["properties"]["status"]
        return node
    node = schema
    for part in json_path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_deployment_printer_columns(crds_by_kind: dict[str, dict[str, Any]]) -> None:
    crd = crds_by_kind["VLLMDeployment"]
    columns = {c["name"]: c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert list(columns) == [
        "Model", "Mode", "Ready", "MNBT", "MNS", "GMU", "TTFT-P95", "ITL-P95", "SLO-Met",
        "Phase", "Strategy", "Candidate", "Replicas", "Capacity", "Age",
    ]  # fmt: skip
    assert columns["Replicas"]["jsonPath"] == ".status.replicas"
    assert columns["Capacity"]["jsonPath"] == ".status.capacity.perReplicaRps"
    assert columns["Capacity"]["priority"] == 1  # kubectl get -o wide
    assert columns["Model"]["jsonPath"] == ".spec.model"
    assert columns["Mode"]["jsonPath"] == ".spec.tuning.mode"
    assert columns["Ready"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["SLO-Met"]["jsonPath"] == '.status.conditions[?(@.type=="SLOMet")].status'
    assert columns["MNBT"]["jsonPath"] == ".status.tuning.applied.maxNumBatchedTokens"
    assert columns["TTFT-P95"]["jsonPath"] == ".status.observed.ttftP95Ms"
    assert columns["ITL-P95"]["jsonPath"] == ".status.observed.itlP95Ms"
    # A trial, and a canary's knobs, show in `kubectl get vllmd`.
    assert columns["Phase"]["jsonPath"] == ".status.tuning.phase"
    assert columns["Strategy"]["jsonPath"] == ".status.tuning.strategy"
    assert columns["Candidate"]["jsonPath"] == ".status.tuning.candidate.maxNumBatchedTokens"
    assert columns["Age"] == {
        "name": "Age",
        "type": "date",
        "jsonPath": ".metadata.creationTimestamp",
    }
    _columns_point_at_typed_fields(crd)


def test_policy_printer_columns(crds_by_kind: dict[str, dict[str, Any]]) -> None:
    crd = crds_by_kind["VLLMTuningPolicy"]
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in columns] == ["TTFT", "ITL", "Age"]
    assert columns[0]["jsonPath"] == ".spec.slo.ttft.thresholdMs"
    assert columns[1]["jsonPath"] == ".spec.slo.itl.thresholdMs"
    _columns_point_at_typed_fields(crd)


def _columns_point_at_typed_fields(crd: dict[str, Any]) -> None:
    """A column's type must match the field's, or kubectl prints <invalid>/blank."""
    schema = crd_schema(crd)
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        node = _resolve(schema, column["jsonPath"])
        if node is None:
            continue
        expected = {"integer": "integer", "number": "number", "string": "string"}[node["type"]]
        assert column["type"] == expected, column


@pytest.mark.parametrize("kind", KINDS)
def test_cel_rules_compile_and_have_messages(
    kind: str, crds_by_kind: dict[str, dict[str, Any]]
) -> None:
    rules = all_rules(crd_schema(crds_by_kind[kind]))
    assert rules
    for _, rule in rules:
        compile_rule(rule["rule"])
        assert rule["message"]


def test_cross_field_rules_sit_on_the_documented_nodes(
    crds_by_kind: dict[str, dict[str, Any]],
) -> None:
    paths = {
        kind: {path for path, _ in all_rules(crd_schema(crds_by_kind[kind]))} for kind in KINDS
    }
    assert {
        ".properties.spec",
        ".properties.spec.knobs",
        ".properties.spec.rollout",
        ".properties.spec.engine.extraArgs[]",
    } <= {p.replace(".spec", ".properties.spec", 1) for p in paths["VLLMDeployment"]}
    assert {
        ".spec",
        ".spec.bounds.maxNumBatchedTokens",
        ".spec.bounds.maxNumSeqs",
        ".spec.bounds.gpuMemoryUtilization",
        ".spec.rollout.maintenanceWindows[]",
        ".spec.namespaceSelector.matchExpressions[]",
    } <= paths["VLLMTuningPolicy"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_list_and_string_is_bounded(
    kind: str, crds_by_kind: dict[str, dict[str, Any]]
) -> None:
    """CEL cost estimation needs maxItems/maxLength; unbounded input is also a DoS vector."""
    unbounded = []
    for path, node in iter_nodes(crd_schema(crds_by_kind[kind])):
        if path in (".apiVersion", ".kind"):
            continue
        if node.get("type") == "array" and "maxItems" not in node:
            unbounded.append(path)
        if node.get("type") == "string" and not (
            "maxLength" in node or "enum" in node or "format" in node
        ):
            unbounded.append(path)
        if "additionalProperties" in node and "maxProperties" not in node:
            unbounded.append(path)
    assert unbounded == []


def test_conditions_follow_metav1(crds_by_kind: dict[str, dict[str, Any]]) -> None:
    for kind in KINDS:
        status = crd_schema(crds_by_kind[kind])["properties"]["status"]
        conditions = status["properties"]["conditions"]
        assert conditions["x-kubernetes-list-type"] == "map"
        assert conditions["x-kubernetes-list-map-keys"] == ["type"]
        assert conditions["maxItems"] == 16
        item = conditions["items"]
        assert set(item["required"]) >= {"type", "status", "lastTransitionTime", "reason"}
        assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
        assert item["properties"]["lastTransitionTime"]["format"] == "date-time"
        assert item["properties"]["message"]["maxLength"] == 32768


def test_render_is_deterministic_and_headed() -> None:
    first = render_crds_yaml()
    assert first == render_crds_yaml()
    assert first.startswith(HEADER)
    docs = list(yaml.safe_load_all(first))
    assert docs == render_crds()


@pytest.mark.parametrize("crd", render_crds(), ids=KINDS)
def test_committed_crds_are_fresh(crd: dict[str, Any]) -> None:
    """Fails when the models changed but crds/ was not regenerated (vllm-autotuner crds)."""
    path = REPO_ROOT / "crds" / crd_filename(crd)
    assert path.read_text(encoding="utf-8") == render_crd_yaml(crd), (
        f"{path} is stale: run `vllm-autotuner crds --out crds`"
    )


def test_write_crds(tmp_path: Path) -> None:
    written = write_crds(tmp_path / "out")
    assert sorted(p.name for p in written) == [
        "vllm.autotuner.io_vllmdeployments.yaml",
        "vllm.autotuner.io_vllmtuningpolicies.yaml",
    ]
    for path in written:
        (doc,) = yaml.safe_load_all(path.read_text(encoding="utf-8"))
        assert doc in render_crds()
