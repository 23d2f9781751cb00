"""Fixtures and helpers for tests that need a Kubernetes API: the emulator on a free port.

Use from a test module with `from tests.support.kube import kube, kube_api  # noqa: F401`
(or list this module in `pytest_plugins` of the root conftest). The sync `kubernetes` client
is always built from an explicit config file: the library reads KUBECONFIG at import time.
Never call the sync client from an async test whose loop hosts the emulator; the emulator
here runs in its own thread, so sync tests (and `asyncio.to_thread`) are safe.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from vllm_localcluster.emulator import EmulatorServer, KubernetesAPIEmulator

REPO_ROOT = Path(__file__).resolve().parents[2]
CRDS_DIR = REPO_ROOT / "crds"


@dataclass
class KubeHandle:
    """A running emulator with a kubeconfig that points at it."""

    server: EmulatorServer
    kubeconfig: Path

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def emulator(self) -> KubernetesAPIEmulator:
        return self.server.emulator

    def api_client(self) -> kubernetes.client.ApiClient:
        """A sync `kubernetes` client bound to this emulator (close it, or let GC do it)."""
        client: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig)
        )
        return client

    def http(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
        timeout: float = 10.0,
    ) -> tuple[int, Any]:
        """A raw request: (status, parsed JSON body, or the text for non-JSON bodies)."""
        url = self.url + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        data: bytes | None
        if body is None:
            data = None
        elif isinstance(body, (bytes, str)):
            data = body.encode() if isinstance(body, str) else body
        else:
            data = json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def watch(
        self, path: str, params: Mapping[str, str], timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        """Run a watch until the server ends it (pass timeoutSeconds) and return its events."""
        query = {"watch": "true", **params}
        url = f"{self.url}{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return [json.loads(line) for line in response.read().splitlines() if line.strip()]


@contextlib.contextmanager
def running_emulator(
    directory: Path, *, crds: Path | None = None, **options: Any
) -> Iterator[KubeHandle]:
    """Start an emulator in a thread on 127.0.0.1:<free port>, write `directory/kubeconfig`."""
    server = EmulatorServer("127.0.0.1", 0, crds=crds, **options).start_in_thread()
    try:
        kubeconfig = server.write_kubeconfig(directory / "kubeconfig")
        yield KubeHandle(server, kubeconfig)
    finally:
        server.stop()


def project_crds() -> Path | None:
    """The generated CRDs of this project, when they exist."""
    if CRDS_DIR.is_dir() and any(CRDS_DIR.glob("*.yaml")):
        return CRDS_DIR
    return None


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[KubeHandle]:
    """A fresh emulator per test, with the project's CRDs registered when they exist."""
    with running_emulator(tmp_path, crds=project_crds()) as handle:
        yield handle


@pytest.fixture
def kube_api(kube: KubeHandle) -> Iterator[kubernetes.client.ApiClient]:
    client = kube.api_client()
    try:
        yield client
    finally:
        client.close()  # type: ignore[no-untyped-call]
