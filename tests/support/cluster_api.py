"""Shared pieces of the operator integration tests: a real API server, a sync client, names.

The API server is the real one: etcd, kube-apiserver and the controller manager's garbage
collector, namespace and service-account controllers, started once per test session (about
4 s) with the project's CRDs installed. As with controller-runtime's envtest, there is no
kubelet and no Deployment controller: the tests play those (tests/support/fake_fleet.py writes
pods and Deployment status); the one-machine cluster with the real Deployment controller and
the node agent is what the e2e suite and tests/integration/test_local_cluster.py run on.

Each test starts from an empty cluster: the `api` fixture creates the namespace and afterwards
deletes every VLLMDeployment (finalizers released), policy and workload object the test left.
The API server's audit log stands in for a request log: `apiserver.requests()` returns what
was asked of it since the test began, and who asked (the operator runs as `vllm-autotuner`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from vllm_autotuner.adapters.kube import KubeCredentials
from vllm_localcluster.controlplane import ControlPlane

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


@dataclass(frozen=True)
class RequestRecord:
    """One request the API server answered, from its audit log."""

    user: str
    user_agent: str
    verb: str
    group: str
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    status_code: int
    body: Any


def _record(event: dict[str, Any]) -> RequestRecord:
    ref = event.get("objectRef") or {}
    return RequestRecord(
        user=str((event.get("user") or {}).get("username", "")),
        user_agent=str(event.get("userAgent", "")),
        verb=str(event.get("verb", "")),
        group=str(ref.get("apiGroup", "")),
        resource=ref.get("resource"),
        subresource=ref.get("subresource"),
        namespace=ref.get("namespace"),
        name=ref.get("name"),
        status_code=int((event.get("responseStatus") or {}).get("code", 0)),
        body=event.get("requestObject"),
    )


class ApiServer:
    """The session's control plane as the tests see it."""

    def __init__(self, control_plane: ControlPlane) -> None:
        self.control_plane = control_plane
        self.url = control_plane.url
        self._audit_offset = 0

    @property
    def token(self) -> str:
        return self.control_plane.token

    @property
    def ca_file(self) -> Path:
        return self.control_plane.ca_file

    @property
    def kubeconfig(self) -> Path:
        return self.control_plane.kubeconfig

    def write_kubeconfig(self, path: Path, namespace: str) -> Path:
        """The admin kubeconfig with `namespace` as its context's default namespace."""
        config = yaml.safe_load(self.kubeconfig.read_text())
        for ctx in config.get("contexts") or []:
            ctx.setdefault("context", {})["namespace"] = namespace
        path.write_text(yaml.safe_dump(config))
        return path

    @property
    def operator_token(self) -> str:
        """The bearer token of the operator's identity, `vllm-autotuner`."""
        return self.control_plane.operator_credentials()[1]

    def operator_credentials(self) -> KubeCredentials:
        """What the operator under test connects with: its own identity, `vllm-autotuner`."""
        server, token, ca_file = self.control_plane.operator_credentials()
        return KubeCredentials.for_server(server, token=token, ca_file=str(ca_file))

    def session(self, user_agent: str = "integration-test") -> requests.Session:
        session = requests.Session()
        # Trust this cluster's CA only: REQUESTS_CA_BUNDLE and proxies from the environment
        # would otherwise override `verify` for every request.
        session.trust_env = False
        session.headers["User-Agent"] = user_agent
        session.headers["Authorization"] = f"Bearer {self.token}"
        session.verify = str(self.ca_file)
        return session

    def mark(self) -> None:
        """Requests before this point are not the current test's."""
        log = self.control_plane.audit_log
        self._audit_offset = log.stat().st_size if log.exists() else 0

    def requests(self) -> list[RequestRecord]:
        """Every request answered since `mark()` (the audit log is written before the response
        is sent, so a request the caller saw answered is in it)."""
        with self.control_plane.audit_log.open("rb") as log:
            log.seek(self._audit_offset)
            lines = log.read().splitlines()
        return [_record(json.loads(line)) for line in lines if line.strip()]

    def requests_by(self, user: str = "vllm-autotuner") -> list[RequestRecord]:
        return [r for r in self.requests() if r.user == user]


