"""A soak run on the one-machine cluster: several tuned deployments, traffic, faults, hours of
simulated time, and the checks that nothing was lost or left half-done.

Time: the simulator runs `time_scale` virtual seconds per wall second and the operator's policy
durations are divided by the same factor, so "2 virtual hours at 20x" is a 6-minute run in
which every deployment can roll out, verify and commit or roll back several times.

Faults (with `faults=True`), spread over the run: a simulator pod killed (the node agent
restarts it, as a kubelet would), Prometheus stopped and started again on the same port, and
bursts of 409 Conflict and 503 on the operator's writes. The cluster is the real control plane;
the operator reaches it through a fault proxy (vllm_localcluster.faults) that injects the
errors and records every request.

With an autoscaler (`autoscaler=True`), every deployment's replica count belongs to a replica
autoscaler (vllm_localcluster.autoscaler, writing /scale as the HPA controller does) that moves
it between 1 and 2 every `scale_every_virtual_s`: the even deployments with
`autoscaling.target: Deployment` (the autoscaler scales the owned Deployment), the odd ones with
`target: VLLMDeployment` (it scales the VLLMDeployment). The check then counts the operator's
writes to a replica count an autoscaler owns (the goal is none) from the proxy's record.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from vllm_localcluster.autoscaler import ScheduledScaler
from vllm_localcluster.cluster import LocalCluster
from vllm_localcluster.controlplane import pki
from vllm_localcluster.faults import FaultProxy, RequestRecord
from vllm_localcluster.prometheus import PrometheusServer
from vllm_localcluster.service_proxy import ServiceProxy

GROUP_PATH = "/apis/vllm.autotuner.io/v1alpha1"
NAMESPACE = "soak"
OPERATOR_AGENTS = ("vllm-autotuner/", "kopf/")


def operator_write(r: RequestRecord) -> bool:
    """A write only the operator makes (everyone else reaches the API server directly, not
    through the proxy, but the check by kind keeps the count honest either way)."""
    if r.verb in ("get", "list", "watch") or not (r.user_agent or "").startswith(OPERATOR_AGENTS):
        return False
    if r.resource in ("vllmdeployments", "vllmtuningpolicies", "events"):
        return True
    return r.resource in ("deployments", "services") and r.subresource is None


@dataclass(frozen=True)
class SoakConfig:
    deployments: int = 3
    virtual_hours: float = 2.0
    time_scale: float = 20.0
    rate: float = 0.5  # requests per virtual second per deployment
    faults: bool = False
    out: Path = Path("bench/results/soak")
    seed: int = 1
    autoscaler: bool = False
    scale_every_virtual_s: float = 300.0

    @property
    def wall_s(self) -> float:
        return self.virtual_hours * 3600.0 / self.time_scale

    def virtual(self, seconds: float) -> str:
        """A policy duration of `seconds` virtual seconds, in wall time for the operator."""
        return f"{max(1.0, seconds / self.time_scale):.0f}s"

    def policy(self) -> dict[str, Any]:
        # Production-like durations in virtual time: 10 min windows and minInterval, a 15 min
        # verification, 20 min to become ready.
        return {
            "apiVersion": "vllm.autotuner.io/v1alpha1",
            "kind": "VLLMTuningPolicy",
            "metadata": {"name": "soak"},
            "spec": {
                "slo": {
                    "ttft": {"percentile": 95, "thresholdMs": 1000},
                    "itl": {"percentile": 95, "thresholdMs": 25},
                },
                "rollout": {
                    "minInterval": self.virtual(600),
                    "maxPerDay": 1000,
                    "verifyWindow": self.virtual(900),
                    "readyTimeout": self.virtual(1200),
                },
                "minRequestsPerWindow": 50,
                "evaluationWindow": self.virtual(600),
            },
        }

    def deployment(self, i: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "apiVersion": "vllm.autotuner.io/v1alpha1",
            "kind": "VLLMDeployment",
            "metadata": {"name": f"llm-{i}", "namespace": NAMESPACE},
            "spec": {
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "gpu": {"count": 1, "product": "H100"},
                "tuning": {"mode": "Auto", "policyRef": "soak"},
            },
        }
        if self.autoscaler:
            body["spec"].update(
                autoscaling={"target": scale_target(i)},
                rollout={"maxSurge": 1, "maxUnavailable": 0},
            )
        return body


def scale_target(i: int) -> str:
    """Which object the soak's autoscaler scales for deployment `i`."""
    return "Deployment" if i % 2 == 0 else "VLLMDeployment"


