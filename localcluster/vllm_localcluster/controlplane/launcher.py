"""Start and stop a real control plane on this machine, as controller-runtime's envtest does.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler of the pinned release
(binaries.py), on 127.0.0.1 only, on free ports, with credentials generated for this run
(pki.py). The API server authenticates bearer tokens and authorises with RBAC, as a cluster
does; the admin kubeconfig it writes works with kubectl, the `kubernetes` package and the
operator alike. The project's CRDs are installed through the API, as `kubectl apply -f crds/`
would, and `start()` returns once they are Established.

    with ControlPlane() as cp:
        cp.kubeconfig     # admin kubeconfig (token + CA)
        cp.url            # https://127.0.0.1:<port>

`stop()` ends every process (SIGTERM, SIGKILL after 10 s) in reverse order and removes the
working directory it created; it is idempotent and registered with atexit. Each process also
gets `setpriv --pdeathsig KILL`, so a killed test run leaves no etcd behind: start the control
plane from a thread that lives as long as it should (the main thread, a session fixture).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from vllm_localcluster.controlplane import binaries as bins
from vllm_localcluster.controlplane import pki as pki_mod

SERVICE_CIDR = "10.96.0.0/16"
ISSUER = "https://kubernetes.default.svc.cluster.local"
# The controllers a cluster's workloads need here: Deployments roll out through ReplicaSets,
# the garbage collector follows owner references, EndpointSlices feed the Service proxy,
# namespaces get their default ServiceAccount and are finalised on deletion, and the RBAC
# aggregated roles (admin/edit/view) are filled. Node lifecycle, volumes, jobs and cloud
# controllers are left out: one node that never fails, no volumes, no jobs.
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "garbage-collector-controller",
    "endpointslice-controller",
    "endpoints-controller",
    "serviceaccount-controller",
    "namespace-controller",
    "pod-garbage-collector-controller",
    "clusterrole-aggregation-controller",
    "root-ca-certificate-publisher-controller",
    "disruption-controller",
)
STOP_GRACE_S = 10.0
# client-go's limit for retrying a 429 that carries Retry-After (rest.Request maxRetries).
TOO_MANY_REQUESTS_RETRIES = 10


class ControlPlaneError(RuntimeError):
    """A component did not start; the message carries the tail of its log."""


def retry_after_s(header: str | None, longest: float = 10.0) -> float | None:
    """Retry-After in seconds (kube-apiserver sends whole seconds), at most `longest`; None
    when absent or not a number of seconds."""
    try:
        return None if header is None else min(longest, max(0.0, float(header)))
    except ValueError:
        return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _orphan_guard() -> list[str]:
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, limit: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-limit:]
        return ""

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                self.process.wait(10)


def kubeconfig_document(server: str, ca_file: Path, token: str, user: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager (+ kube-scheduler) for one run."""

    def __init__(
        self,
        workdir: str | Path | None = None,
        *,
        binaries: bins.Binaries | None = None,
        crds: Sequence[Mapping[str, Any]] | None = None,
        scheduler: bool = True,
        controllers: Sequence[str] = CONTROLLERS,
        audit: bool = False,
        operator_role: str | None = "cluster-admin",
        extra_apiserver_args: Sequence[str] = (),
        startup_timeout_s: float = 90.0,
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="controlplane-")).resolve()
        self.binaries = binaries
        self.crds = crds
        self.with_scheduler = scheduler
        self.controllers = tuple(controllers)
        self.audit = audit
        self.operator_role = operator_role
        self.extra_apiserver_args = list(extra_apiserver_args)
        self.startup_timeout_s = startup_timeout_s
        self.components: list[Component] = []
        self.pki: pki_mod.Pki | None = None
        self.port = 0
        self.etcd_url = ""
        self.startup_s: dict[str, float] = {}

    # ------------------------------------------------------------------ what callers use

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        assert self.pki is not None, "the control plane is not running"
        return self.pki.ca_cert

    @property
    def token(self) -> str:
        assert self.pki is not None, "the control plane is not running"
        return self.pki.token(pki_mod.ADMIN[0])

    def token_for(self, user: str) -> str:
        assert self.pki is not None, "the control plane is not running"
        return self.pki.token(user)

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines, one per request) when `audit` is on."""
        return self.workdir / "audit.log"

    def operator_credentials(self) -> tuple[str, str, Path]:
        """(server, token, CA file) of the `vllm-autotuner` identity the operator runs as."""
        return self.url, self.token_for(pki_mod.OPERATOR[0]), self.ca_file

    def pids(self) -> set[int]:
        return {c.process.pid for c in self.components}

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        timeout: float = 10.0,
        token: str | None = None,
    ) -> tuple[int, Any]:
        """One call as the admin: (status, parsed JSON or text).

        A 429 with Retry-After (kube-apiserver's "try again later": priority and fairness
        queues full, or a server still starting) is retried after the wait it asks for, at most
        `TOO_MANY_REQUESTS_RETRIES` times, as client-go does."""
        data = None if body is None else json.dumps(body).encode()
        context = ssl.create_default_context(cafile=str(self.ca_file))
        for _ in range(TOO_MANY_REQUESTS_RETRIES):
            status, raw, retry_after = self._call(
                method, path, data, content_type, timeout, token, context
            )
            if status != 429 or retry_after is None:
                break
            time.sleep(retry_after)  # the wait the server asked for (Retry-After)
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def _call(
        self,
        method: str,
        path: str,
        data: bytes | None,
        content_type: str,
        timeout: float,
        token: str | None,
        context: ssl.SSLContext,
    ) -> tuple[int, bytes, float | None]:
        """(status, body, Retry-After in seconds when the answer carries one)."""
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {token or self.token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
                return response.status, response.read(), None
        except urllib.error.HTTPError as error:
            return error.code, error.read(), retry_after_s(error.headers.get("Retry-After"))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        started = time.monotonic()
        self.binaries = self.binaries or bins.find()
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        atexit.register(self.stop)
        try:
            self.pki = pki_mod.generate(self.workdir / "pki")
            self._timed("etcd", self._start_etcd)
            self._timed("kube-apiserver", self._start_apiserver)
            self._write_kubeconfigs()
            # CRDs before the controller manager: the garbage collector discovers the resources
            # it watches at start and only every 30 s after, so owner references to our CRs
            # are followed from the first second.
            self._timed("crds", lambda: self.install_crds(self._crds()))
            self._timed("controllers", self._start_controllers)
            if self.operator_role is not None:
                self.bind_operator(self.operator_role)
        except BaseException:
            self.stop()
            raise
        self.startup_s["total"] = time.monotonic() - started
        return self

    def stop(self) -> None:
        for component in reversed(self.components):
            with contextlib.suppress(Exception):
                component.stop()
        self.components.clear()
        atexit.unregister(self.stop)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ the components

    def _timed(self, name: str, step: Any) -> None:
        began = time.monotonic()
        step()
        self.startup_s[name] = time.monotonic() - began

    def _spawn(self, name: str, argv: Sequence[str]) -> Component:
        log = self.workdir / "logs" / f"{name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                [*_orphan_guard(), *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,
            )
        component = Component(name, process, log)
        self.components.append(component)
        return component

    def _wait(self, component: Component, ready: Any, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if component.process.poll() is not None:
                raise ControlPlaneError(
                    f"{component.name} exited with {component.process.returncode} "
                    f"before {what}:\n{component.tail()}"
                )
            with contextlib.suppress(OSError, ValueError, ssl.SSLError):
                if ready():
                    return
            time.sleep(0.1)
        raise ControlPlaneError(
            f"{component.name}: no {what} within {self.startup_timeout_s:g} s:\n{component.tail()}"
        )

    def _start_etcd(self) -> None:
        assert self.binaries is not None
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        etcd = self._spawn(
            "etcd",
            [
                str(self.binaries.etcd),
                "--name=local",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=local={peer_url}",
                # A test cluster's data dies with it: skip fsync (envtest does the same).
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )

        def healthy() -> bool:
            with urllib.request.urlopen(self.etcd_url + "/health", timeout=2) as response:
                return bool(json.loads(response.read()).get("health") == "true")

        self._wait(etcd, healthy, "healthy etcd")

    def _start_apiserver(self) -> None:
        assert self.binaries is not None and self.pki is not None
        self.port = free_port()
        pki = self.pki
        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(self.binaries.apiserver),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                f"--token-auth-file={pki.token_file}",
                "--authorization-mode=RBAC",
                f"--service-account-issuer={ISSUER}",
                f"--service-account-key-file={pki.service_account_public_key}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                "--profiling=false",
                *self._audit_args(),
                *self.extra_apiserver_args,
            ],
        )

        def ready() -> bool:
            status, _ = self.request("GET", "/readyz", timeout=2)
            return status == 200

        self._wait(apiserver, ready, "ready API server (/readyz)")

    def _spawn_controller_manager(self) -> None:
        assert self.binaries is not None and self.pki is not None
        self._spawn(
            "kube-controller-manager",
            [
                str(self.binaries.controller_manager),
                f"--kubeconfig={self.workdir / 'controller-manager.kubeconfig'}",
                f"--controllers={','.join(self.controllers)}",
                f"--root-ca-file={self.pki.ca_cert}",
                # Each controller acts as its own service account, with the bootstrap roles
                # the API server grants them (as kubeadm sets it up).
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.pki.service_account_key}",
                "--leader-elect=false",
                "--secure-port=0",
                "--profiling=false",
            ],
        )

    def _audit_args(self) -> list[str]:
        """Every request at level Request (who, what, the body sent), written when the
        response is complete: what the tests read to see what the operator did."""
        if not self.audit:
            return []
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    "omitStages": ["RequestReceived", "ResponseStarted"],
                    "rules": [{"level": "Request"}],
                }
            )
        )
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
        ]

    def bind_operator(self, cluster_role: str) -> None:
        """Grant the `vllm-autotuner` identity a ClusterRole (replacing an earlier grant)."""
        path = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/vllm-autotuner-test"
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "vllm-autotuner-test"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": cluster_role,
            },
            "subjects": [
                {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "User",
                    "name": pki_mod.OPERATOR[0],
                }
            ],
        }
        self.request("DELETE", path)
        status, body = self.request("POST", path.rsplit("/", 1)[0], binding)
        if status != 201:
            raise ControlPlaneError(f"binding the operator to {cluster_role}: {status} {body}")

    def _write_kubeconfigs(self) -> None:
        assert self.pki is not None
        for user, file in (
            (pki_mod.ADMIN[0], self.kubeconfig),
            (pki_mod.CONTROLLER_MANAGER[0], self.workdir / "controller-manager.kubeconfig"),
            (pki_mod.SCHEDULER[0], self.workdir / "scheduler.kubeconfig"),
            (pki_mod.NODE_AGENT[0], self.workdir / "node-agent.kubeconfig"),
            (pki_mod.OPERATOR[0], self.workdir / "operator.kubeconfig"),
        ):
            document = kubeconfig_document(self.url, self.pki.ca_cert, self.pki.token(user), user)
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                yaml.safe_dump(document, out)

    def _start_controllers(self) -> None:
        assert self.binaries is not None and self.pki is not None
        if self.controllers:
            self._spawn_controller_manager()
        if self.with_scheduler:
            self._spawn(
                "kube-scheduler",
                [
                    str(self.binaries.scheduler),
                    f"--kubeconfig={self.workdir / 'scheduler.kubeconfig'}",
                    "--leader-elect=false",
                    "--secure-port=0",
                    "--profiling=false",
                ],
            )
        for component in self.components[2:]:
            if component.process.poll() is not None:
                raise ControlPlaneError(f"{component.name} exited:\n{component.tail()}")

    # ------------------------------------------------------------------ CRDs

    def _crds(self) -> list[Mapping[str, Any]]:
        """The CRDs as a user installs them: crds/*.yaml of this checkout (a test keeps those
        equal to the API models), else rendered from the models (an installed package)."""
        if self.crds is not None:
            return list(self.crds)
        directory = Path(__file__).resolve().parents[3] / "crds"
        files = sorted(directory.glob("*.yaml")) if directory.is_dir() else []
        if files:
            return [doc for f in files for doc in yaml.safe_load_all(f.read_text()) if doc]
        from vllm_autotuner.api.crds import render_crds

        return list(render_crds())

    def install_crds(self, crds: Iterable[Mapping[str, Any]]) -> None:
        """Create (or replace) each CRD, then wait until every one is Established."""
        path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        names = []
        for crd in crds:
            name = crd["metadata"]["name"]
            names.append(name)
            status, body = self.request(
                "PATCH",
                f"{path}/{name}?fieldManager=vllm-localcluster&force=true",
                crd,
                content_type="application/apply-patch+yaml",
            )
            if status not in (200, 201):
                raise ControlPlaneError(f"installing CRD {name}: {status} {body}")
        deadline = time.monotonic() + self.startup_timeout_s
        for name in names:
            while not self._established(path, name):
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"CRD {name} not Established")
                time.sleep(0.05)

    def _established(self, path: str, name: str) -> bool:
        status, body = self.request("GET", f"{path}/{name}")
        if status != 200:
            return False
        conditions = (body.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
