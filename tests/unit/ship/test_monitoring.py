"""The chart's monitoring: a PrometheusRule whose alerts the real Prometheus parses and which
fire when they should, and a Grafana dashboard whose every query the real Prometheus parses.

`promtool` (Debian package `prometheus`) parses rule files with Prometheus's own PromQL parser;
the dashboard's queries are checked as recording rules after substituting Grafana's variables.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import helm as chart
from vllm_autotuner.adapters.metrics import OperatorMetrics

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Prometheus) not installed")

# What Grafana puts in the dashboard's variables, for the checks.
VARIABLES = {
    "$namespace": "team-a",
    "$deployment": "llama",
    "$percentile": "0.95",
    "$__rate_interval": "1m",
    "$__range": "6h",
}


def monitoring_objects() -> list[dict[str, Any]]:
    values = chart.ci_values()["monitoring"]
    return chart.render_objects(values, api_versions=(chart.MONITORING_API,))


def prometheus_rule() -> dict[str, Any]:
    (rule,) = chart.find(monitoring_objects(), "PrometheusRule")
    return rule


def dashboard() -> dict[str, Any]:
    (configmap,) = [
        o
        for o in chart.find(monitoring_objects(), "ConfigMap")
        if "vllm-autotuner.json" in o.get("data", {})
    ]
    parsed: dict[str, Any] = json.loads(configmap["data"]["vllm-autotuner.json"])
    return parsed


def panel_queries() -> dict[str, str]:
    """'panel title / refId' -> the query with Grafana's variables filled in."""
    out = {}
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name in sorted(VARIABLES, key=len, reverse=True):
                expr = expr.replace(name, VARIABLES[name])
            out[f"{panel['title']} / {target['refId']}"] = expr
    return out


def exported_metric_names() -> set[str]:
    names = set()
    for family in OperatorMetrics().registry.collect():
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def run_promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_the_rule_and_the_dashboard_render_only_when_asked() -> None:
    default = chart.render_objects({}, api_versions=(chart.MONITORING_API,))
    assert chart.find(default, "PrometheusRule") == []
    assert chart.find(default, "ConfigMap") == []
    without_operator = chart.render_objects({"prometheusRule": {"enabled": True}})
    assert chart.find(without_operator, "PrometheusRule") == []  # no monitoring.coreos.com/v1


def test_the_rule_carries_its_selector_labels_and_the_chart_file() -> None:
    rule = prometheus_rule()
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    text = (chart.CHART_DIR / "files" / "alerts.yaml").read_text()
    assert rule["spec"] == yaml.safe_load(text)


def test_the_dashboard_is_found_by_grafana_s_sidecar() -> None:
    (configmap,) = chart.find(monitoring_objects(), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = dashboard()
    names = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "namespace", "deployment"} <= names
    assert all(panel["targets"] and panel["description"] for panel in board["panels"])


def test_the_dashboard_covers_what_users_look_for() -> None:
    exprs = " ".join(panel_queries().values())
    for metric in (
        "vllm_autotuner_knob", "vllm_autotuner_slo_threshold_seconds", "vllm_autotuner_phase",
        "vllm_autotuner_rollouts_total", "vllm_autotuner_rollbacks_total",
        "vllm_autotuner_capacity_rps", "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
    ):  # fmt: skip
        assert metric in exprs, metric


def test_alerts_and_panels_use_only_exported_operator_metrics() -> None:
    exported = exported_metric_names()
    rules = [r["expr"] for g in prometheus_rule()["spec"]["groups"] for r in g["rules"]]
    for expr in [*rules, *panel_queries().values()]:
        for name in re.findall(r"vllm_autotuner_\w+", expr):
            assert name.removesuffix("_bucket") in exported, name


@needs_promtool
def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    queries = panel_queries()
    rules = [{"record": f"panel:{i}", "expr": expr} for i, expr in enumerate(queries.values())]
    (tmp_path / "panels.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]})
    )
    check = run_promtool(tmp_path, "check", "rules", "panels.yaml")
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"{len(rules)} rules found" in check.stdout


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
    slo_met = 'vllm_autotuner_slo_met{namespace="team-a",deployment="llama"}'
    slo_met_other = 'vllm_autotuner_slo_met{namespace="team-a",deployment="other"}'
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
                # The SLO missed in every window for 40 minutes fires after 30; a miss of 20
                # minutes that recovers does not.
                "interval": "1m",
                "input_series": [
                    {"series": slo_met, "values": "0x40"},
                    {"series": slo_met_other, "values": "0x20 1x20"},
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "35m",
                        "alertname": "VLLMAutotunerSLOViolated",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", **workload},
                                "exp_annotations": expected_annotations(
                                    rules["VLLMAutotunerSLOViolated"], workload
                                ),
                            }
                        ],
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
