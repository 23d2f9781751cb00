"""From a CR with awkward but admissible names to the PromQL the operator sends: every query
parses in Prometheus' own parser, and each matcher selects exactly the CR's own values.

Kubernetes names may carry dots (regex metacharacters) and the model string may carry `%+=@,~:`;
served model names are compared outside PromQL, by equality. A selector that matched a
neighbour's pods, or a model filter that took a regex, would let one team's traffic steer
another team's tuning.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest

from tests.unit.security.corpus import POLICY
from tests.unit.security.test_hostile_inputs import RecordingKube
from vllm_autotuner.adapters.kube import KubeClient
from vllm_autotuner.adapters.prometheus import PrometheusSource
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.controller import Controller
from vllm_autotuner.core.snapshot import Snapshot
from vllm_autotuner.observer import Observer

NAMESPACE = "t" * 62 + "9"  # the longest DNS label
NAME = "llama-v1-0"  # a DNS-1035 label (a dotted name would make an invalid Service name)
SERVED = "org.team:chat/v1-0"
MODEL = "s3://bucket/k%2Fv@r+1=2,x~y:z"
SERIES = [
    f"vllm:{n}"
    for n in (
        "request_success_total",
        "num_requests_running",
        "kv_cache_usage_perc",
        "time_to_first_token_seconds_bucket",
        "time_to_first_token_seconds_sum",
        "time_to_first_token_seconds_count",
    )
]


class CapturingSource:
    def __init__(self) -> None:
        self.targets: list[SnapshotTarget] = []

    async def snapshots(self, targets: Any, now: datetime) -> dict[tuple[str, str], Snapshot]:
        self.targets.extend(targets)
        return {}


class Transport:
    """Records queries; answers the request counter for the pods it names, plus decoys."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.queries: list[str] = []

    async def query(self, expr: str, at: float) -> Any:
        self.queries.append(expr)
        return self.rows if "request_success" in expr else []

    async def label_values(self, label: str, match: str, start: float, end: float) -> Any:
        return SERIES


def _body() -> dict[str, Any]:
    return {
        "metadata": {"namespace": NAMESPACE, "name": NAME, "uid": "u1", "generation": 1},
        "spec": {
            "model": MODEL,
            "servedModelName": SERVED,
            "gpu": {"product": "H100"},
            "tuning": {"mode": "Recommend"},
        },
    }


RS = {
    "metadata": {
        "uid": "rs-1",
        "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "uid": "d-1", "controller": True}
        ],
    }
}


def _pod(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    template = deployment["spec"]["template"]
    ready = (datetime.now(tz=UTC) - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "uid": "rs-1", "controller": True}
    return {
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": dict(template["metadata"]["labels"]),
            "annotations": dict(template["metadata"]["annotations"]),
            "ownerReferences": [owner],
        },
        "status": {
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": ready}],
            "containerStatuses": [{"name": "vllm", "ready": True, "restartCount": 0}],
        },
    }


def target_from_operator(pods: list[str]) -> SnapshotTarget:
    """The SnapshotTarget the controller itself asks the observer for."""
    kube = RecordingKube()
    source = CapturingSource()
    controller = Controller(cast(KubeClient, kube), observer=Observer(source))
    body = _body()

    async def twice() -> None:
        policies = {"default": POLICY["spec"]}
        await controller.reconcile(
            body,
            policies=policies,
            namespace_labels={},
            children={"Deployment": None, "Service": None},
        )
        applied = next(m for m in kube.applied if m["kind"] == "Deployment")
        deployment = {**applied, "metadata": {**applied["metadata"], "uid": "d-1"}}
        await controller.reconcile(
            body,
            children={"Deployment": deployment, "Service": None},
            pods=[_pod(deployment, p) for p in pods],
            replicasets=[RS],
            policies=policies,
            namespace_labels={},
        )
        await controller.observer.refresh()

    asyncio.run(twice())
    assert source.targets, "the controller asked for no observation"
    return source.targets[-1]


def decode(literal: str) -> str:
    """A PromQL double-quoted string (the escapes the adapter emits are JSON's, plus \\xNN)."""
    return str(json.loads(re.sub(r"\\x([0-9a-f]{2})", r"\\u00\1", literal)))


def matchers(expr: str, label: str) -> list[tuple[str, str]]:
    return [
        (op, decode(lit)) for op, lit in re.findall(rf'\b{label}(=~|=)("(?:[^"\\]|\\.)*")', expr)
    ]


def selects(op: str, value: str, candidate: str) -> bool:
    return re.fullmatch(value, candidate) is not None if op == "=~" else value == candidate


PODS = [f"{NAME}-5d8f.abc", f"{NAME}-5d8f.abd"]
DECOYS = [f"{NAME}-5d8fxabc", f"{NAME}x5d8f.abc", f"{NAME}-5d8f.abcd", "x" + PODS[0], ".*"]


def test_target_carries_the_exact_names() -> None:
    target = target_from_operator(PODS)
    assert (target.namespace, target.name, target.model_name) == (NAMESPACE, NAME, SERVED)
    assert sorted(target.pods) == sorted(PODS)


def test_every_query_selects_only_the_deployments_own_pods() -> None:
    target = target_from_operator(PODS)
    transport = Transport([])
    source = PrometheusSource("http://prom", min_window_s=60)
    asyncio.run(source._cycle(transport, [target], datetime.now(tz=UTC)))
    assert transport.queries
    for expr in transport.queries:
        pods, nss = matchers(expr, "pod"), matchers(expr, "namespace")
        assert pods and len(pods) == len(nss), expr  # every selector names both
        for op, value in pods:
            assert all(selects(op, value, pod) for pod in PODS)
            assert not any(selects(op, value, decoy) for decoy in DECOYS), expr
        for op, value in nss:
            assert selects(op, value, NAMESPACE)
            assert not selects(op, value, NAMESPACE[:-1] + "8")
        assert "model_name=" not in expr  # the model is compared by equality, after the answer


def test_answers_for_other_model_names_are_not_used() -> None:
    target = target_from_operator(PODS[:1])
    at = datetime.now(tz=UTC)

    def row(model: str, value: float) -> dict[str, Any]:
        labels = {"namespace": NAMESPACE, "pod": PODS[0], "model_name": model}
        return {"metric": labels, "value": [at.timestamp(), str(value)]}

    decoys = [row(m, 1e4) for m in (".*", SERVED + "x", SERVED.replace(".", "x"), MODEL)]
    transport = Transport([row(SERVED, 600.0), *decoys])
    source = PrometheusSource("http://prom", min_window_s=60)
    snap = asyncio.run(source._cycle(transport, [target], at))[target.key]
    assert snap.available, snap.reason
    assert snap.completed_requests == 600


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_parses_the_operators_queries(tmp_path: Path) -> None:
    target = target_from_operator(PODS)
    transport = Transport([])
    source = PrometheusSource("http://prom", min_window_s=60)
    asyncio.run(source._cycle(transport, [target], datetime.now(tz=UTC)))
    lines = ["groups:", "- name: t", "  rules:"]
    for i, expr in enumerate(transport.queries):
        lines.append(f"  - record: q{i}\n    expr: {json.dumps(expr)}")
    rules = tmp_path / "rules.yml"
    rules.write_text("\n".join(lines) + "\n")
    res = subprocess.run(
        ["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(transport.queries)} rules found" in res.stdout + res.stderr
