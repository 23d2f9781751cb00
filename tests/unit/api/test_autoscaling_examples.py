"""The autoscaler examples (examples/autoscaling/) are valid objects that fit together: the
HPAs pass Kubernetes' own schema, the VLLMDeployments the CRD and the model, every target has a
scale subresource, and the KEDA query, the recording rule and the HPA targets say the same.
tests/integration/test_autoscaling_examples.py runs the query itself in a real Prometheus."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.crd_validation import validate
from tests.unit.api.conftest import EXAMPLES_DIR
from vllm_autotuner.api import VLLMDeployment

AUTOSCALING = EXAMPLES_DIR / "autoscaling"
FILES = sorted(AUTOSCALING.glob("*.yaml"))
# Kinds an HPA or KEDA can scale here: they have the scale subresource.
SCALABLE = {("vllm.autotuner.io/v1alpha1", "VLLMDeployment"), ("apps/v1", "Deployment")}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def by_kind(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in FILES for d in documents(p) if d.get("kind") == kind]


def keda_query() -> str:
    ((_, scaled),) = by_kind("ScaledObject")
    (trigger,) = scaled["spec"]["triggers"]
    return str(trigger["metadata"]["query"])


def recorded_expression() -> str:
    ((_, rule),) = by_kind("PrometheusRule")
    ((group),) = rule["spec"]["groups"]
    (record,) = group["rules"]
    return str(record["expr"])


def test_the_examples_cover_keda_an_hpa_on_each_target_and_the_adapter() -> None:
    names = {p.name for p in FILES}
    assert {"keda-scaledobject.yaml", "hpa-vllmdeployment.yaml", "hpa-deployment.yaml",
            "prometheus-adapter-values.yaml"} <= names  # fmt: skip
    scalers = [*by_kind("HorizontalPodAutoscaler"), *by_kind("ScaledObject")]
    refs = [d["spec"]["scaleTargetRef"] for _, d in scalers]
    targets = {(ref["apiVersion"], ref["kind"]) for ref in refs}
    assert targets == SCALABLE


@pytest.mark.parametrize(("name", "hpa"), by_kind("HorizontalPodAutoscaler"))
def test_hpas_pass_the_kubernetes_schema(name: str, hpa: dict[str, Any]) -> None:
    kubernetes_validate.validate(hpa, str(kubernetes_validate.latest_version()), strict=True)


def test_the_schema_check_can_fail() -> None:
    ((_, hpa),) = by_kind("HorizontalPodAutoscaler")[:1]
    broken = {**hpa, "spec": {**hpa["spec"], "maxReplicas": "eight"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, str(kubernetes_validate.latest_version()), strict=True)


@pytest.mark.parametrize(("name", "doc"), by_kind("VLLMDeployment"))
def test_vllmdeployments_pass_the_crd_and_the_model(
    name: str, doc: dict[str, Any], crds_by_kind: dict[str, dict[str, Any]]
) -> None:
    assert [str(v) for v in validate(crds_by_kind["VLLMDeployment"], doc)] == []
    VLLMDeployment.model_validate(doc)


def test_an_hpa_on_the_deployment_comes_with_its_vllmdeployment_settings() -> None:
    """The Deployment's count is the HPA's only when the VLLMDeployment says so, and its
    canary then needs surge (one pod beyond the HPA's count)."""
    (doc,) = documents(AUTOSCALING / "hpa-deployment.yaml")[:1]
    spec = VLLMDeployment.model_validate(doc).spec
    assert spec.autoscaling.target == "Deployment"
    assert spec.rollout.max_surge not in (0, "0%")
    (hpa,) = [d for d in documents(AUTOSCALING / "hpa-deployment.yaml") if d["kind"] != doc["kind"]]
    assert hpa["spec"]["scaleTargetRef"]["name"] == doc["metadata"]["name"]


def test_keda_and_the_hpas_scale_on_the_same_load_over_capacity_at_the_same_target() -> None:
    assert " ".join(keda_query().split()) == " ".join(recorded_expression().split())
    assert (
        'vllm_autotuner_capacity_rps{namespace="team-a", deployment="llama", source="predicted"}'
        in keda_query()
    )
    ((_, scaled),) = by_kind("ScaledObject")
    threshold = float(scaled["spec"]["triggers"][0]["metadata"]["threshold"])
    for _, hpa in by_kind("HorizontalPodAutoscaler"):
        (metric,) = hpa["spec"]["metrics"]
        target = metric["external"]["target"]
        assert target["type"] == "AverageValue"
        assert float(target["averageValue"].removesuffix("m")) / 1000 == threshold
        assert metric["external"]["metric"]["name"] == "vllm_autotuner_replicas_needed"
    adapter = documents(AUTOSCALING / "prometheus-adapter-values.yaml")[0]
    (rule,) = adapter["rules"]["external"]
    assert rule["name"]["as"] == "vllm_autotuner_replicas_needed"
    assert rule["seriesQuery"].startswith("vllm_autotuner:replicas_needed")
