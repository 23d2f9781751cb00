"""Credentials never leave the process: not in logs, not in status, not in Events.

The real operator (kopf and our handlers, in a thread) runs against the real API server,
through a recording proxy, and a Prometheus stand-in that demands a bearer token. The token is
read from a file, rotated while the operator runs (as projected service-account tokens are),
and then refused; the operator's Kubernetes token is a secret too. Every log record at DEBUG,
every object the operator could write, and every request body it sent are searched for any of
the secrets.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from bench.scale.kubelet import FleetKubelet
from bench.scale.promstub import StubPrometheus

from tests.support.cluster_api import ApiServer
from tests.support.operator_runner import OperatorThread
from tests.support.waiting import wait_for
from vllm_autotuner.adapters.kube import KubeCredentials
from vllm_autotuner.operator import OperatorConfig
from vllm_localcluster.faults import FaultProxy

REPO = Path(__file__).resolve().parents[3]
GROUP_PATH = "/apis/vllm.autotuner.io/v1alpha1"
POLICY: dict[str, Any] = {
    "apiVersion": "vllm.autotuner.io/v1alpha1",
    "kind": "VLLMTuningPolicy",
    "metadata": {"name": "default"},
    "spec": {
        "slo": {
            "ttft": {"percentile": 95, "thresholdMs": 800},
            "itl": {"percentile": 95, "thresholdMs": 50},
        }
    },
}
CR: dict[str, Any] = {
    "apiVersion": "vllm.autotuner.io/v1alpha1",
    "kind": "VLLMDeployment",
    "metadata": {"name": "llama", "namespace": "team-a"},
    "spec": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "gpu": {"product": "H100"},
        "tuning": {"mode": "Recommend"},
    },
}
CR_PATH = f"{GROUP_PATH}/namespaces/team-a/vllmdeployments/llama"


@dataclass
class Rig:
    apiserver: ApiServer
    proxy: FaultProxy
    prom: StubPrometheus
    token_file: Path
    session: requests.Session

    @property
    def kube_token(self) -> str:
        """The operator's real token: the API server refuses any other."""
        return self.apiserver.operator_token

    def metrics_condition(self) -> dict[str, Any] | None:
        status = self.session.get(self.apiserver.url + CR_PATH, timeout=10).json().get("status")
        for cond in (status or {}).get("conditions", []):
            if cond["type"] == "MetricsAvailable":
                return dict(cond)
        return None

    def everything_written(self) -> str:
        """Every object the operator can write or cause, and every request body it sent."""
        parts = []
        for path in (
            f"{GROUP_PATH}/vllmdeployments",
            f"{GROUP_PATH}/vllmtuningpolicies",
            "/api/v1/events",
            "/apis/apps/v1/deployments",
            "/api/v1/services",
        ):
            parts.append(self.session.get(self.apiserver.url + path, timeout=10).text)
        bodies = [r.body for r in self.proxy.requests if r.body is not None]
        parts.append(json.dumps(bodies, default=str))
        return "\n".join(parts)


@pytest.fixture
def rig(tmp_path: Path, apiserver: ApiServer, api: Any) -> Iterator[Rig]:
    """`api` (unused here) creates namespace team-a and cleans the cluster afterwards."""
    del api
    proxy = FaultProxy(apiserver.url, str(apiserver.ca_file)).start_in_thread()
    prom = StubPrometheus(token=secrets.token_hex(16)).start()
    token_file = tmp_path / "token"
    token_file.write_text(prom.token or "")
    session = apiserver.session()
    session.post(apiserver.url + f"{GROUP_PATH}/vllmtuningpolicies", json=POLICY, timeout=10)
    session.post(
        apiserver.url + f"{GROUP_PATH}/namespaces/team-a/vllmdeployments", json=CR, timeout=10
    )
    fleet = FleetKubelet(
        apiserver.url,
        prom.pod_namespace.__setitem__,
        interval_s=0.2,
        session=apiserver.session("bench-kubelet"),
    )
    try:
        with fleet:
            yield Rig(apiserver, proxy, prom, token_file, session)
    finally:
        prom.stop()
        proxy.stop()


def run_operator(rig: Rig, prometheus_url: str) -> OperatorThread:
    """The operator through the recording proxy, with its own token (sent by the client)."""
    config = OperatorConfig(
        credentials=KubeCredentials.for_server(rig.proxy.url, token=rig.kube_token),
        reconcile_interval_s=0.5,
        prometheus_url=prometheus_url,
        prometheus_bearer_token_file=str(rig.token_file),
        prometheus_timeout_s=5.0,
    )
    return OperatorThread(config).start()


def leaks(text: str, *secret: str) -> list[str]:
    return [s for s in secret if s and s in text]


def test_tokens_never_reach_logs_status_or_events(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    kube_token = rig.kube_token
    first = rig.prom.token or ""
    operator = run_operator(rig, rig.prom.url)
    try:
        wait_for(
            lambda: (rig.metrics_condition() or {}).get("status") == "True",
            timeout=30,
            message="metrics through the authorized Prometheus",
        )
        assert any(h.authorized and h.path == "/api/v1/query" for h in rig.prom.query_hits())
        # Rotation: the file changes, the server still wants the old token -> 401s.
        rotated = secrets.token_hex(16)
        rig.token_file.write_text(rotated + "\n")

        def refused_condition() -> dict[str, Any] | None:
            cond = rig.metrics_condition()
            return cond if cond and "401" in cond["message"] else None

        refused = wait_for(
            refused_condition,
            timeout=30,
            message="the refused token to show in status",
        )
        assert refused is not None and refused["status"] == "False"
        assert any(not h.authorized for h in rig.prom.query_hits())
    finally:
        operator.stop()
    assert caplog.records, "nothing was logged: the search below would prove nothing"
    assert leaks(caplog.text, first, rotated, kube_token) == []
    assert leaks(rig.everything_written(), first, rotated, kube_token) == []


def test_a_server_that_echoes_the_token_does_not_leak_it(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    rig.prom.echo_credentials = True
    rig.token_file.write_text("wrong-" + secrets.token_hex(16))
    sent = rig.token_file.read_text()
    operator = run_operator(rig, rig.prom.url)
    try:
        wait_for(
            lambda: "401" in ((rig.metrics_condition() or {}).get("message") or ""),
            timeout=30,
            message="the refusal to show in status",
        )
    finally:
        operator.stop()
    assert leaks(caplog.text + rig.everything_written(), sent) == []


def test_credentials_in_the_prometheus_url_are_not_published(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Basic-auth in the URL (user:password@host) must not show up where the URL is quoted."""
    caplog.set_level(logging.DEBUG)
    password = secrets.token_hex(12)
    rig.prom.token = None
    dead = f"http://monitor:{password}@127.0.0.1:9/"  # port 9: nothing listens, errors quote it
    operator = run_operator(rig, dead)
    try:
        wait_for(
            lambda: "127.0.0.1:9" in ((rig.metrics_condition() or {}).get("message") or ""),
            timeout=30,
            message="the failing Prometheus to show in status",
        )
    finally:
        operator.stop()
    assert leaks(caplog.text + rig.everything_written(), password) == []