class Api:
    """A thin sync HTTP client for the test's own reads and writes (as the cluster admin).

    Given a plain URL, it talks to the API emulator the fault-injection tests still use
    (tests/integration/reliability, docs/decisions.md)."""

    def __init__(self, server: ApiServer | str) -> None:
        if isinstance(server, str):
            self.url = server
            self.session = requests.Session()
            self.session.headers["User-Agent"] = "integration-test"
        else:
            self.url = server.url
            self.session = server.session()

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

    def merge(self, path: str, body: dict[str, Any], *, strategic: bool = False) -> dict[str, Any]:
        """A JSON merge patch; `strategic` for a strategic merge patch (lists of containers
        merged by name, as `kubectl edit` and `kubectl patch` do on built-in kinds)."""
        kind = "strategic-merge-patch" if strategic else "merge-patch"
        r = self.session.patch(
            self.url + path,
            json=body,
            headers={"Content-Type": f"application/{kind}+json"},
            timeout=10,
        )
        r.raise_for_status()
        return dict(r.json())

    def delete(self, path: str) -> None:
        r = self.session.delete(self.url + path, timeout=10)
        assert r.status_code in (200, 202), r.text


# The controllers the integration tests rely on; the Deployment and ReplicaSet controllers
# are the tests' to play (see the module docstring).
INTEGRATION_CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
)


@pytest.fixture(scope="session")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """etcd + kube-apiserver (+ garbage collector) with our CRDs, for the whole session."""
    workdir = tmp_path_factory.mktemp("apiserver")
    control_plane = ControlPlane(
        workdir, controllers=INTEGRATION_CONTROLLERS, scheduler=False, audit=True
    )
    with control_plane:
        yield ApiServer(control_plane)


# What a test may leave behind, cleaned up after it (namespaced paths take the namespace).
_NAMESPACED = ("apis/apps/v1/{ns}/deployments", "apis/apps/v1/{ns}/replicasets",
               "api/v1/{ns}/pods", "api/v1/{ns}/events", "api/v1/{ns}/configmaps")  # fmt: skip
_CR_GROUP = "/apis/vllm.autotuner.io/v1alpha1"


def clean(api: Api) -> None:
    """Delete every VLLMDeployment (releasing finalizers), policy and workload object."""
    listed = api.session.get(f"{api.url}{_CR_GROUP}/vllmdeployments", timeout=10).json()
    for item in listed.get("items", []):
        meta = item["metadata"]
        path = f"{_CR_GROUP}/namespaces/{meta['namespace']}/vllmdeployments/{meta['name']}"
        if meta.get("finalizers"):
            api.merge(path, {"metadata": {"finalizers": None}})
        api.session.delete(api.url + path, timeout=10)
    api.session.delete(f"{api.url}{_CR_GROUP}/vllmtuningpolicies", timeout=10)
    namespaces = api.session.get(f"{api.url}/api/v1/namespaces", timeout=10).json()
    for ns in namespaces.get("items", []):
        name = ns["metadata"]["name"]
        if name.startswith("kube-"):
            continue
        for template in _NAMESPACED:
            base, rest = template.split("/{ns}/")
            path = f"/{base}/namespaces/{name}/{rest}"
            api.session.delete(api.url + path, json={"gracePeriodSeconds": 0}, timeout=10)
        # Services have no collection delete; the API server's own `kubernetes` one stays.
        services = api.session.get(f"{api.url}/api/v1/namespaces/{name}/services", timeout=10)
        for service in services.json().get("items", []):
            if service["metadata"]["name"] != "kubernetes":
                path = f"/api/v1/namespaces/{name}/services/{service['metadata']['name']}"
                api.session.delete(api.url + path, timeout=10)


@pytest.fixture
def api(apiserver: ApiServer) -> Iterator[Api]:
    """A client as the admin, namespace team-a created; the cluster is cleaned afterwards."""
    api = Api(apiserver)
    r = api.session.post(
        api.url + "/api/v1/namespaces",
        json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        timeout=10,
    )
    assert r.status_code in (201, 409), r.text
    apiserver.mark()
    try:
        yield api
    finally:
        clean(api)


def args_of(deployment: dict[str, Any]) -> list[str]:
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def condition(obj: dict[str, Any] | None, cond_type: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == cond_type:
            return dict(cond)
    return None
