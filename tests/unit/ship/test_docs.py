"""The operations docs stay true: alerts are valid PromQL that fire when they should, the
metrics table matches what the operator exports, and cross-references resolve."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_autotuner.adapters.metrics import OperatorMetrics

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
OWN_DOCS = ("gitops.md", "operations.md", "troubleshooting.md")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Prometheus) not installed")


def yaml_blocks(markdown: str) -> list[Any]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", markdown, re.DOTALL)]


def prometheus_rule() -> dict[str, Any]:
    documents = yaml_blocks((DOCS / "operations.md").read_text())
    (rule,) = [d for d in documents if d.get("kind") == "PrometheusRule"]
    assert isinstance(rule, dict)
    return rule


def exported_metric_names() -> set[str]:
    """Sample names as Prometheus stores them (counters get `_total`)."""
    names = set()
    for family in OperatorMetrics().registry.collect():
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_metrics_table_lists_exactly_what_the_operator_exports() -> None:
    text = (DOCS / "operations.md").read_text()
    documented = set(re.findall(r"^\| `(vllm_autotuner_\w+)` \|", text, re.MULTILINE))
    assert documented == exported_metric_names()


def test_alerts_use_only_exported_metrics() -> None:
    exported = exported_metric_names()
    for group in prometheus_rule()["spec"]["groups"]:
        for rule in group["rules"]:
            for name in re.findall(r"vllm_autotuner_\w+", rule["expr"]):
                assert name.removesuffix("_bucket") in exported, name


def run_promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def expected_annotations(rule: dict[str, Any], labels: dict[str, str]) -> dict[str, str]:
    rendered = {}
    for key, value in rule["annotations"].items():
        for name, label in labels.items():
            value = value.replace("{{ $labels." + name + " }}", label)
        rendered[key] = value
    return rendered


@needs_promtool
def test_alerts_are_valid_and_fire_when_they_should(tmp_path: Path) -> None:
    spec = prometheus_rule()["spec"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    check = run_promtool(tmp_path, "check", "rules", "rules.yaml")
    assert check.returncode == 0, check.stdout + check.stderr

    rules = {r["alert"]: r for group in spec["groups"] for r in group["rules"]}
    workload = {"namespace": "team-a", "deployment": "llama"}
    series = 'vllm_autotuner_rollbacks_total{namespace="team-a",deployment="llama"}'
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                # Two rollbacks within minutes: the tuner keeps failing.
                "interval": "1m",
                "input_series": [{"series": series, "values": "0 0 1 1 2 2 2 2"}],
                "alert_rule_test": [
                    {
                        "eval_time": "7m",
                        "alertname": "VLLMAutotunerRepeatedRollbacks",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", **workload},
                                "exp_annotations": expected_annotations(
                                    rules["VLLMAutotunerRepeatedRollbacks"], workload
                                ),
                            }
                        ],
                    }
                ],
            },
            {
                # One rollback is the safety net working, not a problem.
                "interval": "1m",
                "input_series": [{"series": series, "values": "0 0 1 1 1 1 1 1"}],
                "alert_rule_test": [
                    {
                        "eval_time": "7m",
                        "alertname": "VLLMAutotunerRepeatedRollbacks",
                        "exp_alerts": [],
                    }
                ],
            },
            {
                # The operator's target went down 15 minutes ago.
                "interval": "1m",
                "input_series": [
                    {"series": 'up{job="vllm-autotuner-metrics"}', "values": "1x5 0x20"}
                ],
                "alert_rule_test": [
                    {"eval_time": "4m", "alertname": "VLLMAutotunerDown", "exp_alerts": []},
                    {
                        "eval_time": "20m",
                        "alertname": "VLLMAutotunerDown",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning"},
                                "exp_annotations": rules["VLLMAutotunerDown"]["annotations"],
                            }
                        ],
                    },
                ],
            },
        ],
    }
    (tmp_path / "rules_test.yaml").write_text(yaml.safe_dump(tests))
    result = run_promtool(tmp_path, "test", "rules", "rules_test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("doc", OWN_DOCS)
def test_links_between_docs_resolve(doc: str) -> None:
    text = (DOCS / doc).read_text()
    for target, anchor in re.findall(r"\]\(([\w.-]+\.md)(?:#([\w-]+))?\)", text):
        path = DOCS / target
        assert path.exists(), f"{doc} links to missing {target}"
        if anchor:
            assert anchor in heading_anchors(path.read_text()), f"{doc}: {target}#{anchor}"


@pytest.mark.parametrize("doc", OWN_DOCS)
def test_files_the_docs_point_to_exist(doc: str) -> None:
    text = (DOCS / doc).read_text()
    for path in re.findall(r"\b((?:examples|charts|argocd|crds)/[\w./-]+\.(?:yaml|lua))", text):
        assert (ROOT / path).exists(), f"{doc} mentions missing {path}"
    for block in yaml_blocks(text):
        assert block is not None


def test_troubleshooting_covers_the_known_symptoms() -> None:
    headings = {
        h.lower()
        for h in re.findall(r"^## (.+)$", (DOCS / "troubleshooting.md").read_text(), re.MULTILINE)
    }
    for symptom in ("progressing", "metricsavailable", "degraded", "pending", "vllm_", "deleted"):
        assert any(symptom in h for h in headings), symptom
