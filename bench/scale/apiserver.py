"""The real kube-apiserver (with etcd and the garbage collector) for the scale benchmark.

The control plane runs in its own processes, as in a cluster, so it never shares the
operator's CPU time or GIL. What the operator wrote is read back from the API server's audit
log (every request, with its user agent), from the moment `clear_requests()` was called.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from vllm_localcluster.controlplane import ControlPlane

READS = frozenset({"get", "list", "watch"})
CONTROLLERS = ("garbage-collector-controller", "namespace-controller",
               "serviceaccount-controller")  # fmt: skip


@dataclass(frozen=True)
class Write:
    verb: str
    resource: str
    user_agent: str


class ApiServer:
    def __init__(self, control_plane: ControlPlane) -> None:
        self.control_plane = control_plane
        self.url = control_plane.url
        self._offset = 0

    def session(self, user_agent: str) -> requests.Session:
        """An admin session trusting this cluster's CA (and no environment's bundle)."""
        session = requests.Session()
        session.trust_env = False
        session.verify = str(self.control_plane.ca_file)
        session.headers["Authorization"] = f"Bearer {self.control_plane.token}"
        session.headers["User-Agent"] = user_agent
        return session

    def clear_requests(self) -> None:
        log = self.control_plane.audit_log
        self._offset = log.stat().st_size if log.exists() else 0

    def writes(self) -> list[Write]:
        """The operator's writes (its identity, vllm-autotuner) since `clear_requests()`."""
        with self.control_plane.audit_log.open("rb") as log:
            log.seek(self._offset)
            events = [json.loads(line) for line in log.read().splitlines() if line.strip()]
        found = []
        for event in events:
            ref = event.get("objectRef") or {}
            if event.get("verb") in READS or not ref.get("resource"):
                continue
            if (event.get("user") or {}).get("username") != "vllm-autotuner":
                continue  # the controllers', the fleet's and the driver's writes
            resource = ref["resource"] + (
                f"/{ref['subresource']}" if ref.get("subresource") else ""
            )
            found.append(Write(event["verb"], resource, str(event.get("userAgent", ""))))
        return found

    def write_kubeconfig(self, path: Path) -> Path:
        """The operator's own kubeconfig (identity vllm-autotuner, bound to cluster-admin)."""
        path.write_text((self.control_plane.workdir / "operator.kubeconfig").read_text())
        return path


@contextmanager
def api_server(crds: Path, workdir: Path) -> Iterator[ApiServer]:
    del crds  # the control plane installs the CRDs rendered from the API models
    control_plane = ControlPlane(workdir, controllers=CONTROLLERS, scheduler=False, audit=True)
    with control_plane:
        yield ApiServer(control_plane)
