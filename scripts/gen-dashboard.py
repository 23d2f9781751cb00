"""Writes the chart's Grafana dashboard (charts/vllm-autotuner/files/dashboard.json).

Run `python scripts/gen-dashboard.py` after changing a panel; tests/integration/test_dashboard.py
checks every query with the real Prometheus.
"""

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'namespace="$namespace", deployment="$deployment"'
POD = 'namespace="$namespace", pod=~"$deployment-[a-z0-9]+-[a-z0-9]+"'


def vllm(name: str) -> str:
    """A vLLM series under its `vllm:` name or the `vllm_` escaping, of this deployment's pods."""
    return f'{{__name__=~"vllm[:_]{name}", {POD}}}'


def quantile(names: str) -> str:
    return (
        f"histogram_quantile($percentile, sum by (le) "
        f"(rate({vllm(names + '_bucket')}[$__rate_interval])))"
    )


def target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}


def panel(pid, title, kind, targets, x, y, w=12, h=8, unit=None, description="", **extra):
    p = {
        "id": pid,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [target(e, legend, chr(65 + i)) for i, (e, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit} if unit else {}, "overrides": []},
        "options": {},
    }
    p.update(extra)
    return p


def slo_panel(pid, title, names, metric, x, y):
    # vLLM >= 0.10 exports ITL as inter_token_latency_seconds, earlier (and alongside, while it
    # is deprecated) as time_per_output_token_seconds: the first that exists, not their sum.
    measured = " or ".join(quantile(n) for n in names.split("|"))
    return panel(
        pid,
        title,
        "timeseries",
        [
            (measured, "measured p$percentile"),
            (
                f'vllm_autotuner_slo_threshold_seconds{{{SEL}, metric="{metric}"}}',
                "SLO p{{percentile}}",
            ),
        ],
        x,
        y,
        unit="s",
        description=f"The {metric.upper()} at the chosen percentile from vLLM's histogram, "
        "against the SLO threshold the deployment is tuned to.",
    )


panels = [
    panel(
        1,
        "SLO met (share of windows, time range)",
        "stat",
        [(f"avg_over_time(vllm_autotuner_slo_met{{{SEL}}}[$__range])", "SLO met")],
        0,
        0,
        w=6,
        h=5,
        unit="percentunit",
        description="Share of the operator's evaluation windows that met every SLO target.",
    ),
    panel(
        2,
        "Tuner phase",
        "state-timeline",
        [(f"vllm_autotuner_phase{{{SEL}}} == 1", "{{phase}}")],
        6,
        0,
        w=18,
        h=5,
        description="The tuner's phase over time: rollouts, verification, commits, rollbacks.",
    ),
    slo_panel(3, "Time to first token vs SLO", "time_to_first_token_seconds", "ttft", 0, 5),
    slo_panel(
        4,
        "Inter-token latency vs SLO",
        "inter_token_latency_seconds|time_per_output_token_seconds",
        "itl",
        12,
        5,
    ),
    slo_panel(5, "End-to-end latency vs SLO", "e2e_request_latency_seconds", "e2e", 0, 13),
    panel(
        6,
        "Rollouts, rollbacks and decisions",
        "timeseries",
        [
            (
                f"sum(increase(vllm_autotuner_rollouts_total{{{SEL}}}[$__rate_interval]))",
                "rollouts",
            ),
            (
                f"sum(increase(vllm_autotuner_rollbacks_total{{{SEL}}}[$__rate_interval]))",
                "rollbacks",
            ),
            (
                f"sum by (action) (increase(vllm_autotuner_decisions_total{{{SEL}, "
                f'action!~"hold|recommend"}}[$__rate_interval]))',
                "{{action}}",
            ),
        ],
        12,
        13,
        unit="short",
        description="Rollouts started (a canary is a rollout of one pod), verifications, "
        "commits and rollbacks.",
    ),
    panel(
        7,
        "Capacity per replica: predicted vs measured",
        "timeseries",
        [
            (f"vllm_autotuner_capacity_rps{{{SEL}}}", "{{source}}"),
            (
                f"sum(rate({vllm('request_success_total')}[$__rate_interval])) / "
                f"count(count by (pod) ({vllm('num_requests_running')}))",
                "served now",
            ),
        ],
        0,
        21,
        unit="reqps",
        description="The model's capacity of one replica within the SLO for the applied "
        "knobs (predicted), the measured capacity, and the load each replica serves now.",
    ),
    panel(
        8,
        "--max-num-batched-tokens",
        "timeseries",
        [(f'vllm_autotuner_knob{{{SEL}, knob="maxNumBatchedTokens"}}', "applied")],
        12,
        21,
        w=4,
        unit="short",
        description="The token budget per step, as applied.",
    ),
    panel(
        9,
        "--max-num-seqs",
        "timeseries",
        [(f'vllm_autotuner_knob{{{SEL}, knob="maxNumSeqs"}}', "applied")],
        16,
        21,
        w=4,
        unit="short",
        description="The most sequences in a batch, as applied.",
    ),
    panel(
        10,
        "--gpu-memory-utilization",
        "timeseries",
        [(f'vllm_autotuner_knob{{{SEL}, knob="gpuMemoryUtilization"}}', "applied")],
        20,
        21,
        w=4,
        unit="percentunit",
        description="The GPU memory share vLLM may use.",
    ),
]


def query_var(name, label, expr):
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": expr, "refId": name},
        "definition": expr,
        "refresh": 2,
        "sort": 1,
        "includeAll": False,
        "multi": False,
    }


dashboard = {
    "uid": "vllm-autotuner",
    "title": "vllm-autotuner",
    "description": "Per VLLMDeployment: SLO against targets, knobs over time, rollouts and "
    "rollbacks, the model's prediction against what was measured.",
    "tags": ["vllm", "vllm-autotuner"],
    "schemaVersion": 39,
    "version": 1,
    "editable": True,
    "time": {"from": "now-6h", "to": "now"},
    "refresh": "1m",
    "templating": {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
            },
            query_var("namespace", "Namespace", "label_values(vllm_autotuner_phase, namespace)"),
            query_var(
                "deployment",
                "VLLMDeployment",
                'label_values(vllm_autotuner_phase{namespace="$namespace"}, deployment)',
            ),
            {
                "name": "percentile",
                "label": "Percentile",
                "type": "custom",
                "query": "0.5,0.9,0.95,0.99",
                "current": {"text": "0.95", "value": "0.95"},
                "options": [],
            },
        ]
    },
    "panels": panels,
}
OUT = Path(__file__).resolve().parents[1] / "charts/vllm-autotuner/files/dashboard.json"
OUT.write_text(json.dumps(dashboard, indent=2) + "\n")
print(OUT)
