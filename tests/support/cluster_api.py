"""Shared pieces of the operator integration tests: a sync API client, names, fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests

from vllm_autotuner.api.crds import render_crds
from vllm_localcluster.emulator import EmulatorServer

NS = "team-a"
CR_PATH = f"/apis/vllm.autotuner.io/v1alpha1/namespaces/{NS}/vllmdeployments"
POLICY_PATH = "/apis/vllm.autotuner.io/v1alpha1/vllmtuningpolicies"
DEPLOYMENT_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments"
SERVICE_PATH = f"/api/v1/namespaces/{NS}/services"

POLICY = {
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

CR = {
    "apiVersion": "vllm.autotuner.io/v1alpha1",
    "kind": "VLLMDeployment",
    "metadata": {
        "name": "llama",
        "namespace": NS,
        "labels": {"app.kubernetes.io/instance": "argo-app", "team": "a"},
        "annotations": {
            "argocd.argoproj.io/tracking-id": "app:vllm.autotuner.io/VLLMDeployment:team-a/llama"
        },
    },
    "spec": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "gpu": {"product": "H100"},
        "knobs": {"maxNumSeqs": 256},
        "tuning": {"mode": "Recommend"},
    },
}


class Api:
    """A thin sync HTTP client for the test's own reads and writes."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "integration-test"

    def get(self, path: str) -> dict[str, Any] | None:
        r = self.session.get(self.url + path, timeout=10)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return dict(r.json())

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.session.post(self.url + path, json=body, timeout=10)
        assert r.status_code == 201, r.text
        return dict(r.json())

    def merge(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.session.patch(
            self.url + path,
            json=body,
            headers={"Content-Type": "application/merge-patch+json"},
            timeout=10,
        )
        r.raise_for_status()
        return dict(r.json())

    def delete(self, path: str) -> None:
        r = self.session.delete(self.url + path, timeout=10)
        assert r.status_code in (200, 202), r.text


@pytest.fixture
def emulator() -> Iterator[EmulatorServer]:
    """The API emulator with our CRDs, on a free loopback port, stopped after the test."""
    server = EmulatorServer(host="127.0.0.1", port=0)
    for crd in render_crds():
        server.emulator.register_crd(crd)
    server.start_in_thread()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def api(emulator: EmulatorServer) -> Api:
    api = Api(emulator.url)
    api.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    )
    return api


def args_of(deployment: dict[str, Any]) -> list[str]:
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def condition(obj: dict[str, Any] | None, cond_type: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == cond_type:
            return dict(cond)
    return None
