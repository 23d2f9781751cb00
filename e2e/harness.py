"""The closed loop under test: one-machine cluster, Service, operator process, client load.

The demo (`vllm_localcluster.demo`) wires the same parts for people; the scenarios need
more control over them than a demo should offer: kill and restart the operator mid-rollout,
stop and restart Prometheus on the same port (the operator's Prometheus URL is fixed when it
starts), and a client that records every request's outcome with its wall time, so a test can
prove that the Service kept answering while pods were replaced. The building blocks are
imported, never copied: LocalCluster, ServiceProxy, the `vllm-autotuner run` entry point,
vllm-sim's workload generator and request bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import requests

from vllm_localcluster.cluster import LocalCluster
from vllm_localcluster.prometheus import PrometheusServer
from vllm_localcluster.service_proxy import ServiceProxy
from vllm_sim.loadgen import request_body
from vllm_sim.types import Request
from vllm_sim.workload import WorkloadSpec

GROUP_PATH = "/apis/vllm.autotuner.io/v1alpha1"
POLICY_PATH = f"{GROUP_PATH}/vllmtuningpolicies"
KNOBS_ANNOTATION = "vllm.autotuner.io/knobs"
DEPLOYMENT_LABEL = "vllm.autotuner.io/deployment"
TRACK_LABEL = "vllm.autotuner.io/track"


def cr_path(namespace: str) -> str:
    return f"{GROUP_PATH}/namespaces/{namespace}/vllmdeployments"


def condition(status: Mapping[str, Any], cond_type: str) -> dict[str, Any]:
    for cond in status.get("conditions") or []:
        if cond.get("type") == cond_type:
            return dict(cond)
    return {}


@dataclass(frozen=True)
class Completion:
    """One request as the client saw it: wall times (time.monotonic) and whether it succeeded."""

    sent: float
    finished: float
    ok: bool
    error: str | None = None


def completion_error(status: int, payload: bytes) -> str | None:
    """Why a non-streamed completion failed, or None. A 200 can be a failure too: a server
    that drains answers a new request at once as aborted (finish_reason "abort", no tokens)."""
    if status != 200:
        return f"HTTP {status}: {payload[:200]!r}"
    try:
        choices = json.loads(payload).get("choices") or []
    except (ValueError, AttributeError):
        return f"unreadable completion: {payload[:200]!r}"
    if not choices:
        return "a completion without choices"
    if any(c.get("finish_reason") == "abort" for c in choices):
        return "aborted by the server"
    return None


class LoadDriver:
    """Open-loop traffic at the workload's arrival times (virtual / time_scale wall seconds).

    Responses are not streamed: the operator judges from Prometheus, and one JSON body per
    request costs a fraction of the CPU of an event stream, which matters on two cores.
    Outcomes are readable while the load runs (`completions()`), unlike `run_http`'s, which
    come back only at the end.
    """

    def __init__(
        self,
        url: str,
        spec: WorkloadSpec,
        *,
        model: str,
        time_scale: float,
        concurrency: int = 256,
    ) -> None:
        self.url = url.rstrip("/")
        self.requests: list[Request] = sorted(spec.generate(), key=lambda r: r.arrival_time)
        self.model = model
        self.time_scale = time_scale
        self.concurrency = concurrency
        self._done: list[Completion] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.started_at = 0.0

    def completions(self) -> list[Completion]:
        with self._lock:
            return list(self._done)

    def failures(self) -> list[Completion]:
        return [c for c in self.completions() if not c.ok]

    def successes_since(self, t0: float) -> int:
        return sum(1 for c in self.completions() if c.ok and c.finished >= t0)

    def longest_silence(self, t0: float, t1: float) -> float:
        """The longest stretch of [t0, t1] in which no request completed successfully."""
        ends = sorted(c.finished for c in self.completions() if c.ok and t0 <= c.finished <= t1)
        marks = [t0, *ends, t1]
        return max(b - a for a, b in itertools.pairwise(marks))

    async def _one(self, session: aiohttp.ClientSession, request: Request) -> None:
        body = request_body(request, self.model)
        body["stream"] = False
        body.pop("stream_options", None)
        sent = time.monotonic()
        ok, error = False, None
        try:
            async with session.post(f"{self.url}/v1/completions", json=body) as response:
                payload = await response.read()
                error = completion_error(response.status, payload)
                ok = error is None
        except (aiohttp.ClientError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._done.append(Completion(sent, time.monotonic(), ok, error))

    async def _run(self) -> None:
        slots = asyncio.Semaphore(self.concurrency)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks: set[asyncio.Task[None]] = set()

            async def send(request: Request) -> None:
                async with slots:
                    await self._one(session, request)

            try:
                for request in self.requests:
                    due = self.started_at + request.arrival_time / self.time_scale
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    task = asyncio.create_task(send(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                for task in list(tasks):
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def start(self) -> LoadDriver:
        ready = threading.Event()

        def main() -> None:
            async def body() -> None:
                self._loop = asyncio.get_running_loop()
                self._task = asyncio.current_task()
                ready.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._run()

            asyncio.run(body())

        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=main, name="e2e-load", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the load driver did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._task is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None


class ClosedLoop:
    """Everything one scenario runs, started in order and stopped in reverse by `close()`."""

    def __init__(
        self,
        workdir: Path,
        *,
        namespace: str = "default",
        time_scale: float = 5.0,
        sim_env: Mapping[str, str] | None = None,
        sim_env_by_labels: Sequence[tuple[Mapping[str, str], Mapping[str, str]]] = (),
        reconcile_interval_s: float = 3.0,
        min_window: str = "30s",
        audit: bool = False,
    ) -> None:
        self.workdir = workdir
        self.namespace = namespace
        self.time_scale = time_scale
        self.reconcile_interval_s = reconcile_interval_s
        self.min_window = min_window
        self.cluster = LocalCluster(
            workdir=workdir,
            time_scale=time_scale,
            speed=time_scale,
            sim_env=sim_env,
            sim_env_by_labels=sim_env_by_labels,
            audit=audit,
        )
        self.proxy: ServiceProxy | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.load: LoadDriver | None = None
        self.name = ""
        self.session = requests.Session()
        self.session.trust_env = False  # this cluster's CA, not REQUESTS_CA_BUNDLE
        self.started_pids: set[int] = set()

    # ------------------------------------------------------------------------ lifecycle

    def start(self) -> ClosedLoop:
        self.cluster.start()
        self.session.headers["Authorization"] = f"Bearer {self.cluster.token}"
        self.session.verify = str(self.cluster.ca_file)
        return self

    def close(self) -> set[int]:
        """Stop everything; returns the process ids this loop started (to check they are gone)."""
        pids = set(self.started_pids) | self.cluster.pids()
        if self.load is not None:
            self.load.stop()
        self.stop_operator()
        if self.proxy is not None:
            self.proxy.stop()
        self.cluster.stop()
        self.session.close()
        return pids

    @property
    def operator_log(self) -> Path:
        return self.workdir / "operator.log"

    def start_operator(self) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable, "-m", "vllm_autotuner.cli", "run",
            "--kubeconfig", str(self.cluster.kubeconfig),
            "--prometheus-url", self.cluster.prometheus_url,
            "--prometheus-rate-scale", f"{self.time_scale:g}",
            "--prometheus-min-window", self.min_window,
            "--reconcile-interval", f"{self.reconcile_interval_s:g}s",
            "--liveness-port", "0",
            "--metrics-port", "0",
        ]  # fmt: skip
        with self.operator_log.open("ab") as log:
            self.operator = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started_pids.add(self.operator.pid)
        return self.operator

    def kill_operator(self) -> int:
        """SIGKILL: no cleanup handlers, no final status write, as a node failure would do."""
        assert self.operator is not None
        os.killpg(self.operator.pid, signal.SIGKILL)
        return self.operator.wait(10)

    def stop_operator(self) -> None:
        process = self.operator
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)

    def operator_alive(self) -> bool:
        return self.operator is not None and self.operator.poll() is None

    def stop_prometheus(self) -> int:
        """Stop the server; returns its port so `start_prometheus` can come back on it."""
        prom = self.cluster.prometheus
        assert prom is not None
        port = prom.port
        prom.stop()
        return port

    def start_prometheus(self, port: int) -> PrometheusServer:
        """A new server on the old port and the same storage and targets file.

        PrometheusServer.start() picks a fresh port unless one was requested, and the operator's
        URL cannot change, so the restarted server is a new object pinned to the port. The pod
        node agent keeps writing targets through the old object's `set_targets`, which writes the
        same file in the same directory, so discovery continues.
        """
        old = self.cluster.prometheus
        assert old is not None
        new = PrometheusServer(old.workdir, scrape_interval=old.scrape_interval, port=port)
        new.start()
        self.cluster.prometheus = new
        return new

    # ------------------------------------------------------------------------ the API

    def url(self, path: str) -> str:
        return self.cluster.url + path

    def get(self, path: str) -> dict[str, Any] | None:
        r = self.session.get(self.url(path), timeout=10)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return dict(r.json())

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        r = self.session.post(self.url(path), json=dict(body), timeout=10)
        if r.status_code not in (200, 201):
            raise AssertionError(f"POST {path}: {r.status_code} {r.text}")
        return dict(r.json())

    def apply(self, policy: Mapping[str, Any], deployment: Mapping[str, Any]) -> None:
        self.create(POLICY_PATH, policy)
        self.create(cr_path(self.namespace), deployment)
        self.name = str(deployment["metadata"]["name"])
        # The Service the operator creates is named after the VLLMDeployment.
        self.proxy = ServiceProxy.for_service(
            self.cluster.api_endpoint(), self.namespace, self.name
        ).start_in_thread()

    def cr(self) -> dict[str, Any]:
        return self.get(f"{cr_path(self.namespace)}/{self.name}") or {}

    def status(self) -> dict[str, Any]:
        return dict(self.cr().get("status") or {})

    def tuning(self) -> dict[str, Any]:
        return dict(self.status().get("tuning") or {})

    def condition(self, cond_type: str) -> dict[str, Any]:
        return condition(self.status(), cond_type)

    def events(self) -> list[dict[str, Any]]:
        return self.events_of(self.name)

    def events_of(self, name: str) -> list[dict[str, Any]]:
        """The Events of the objects named `name` in the namespace (any kind)."""
        selector = urllib.parse.quote(f"involvedObject.name={name}")
        path = f"/api/v1/namespaces/{self.namespace}/events?fieldSelector={selector}"
        return list((self.get(path) or {}).get("items") or [])

    def event_reasons(self) -> list[str]:
        return [str(e.get("reason")) for e in self.events()]

    def deployment(self) -> dict[str, Any]:
        return self.get(f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.name}") or {}

    def deployment_knobs(self) -> str | None:
        """The knobs the Deployment's pod template runs (the operator's annotation on it)."""
        template = (self.deployment().get("spec") or {}).get("template") or {}
        return ((template.get("metadata") or {}).get("annotations") or {}).get(KNOBS_ANNOTATION)

    def canary(self) -> dict[str, Any] | None:
        """The canary Deployment (`<name>-canary`), while one runs."""
        return self.get(f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.name}-canary")

    def pods(self) -> list[dict[str, Any]]:
        """Every pod of the VLLMDeployment (stable and canary, terminating ones included)."""
        selector = urllib.parse.quote(f"{DEPLOYMENT_LABEL}={self.name}")
        path = f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={selector}"
        return list((self.get(path) or {}).get("items") or [])

    def replicasets(self) -> list[dict[str, Any]]:
        """The Deployment's ReplicaSets: one per pod template it ever ran (its revisions)."""
        owner_uid = (self.deployment().get("metadata") or {}).get("uid")
        items = (self.get(f"/apis/apps/v1/namespaces/{self.namespace}/replicasets") or {}).get(
            "items"
        ) or []
        return [
            rs
            for rs in items
            if any(
                ref.get("uid") == owner_uid
                for ref in (rs.get("metadata") or {}).get("ownerReferences") or []
            )
        ]

    # ------------------------------------------------------------------------ traffic

    def ready_endpoints(self) -> int:
        return len(self.proxy.endpoints()) if self.proxy is not None else 0

    def start_load(self, workload: str, rate: float, *, minutes: float = 12.0) -> LoadDriver:
        assert self.proxy is not None
        spec = WorkloadSpec.preset(workload, rate, minutes * 60.0 * self.time_scale, seed=7)
        model = str(self.cr()["spec"]["model"])
        self.load = LoadDriver(
            self.proxy.url, spec, model=model, time_scale=self.time_scale
        ).start()
        return self.load

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.operator_log.read_text(errors="replace")
        except OSError:
            return "(no operator log)"
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class PodView:
    """One pod as a person checks it with kubectl: which, where from, on what, alive how."""

    name: str
    uid: str
    start_time: str | None
    knobs: str | None
    canary: bool
    ready: bool
    terminating: bool
    restarts: int

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> PodView:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        return cls(
            name=str(meta.get("name")),
            uid=str(meta.get("uid")),
            start_time=status.get("startTime"),
            knobs=(meta.get("annotations") or {}).get(KNOBS_ANNOTATION),
            canary=(meta.get("labels") or {}).get(TRACK_LABEL) == "canary",
            ready=ready,
            terminating=bool(meta.get("deletionTimestamp")),
            restarts=sum(
                int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or []
            ),
        )


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"