def writes_owned_replicas(r: RequestRecord, name: str, target: str) -> bool:
    """An operator request that writes the replica count the autoscaler owns: the Deployment's
    spec.replicas or /scale (target Deployment), the VLLMDeployment's spec or /scale (target
    VLLMDeployment; the operator writes only its status)."""
    if r.verb not in ("create", "update", "patch") or r.name != name:
        return False
    body = r.body if isinstance(r.body, dict) else {}
    if target == "Deployment":
        spec = body.get("spec")
        return r.resource == "deployments" and (
            r.subresource == "scale" or (isinstance(spec, dict) and "replicas" in spec)
        )
    return (
        r.resource == "vllmdeployments"
        and r.subresource != "status"
        and (r.subresource == "scale" or "spec" in body)
    )


@dataclass
class SoakReport:
    config: dict[str, Any]
    wall_s: float
    faults: list[str] = field(default_factory=list)
    rollouts: int = 0
    commits: int = 0
    rollbacks: int = 0
    trials: dict[str, int] = field(default_factory=dict)
    requests_completed: int = 0
    requests_failed: int = 0
    operator_restarts: int = 0
    operator_writes: dict[str, int] = field(default_factory=dict)
    # With an autoscaler: its writes, and the operator's to a count the autoscaler owns.
    autoscaler_writes: int = 0
    autoscaler_errors: list[str] = field(default_factory=list)
    operator_writes_to_autoscaled_replicas: int = 0
    injected_errors: int = 0
    problems: list[str] = field(default_factory=list)
    deployments: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.operator_writes_to_autoscaled_replicas == 0


def _seconds(text: str) -> float:
    return float(text.rstrip("s"))


def _parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


