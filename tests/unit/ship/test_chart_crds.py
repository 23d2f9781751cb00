"""The chart's CRDs are the generated ones in crds/, only labelled and protected by the chart.

crds/ is generated from the API models; scripts/sync-chart-crds.py copies it into the chart.
These tests fail when the copy drifts, when the templating changes a CRD, or when the chart's
own custom resources (the default policy) do not pass the CRD's schema and CEL rules.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support import crd_validation
from tests.support import helm as chart

ROOT = chart.REPO_ROOT
SOURCE = ROOT / "crds"
CHART_COPY = chart.CHART_DIR / "files" / "crds"
SCRIPT = ROOT / "scripts" / "sync-chart-crds.py"
KEEP = "helm.sh/resource-policy"
GROUP = "vllm.autotuner.io"
EXPECTED_FILES = {
    "vllm.autotuner.io_vllmdeployments.yaml",
    "vllm.autotuner.io_vllmtuningpolicies.yaml",
}

pytestmark = pytest.mark.skipif(
    not any(SOURCE.glob("*.yaml")),
    reason="crds/ is empty: generate it with `make crds`, then run scripts/sync-chart-crds.py",
)


def source_crds() -> dict[str, dict[str, Any]]:
    crds = (yaml.safe_load(p.read_text()) for p in sorted(SOURCE.glob("*.yaml")))
    return {crd["metadata"]["name"]: crd for crd in crds}


def rendered_crds(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    objects = chart.render_objects(values)
    return {
        o["metadata"]["name"]: o
        for o in chart.find(objects, "CustomResourceDefinition")
        if o["spec"]["group"] == GROUP
    }


def without_chart_metadata(crd: dict[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(crd)
    stripped["metadata"].pop("labels", None)
    stripped["metadata"].pop("annotations", None)
    return stripped


def test_chart_copy_is_byte_identical_to_crds() -> None:
    assert {p.name for p in SOURCE.glob("*.yaml")} == EXPECTED_FILES
    copies = {p.name: p.read_bytes() for p in CHART_COPY.glob("*.yaml")}
    originals = {p.name: p.read_bytes() for p in SOURCE.glob("*.yaml")}
    assert copies == originals, "run: python scripts/sync-chart-crds.py"


def test_sync_script_reports_drift_and_repairs_it(tmp_path: Path) -> None:
    target = tmp_path / "crds"
    check = [sys.executable, str(SCRIPT), "--target", str(target), "--check"]
    assert subprocess.run(check, capture_output=True).returncode == 1
    sync = [sys.executable, str(SCRIPT), "--target", str(target)]
    assert subprocess.run(sync, capture_output=True).returncode == 0
    (target / "stale.yaml").write_text("kind: Stale\n")
    assert subprocess.run(check, capture_output=True).returncode == 1
    assert subprocess.run(sync, capture_output=True).returncode == 0
    assert subprocess.run(check, capture_output=True).returncode == 0
    assert {p.name for p in target.iterdir()} == EXPECTED_FILES


def test_rendered_crds_equal_the_generated_ones() -> None:
    rendered = rendered_crds()
    source = source_crds()
    assert set(rendered) == set(source)
    for name, crd in rendered.items():
        assert without_chart_metadata(crd) == without_chart_metadata(source[name])
        labels = crd["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "vllm-autotuner"
        assert labels["helm.sh/chart"].startswith("vllm-autotuner-")
        assert crd["metadata"]["annotations"][KEEP] == "keep"


def test_crds_keep_and_install_switches() -> None:
    for crd in rendered_crds({"crds": {"keep": False}}).values():
        assert KEEP not in (crd["metadata"].get("annotations") or {})
    annotated = rendered_crds({"crds": {"annotations": {"example.com/owner": "platform"}}})
    for crd in annotated.values():
        assert crd["metadata"]["annotations"]["example.com/owner"] == "platform"
        assert crd["metadata"]["annotations"][KEEP] == "keep"
    assert rendered_crds({"crds": {"install": False}}) == {}


def test_rendered_crds_validate_on_every_supported_kubernetes() -> None:
    for crd in rendered_crds().values():
        assert crd_validation.structural_problems(crd_validation.crd_schema(crd)) == []
        for version in chart.bundled_versions():
            kubernetes_validate.validate(crd, version, strict=True)


def test_default_policy_passes_the_policy_crd() -> None:
    crd = source_crds()[f"vllmtuningpolicies.{GROUP}"]
    values = chart.ci_values()["default-policy"]
    (policy,) = chart.find(chart.render_objects(values), "VLLMTuningPolicy")
    assert [str(v) for v in crd_validation.validate(crd, policy)] == []
    broken = copy.deepcopy(policy)
    broken["spec"]["bounds"]["maxNumSeqs"]["min"] = 1024
    assert crd_validation.validate(crd, broken), "the CRD should refuse min > max"


def test_health_check_testdata_passes_the_crds() -> None:
    """The Argo CD testdata are what the API server would store, status included."""
    crds = {crd["spec"]["names"]["kind"]: crd for crd in source_crds().values()}
    base = ROOT / "argocd" / "resource_customizations" / GROUP
    for kind, crd in crds.items():
        for path in sorted((base / kind / "testdata").glob("*.yaml")):
            obj = yaml.safe_load(path.read_text())
            assert [str(v) for v in crd_validation.validate(crd, obj)] == [], path.name