class Soak:
    def __init__(self, config: SoakConfig, log: Any = print) -> None:
        self.config = config
        self.log = log
        self.cluster: LocalCluster | None = None
        self.faults: FaultProxy | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.proxies: list[ServiceProxy] = []
        self.load_results: list[Any] = []
        self._load_threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.report = SoakReport(config={**asdict(config), "out": str(config.out)}, wall_s=0.0)
        self.rng = random.Random(config.seed)
        self.scalers: dict[str, ScheduledScaler] = {}

    # ------------------------------------------------------------------ plumbing

    def api(self, method: str, path: str, body: Any = None) -> Any:
        assert self.cluster is not None
        status, answer = self.cluster.request(method, path, body, timeout=30)
        if status >= 400:
            raise RuntimeError(f"{method} {path}: {status} {answer}")
        return answer

    def deployment(self, name: str) -> dict[str, Any] | None:
        assert self.cluster is not None
        path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}"
        status, answer = self.cluster.request("GET", path)
        return dict(answer) if status == 200 else None

    def start_faults(self, workdir: Path) -> Path:
        """The fault proxy in front of the API server, and a kubeconfig for the operator that
        points at it (plain HTTP; the proxy adds the operator's token)."""
        assert self.cluster is not None and self.cluster.control_plane is not None
        token = self.cluster.control_plane.token_for(pki.OPERATOR[0])
        self.faults = FaultProxy(self.cluster.url, str(self.cluster.ca_file), token=token)
        self.faults.start_in_thread()
        kubeconfig = workdir / "operator-via-faults.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "faults",
            "clusters": [{"name": "faults", "cluster": {"server": self.faults.url}}],
            "users": [{"name": "operator", "user": {}}],
            "contexts": [{"name": "faults", "context": {"cluster": "faults", "user": "operator"}}],
        }))  # fmt: skip
        return kubeconfig

    def start_operator(self, workdir: Path) -> None:
        assert self.cluster is not None
        cmd = [
            sys.executable, "-m", "vllm_autotuner.cli", "run",
            "--kubeconfig", str(workdir / "operator-via-faults.kubeconfig"),
            "--prometheus-url", self.cluster.prometheus_url,
            "--prometheus-rate-scale", f"{self.config.time_scale:g}",
            "--prometheus-min-window", "20s",
            "--prometheus-timeout", "3s",
            "--reconcile-interval", "3s",
            "--liveness-port", "0",
            "--metrics-port", "0",
        ]  # fmt: skip
        log = (workdir / "operator.log").open("ab")
        self.operator = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop_operator(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.operator.pid, signal.SIGTERM)
            try:
                self.operator.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.operator.pid, signal.SIGKILL)
                self.operator.wait(5)

    def start_load(self, index: int, name: str) -> None:
        from vllm_sim.loadgen import run_http
        from vllm_sim.workload import WorkloadSpec

        cfg = self.config
        cluster = self.cluster
        assert cluster is not None
        proxy = ServiceProxy.for_service(cluster.api_endpoint(), NAMESPACE, name)
        proxy.start_in_thread()
        self.proxies.append(proxy)
        spec = WorkloadSpec.preset("rag", cfg.rate, cfg.wall_s * cfg.time_scale, seed=index)

        def main() -> None:
            result = asyncio.run(
                run_http(
                    proxy.url,
                    spec,
                    model="meta-llama/Llama-3.1-8B-Instruct",
                    time_scale=cfg.time_scale,
                    duration=cfg.wall_s,
                    timeout=cfg.wall_s + 60,
                    concurrency=128,
                )
            )
            self.load_results.append(result)

        thread = threading.Thread(target=main, name=f"load-{name}", daemon=True)
        thread.start()
        self._load_threads.append(thread)

    # ------------------------------------------------------------------ faults

    def kill_a_pod(self) -> str:
        assert self.cluster is not None and self.cluster.agent is not None
        alive = [
            pid
            for pid in sorted(self.cluster.agent.pids())
            if Path(f"/proc/{pid}").exists()
            and b"vllm" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        if not alive:
            return "kill a pod: no simulator process alive"
        pid = self.rng.choice(alive)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return f"killed simulator process {pid}"

    def restart_prometheus(self, down_s: float) -> str:
        assert self.cluster is not None and self.cluster.prometheus is not None
        old = self.cluster.prometheus
        port = old.port
        old.stop()
        self._stop.wait(down_s)
        fresh = PrometheusServer(old.workdir, scrape_interval=old.scrape_interval, port=port)
        self.cluster.prometheus = fresh.start()
        return f"Prometheus down for {down_s:.0f}s, restarted on port {port}"

    def api_errors(self, status: int, times: int) -> str:
        assert self.faults is not None
        self.faults.inject(operator_write, status=status, times=times)
        self.report.injected_errors += times
        return f"{times} operator writes answered {status}"

    def fault_plan(self) -> list[tuple[float, Any]]:
        """(fraction of the run, action): faults in the middle 80%, none at the very end, so the
        final checks see the system after it had time to recover."""
        wall = self.config.wall_s
        return [
            (0.15, lambda: self.api_errors(409, 10)),
            (0.25, self.kill_a_pod),
            (0.35, lambda: self.restart_prometheus(min(30.0, 0.05 * wall))),
            (0.50, lambda: self.api_errors(503, 15)),
            (0.60, self.kill_a_pod),
            (0.70, lambda: self.api_errors(409, 10)),
        ]

    # ------------------------------------------------------------------ the run

    def run(self) -> SoakReport:
        cfg = self.config
        # Absolute: Prometheus resolves file_sd paths against its config file's directory.
        workdir = (cfg.out / "run").resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            self.cluster = LocalCluster(
                workdir=workdir, time_scale=cfg.time_scale, speed=cfg.time_scale
            ).start()
            self.start_faults(workdir)
            self.start_operator(workdir)
            self.api("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
            self.api("POST", f"{GROUP_PATH}/vllmtuningpolicies", cfg.policy())
            names = []
            for i in range(cfg.deployments):
                body = cfg.deployment(i)
                self.api("POST", f"{GROUP_PATH}/namespaces/{NAMESPACE}/vllmdeployments", body)
                names.append(body["metadata"]["name"])
            self.wait_for_pods(names, timeout_s=180)
            for i, name in enumerate(names):
                self.start_load(i, name)
            if cfg.autoscaler:
                self.start_scalers(names)
            load_started = time.monotonic()
            self.log(f"traffic on {len(names)} deployments for {cfg.wall_s:.0f}s wall")
            plan = sorted(self.fault_plan()) if cfg.faults else []
            while time.monotonic() - load_started < cfg.wall_s:
                elapsed = (time.monotonic() - load_started) / cfg.wall_s
                while plan and plan[0][0] <= elapsed:
                    _, action = plan.pop(0)
                    note = action()
                    self.report.faults.append(f"t={time.monotonic() - load_started:.0f}s {note}")
                    self.log(f"  fault: {note}")
                if self.operator is not None and self.operator.poll() is not None:
                    self.report.operator_restarts += 1
                    self.log("  the operator exited; restarting it (as its Deployment would)")
                    self.start_operator(workdir)
                self._stop.wait(1.0)
            if self.scalers:
                # The count stops moving with the traffic: the settle then sees a still target.
                for scaler in self.scalers.values():
                    scaler.stop()
                writes = sum(len(s.writes) for s in self.scalers.values())
                self.log(f"autoscalers stopped after {writes} writes")
            # Settle: one verification window plus a few reconciles to finish open trials.
            settle = _seconds(cfg.virtual(900)) + _seconds(cfg.virtual(1200)) + 15
            self.log(f"traffic done; settling for up to {settle:.0f}s")
            self.settle(names, settle)
            self.check(names)
        finally:
            self._stop.set()
            for scaler in self.scalers.values():
                scaler.stop()
            for thread in self._load_threads:
                thread.join(60)
            self.stop_operator()
            for proxy in self.proxies:
                proxy.stop()
            if self.faults is not None:
                self.faults.stop()
            if self.cluster is not None:
                self.cluster.stop()
            self.report.wall_s = round(time.monotonic() - started, 1)
        for result in self.load_results:
            summary = result.summary.as_dict()
            self.report.requests_completed += int(summary["completed"])
            self.report.requests_failed += int(summary["requests"]) - int(summary["completed"])
        return self.report

    def start_scalers(self, names: list[str]) -> None:
        """One autoscaler per deployment, 2 and 1 replicas in turn (as the admin, directly)."""
        cluster = self.cluster
        assert cluster is not None
        period = self.config.scale_every_virtual_s / self.config.time_scale
        for i, name in enumerate(names):
            kind = "apis/apps/v1" if scale_target(i) == "Deployment" else GROUP_PATH[1:]
            plural = "deployments" if scale_target(i) == "Deployment" else "vllmdeployments"
            path = f"/{kind}/namespaces/{NAMESPACE}/{plural}/{name}/scale"
            self.scalers[name] = ScheduledScaler(
                cluster.url, cluster.token, str(cluster.ca_file), path, (2, 1), period
            ).start()

    def check_replica_writes(self, names: list[str]) -> None:
        """Once an autoscaler has written a count, the operator never writes that count."""
        report = self.report
        assert self.faults is not None
        for i, name in enumerate(names):
            scaler = self.scalers[name]
            report.autoscaler_writes += len(scaler.writes)
            report.autoscaler_errors += [f"{name}: {e}" for e in scaler.errors]
            if not scaler.writes:
                report.problems.append(f"{name}: the autoscaler never wrote ({scaler.errors})")
                continue
            first = scaler.writes[0].time
            bad = [
                r
                for r in self.faults.requests
                if r.time >= first and writes_owned_replicas(r, name, scale_target(i))
            ]
            report.operator_writes_to_autoscaled_replicas += len(bad)
            for r in bad[:3]:
                report.problems.append(f"{name}: the operator wrote the autoscaler's count: {r}")
            last = scaler.writes[-1].after
            if scale_target(i) == "Deployment":
                live = ((self.deployment(name) or {}).get("spec") or {}).get("replicas")
            else:
                path = f"{GROUP_PATH}/namespaces/{NAMESPACE}/vllmdeployments/{name}"
                live = (self.api("GET", path).get("spec") or {}).get("replicas")
            if live != last:
                report.problems.append(f"{name}: replicas {live}, the autoscaler wrote {last}")

    def wait_for_pods(self, names: list[str], timeout_s: float) -> None:
        assert self.cluster is not None
        deadline = time.monotonic() + timeout_s
        while not all(self.cluster.endpoints(NAMESPACE, n) for n in names):
            if time.monotonic() > deadline:
                raise RuntimeError(f"pods not ready within {timeout_s:.0f}s")
            time.sleep(0.5)

    def items(self) -> list[dict[str, Any]]:
        path = f"{GROUP_PATH}/namespaces/{NAMESPACE}/vllmdeployments"
        return list(self.api("GET", path).get("items", []))

    def settle(self, names: list[str], limit_s: float) -> None:
        """Wait until no deployment is in a trial, every Deployment is available, and the
        operator has metrics of the revision it runs (a rollback just before the end needs a
        window of the new pod first), or the limit passes: the checks then say what is wrong."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            settled = True
            for item in self.items():
                tuning = (item.get("status") or {}).get("tuning") or {}
                if tuning.get("phase") in ("RollingOut", "Verifying", "Promoting"):
                    settled = False
                conditions = (item.get("status") or {}).get("conditions") or []
                metrics = [c for c in conditions if c.get("type") == "MetricsAvailable"]
                if not metrics or metrics[0].get("status") != "True":
                    settled = False
                name = item["metadata"]["name"]
                dep = self.deployment(name) or {}
                if not (dep.get("status") or {}).get("availableReplicas"):
                    settled = False
            if settled:
                return
            time.sleep(2)

    # ------------------------------------------------------------------ checks

    def check(self, names: list[str]) -> None:
        cfg = self.config
        report = self.report
        assert self.faults is not None
        limit = _seconds(cfg.virtual(1200)) + _seconds(cfg.virtual(900))
        now = datetime.now(tz=UTC)
        items = {i["metadata"]["name"]: i for i in self.items()}
        trials: Counter[str] = Counter()
        for name in names:
            item = items.get(name)
            if item is None:
                report.problems.append(f"{name}: the VLLMDeployment is gone")
                continue
            status = item.get("status") or {}
            tuning = status.get("tuning") or {}
            summary: dict[str, Any] = {"name": name, "phase": tuning.get("phase")}
            if status.get("observedGeneration") != item["metadata"].get("generation"):
                report.problems.append(f"{name}: status.observedGeneration is behind")
            if not tuning.get("applied") or not tuning.get("lastGood"):
                report.problems.append(f"{name}: status.tuning lost applied/lastGood: {tuning}")
            for trial in tuning.get("trials") or []:
                trials[str(trial.get("outcome"))] += 1
                started = _parse_time(trial.get("startedAt"))
                if trial.get("outcome") == "Pending" and started is not None:
                    age = (now - started).total_seconds()
                    if age > limit:
                        report.problems.append(
                            f"{name}: trial {trial.get('id')} pending for {age:.0f}s "
                            f"(> readyTimeout + verifyWindow = {limit:.0f}s)"
                        )
            dep = self.deployment(name)
            if dep is None:
                report.problems.append(f"{name}: its Deployment is gone")
            else:
                template = dep["spec"]["template"]["metadata"].get("annotations") or {}
                summary["deployed"] = template.get("vllm.autotuner.io/knobs")
                summary["applied"] = tuning.get("applied")
                summary["available"] = (dep.get("status") or {}).get("availableReplicas")
                if not summary["available"]:
                    report.problems.append(f"{name}: no available replica at the end")
            summary["conditions"] = {
                c["type"]: f"{c['status']} {c.get('reason')}: {c.get('message', '')}"[:300]
                for c in status.get("conditions") or []
            }
            summary["lastDecision"] = tuning.get("lastDecision")
            metrics: dict[str, Any] = next(
                (c for c in status.get("conditions") or [] if c["type"] == "MetricsAvailable"), {}
            )
            if metrics.get("status") != "True":
                report.problems.append(
                    f"{name}: no metrics at the end: {metrics.get('message', 'no condition')}"
                )
            report.deployments.append(summary)
        report.trials = dict(trials)
        events = self.api("GET", f"/api/v1/namespaces/{NAMESPACE}/events").get("items", [])
        reasons = Counter(e.get("reason") for e in events)
        # A trial starts as a rolling update or as a canary (one pod first).
        report.rollouts = reasons.get("RolloutStarted", 0) + reasons.get("CanaryStarted", 0)
        report.commits = reasons.get("TuningCommitted", 0)
        report.rollbacks = reasons.get("TuningRolledBack", 0)
        writes = Counter(
            f"{r.verb} {r.resource}{'/' + r.subresource if r.subresource else ''} {r.status_code}"
            for r in self.faults.requests
            if operator_write(r)
        )
        report.operator_writes = dict(writes)
        if self.scalers:
            self.check_replica_writes(names)
        if report.rollouts == 0:
            report.problems.append("no rollout happened: the run exercised no trial")


def save(report: SoakReport, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {**asdict(report), "ok": report.ok}
    (out / "soak.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
