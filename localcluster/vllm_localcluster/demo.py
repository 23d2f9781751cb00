"""`vllm-localcluster demo`: the whole closed loop on one machine, no cluster and no GPU.

It starts the one-machine cluster (a real Kubernetes control plane, the node agent running
pods as vllm-sim processes, the real Prometheus), a proxy in front of the Service's ready
endpoints, the real operator (the same `run` entry point, as a separate process pointed at the
cluster's kubeconfig), applies a policy and a VLLMDeployment, and
drives long-prompt traffic that vLLM's default token budget serves badly under a tight
inter-token-latency SLO. It prints what happens as it happens and writes a report (PNG plots
and a markdown summary). Ctrl-C stops every process it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from vllm_localcluster.cluster import LocalCluster
from vllm_localcluster.narration import (
    Narrator,
    canary_running,
    console_line,
    knob_label,
    latency,
    percentile_label,
)
from vllm_localcluster.service_proxy import ServiceProxy

NAMESPACE = "default"
NAME = "demo"
CR_PATH = f"/apis/vllm.autotuner.io/v1alpha1/namespaces/{NAMESPACE}/vllmdeployments"
POLICY_PATH = "/apis/vllm.autotuner.io/v1alpha1/vllmtuningpolicies"

# The embedded default (examples/demo-*.yaml hold the same objects for kubectl users; a test
# keeps them equal). Windows are short so a whole tuning cycle fits in minutes.
DEMO_POLICY: dict[str, Any] = {
    "apiVersion": "vllm.autotuner.io/v1alpha1",
    "kind": "VLLMTuningPolicy",
    "metadata": {"name": "demo"},
    "spec": {
        "slo": {
            "ttft": {"percentile": 95, "thresholdMs": 1000},
            "itl": {"percentile": 99, "thresholdMs": 25},
        },
        "rollout": {
            "minInterval": "30s",
            "maxPerDay": 100,
            "verifyWindow": "45s",
            "readyTimeout": "2m",
        },
        "minRequestsPerWindow": 50,
        "evaluationWindow": "30s",
    },
}

DEMO_DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "vllm.autotuner.io/v1alpha1",
    "kind": "VLLMDeployment",
    "metadata": {"name": NAME, "namespace": NAMESPACE},
    "spec": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "gpu": {"count": 1, "product": "H100"},
        "replicas": 2,
        "rollout": {"maxSurge": 1, "maxUnavailable": 0},
        "tuning": {"mode": "Auto", "policyRef": "demo"},
    },
}


def fresh_workdir(out: Path, say: Callable[[str], None]) -> Path:
    """`out`/run, empty. A previous demo's cluster state there (etcd, pods, Prometheus) is
    removed: a new demo starts from an empty cluster, as its report describes one run (the
    real control plane keeps its state, and the second demo died on 409 AlreadyExists)."""
    workdir = out / "run"
    if workdir.exists():
        say(f"removing the previous demo's cluster state in {workdir}")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    return workdir


@dataclass(frozen=True)
class DemoConfig:
    out: Path = Path("demo-report")
    time_scale: float = 5.0  # virtual seconds of the simulated GPU per wall second
    rate: float = 5.0  # requests per virtual second, all pods together
    workload: str = "rag"
    max_minutes: float = 10.0
    settle_after_commit_s: float = 40.0
    reconcile_interval_s: float = 3.0
    keep_workdir: bool = False
    keep_running: bool = False  # after convergence, until Ctrl-C


@dataclass
class Sample:
    """One poll of the VLLMDeployment's status. `knobs` are the knobs the latencies were
    measured on (status.observed.knobs), `applied` what the stable Deployment runs; latencies
    are at the SLO's percentiles; `failed` counts the requests that failed so far, as the
    client saw them. While a canary runs, `canary` is its knobs and `canary_itl`/`baseline_itl`
    the paired comparison's latest window (status.tuning.analysis)."""

    t: float
    phase: str | None
    knobs: str | None
    ttft_ms: float | None
    itl_ms: float | None
    kv: float | None
    rate: float | None
    slo_met: str | None
    ready: str | None
    applied: str | None = None
    failed: int = 0
    canary: str | None = None
    canary_itl: float | None = None
    baseline_itl: float | None = None


@dataclass
class Traffic:
    """Requests as the client saw them: a failure is any request that did not complete (an
    HTTP error, a connection cut, a completion the server aborted). Requests cut off by the
    demo's own stop are not the Service's failures and are not counted."""

    finished: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # first words of each error -> count
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, record: Any) -> None:
        error = getattr(record, "error", None)
        if error and "cancelled" in error:
            return
        with self._lock:
            self.finished += 1
            if error:
                self.failed += 1
                key = str(error)[:60]
                self.errors[key] = self.errors.get(key, 0) + 1


@dataclass
class Timeline:
    samples: list[Sample] = field(default_factory=list)
    decisions: list[tuple[float, str, str]] = field(default_factory=list)  # (t, action, reason)
    converged_at: float | None = None  # seconds since the start


def _condition(status: Mapping[str, Any], cond_type: str) -> dict[str, Any]:
    for cond in status.get("conditions") or []:
        if cond.get("type") == cond_type:
            return dict(cond)
    return {}


class Demo:
    def __init__(self, config: DemoConfig, out: TextIO = sys.stdout) -> None:
        self.config = config
        self.out = out
        self.timeline = Timeline()
        self.cluster: LocalCluster | None = None
        self.proxy: ServiceProxy | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self._load_thread: threading.Thread | None = None
        self._load_loop: asyncio.AbstractEventLoop | None = None
        self._load_task: asyncio.Task[Any] | None = None
        self.load_result: Any = None
        self.traffic = Traffic()
        self.started = time.monotonic()
        self.narrator = Narrator()
        self._last_line = 0.0  # when the last state line was printed (monotonic)

    # ------------------------------------------------------------------------ output

    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        self.out.write(f"[{int(elapsed // 60):02d}:{int(elapsed % 60):02d}] {text}\n")
        self.out.flush()

    # ------------------------------------------------------------------------ lifecycle

    def run(self) -> int:
        cfg = self.config
        cfg.out.mkdir(parents=True, exist_ok=True)
        workdir = fresh_workdir(cfg.out, self.say)
        self.say(
            f"starting the one-machine cluster (kube-apiserver, etcd, controller manager, "
            f"scheduler, node agent, Prometheus) at {cfg.time_scale:g}x speed in {workdir}"
        )
        try:
            self.cluster = LocalCluster(workdir=workdir, time_scale=cfg.time_scale,
                                        speed=cfg.time_scale)  # fmt: skip
            self.cluster.start()
            self.say(f"kubectl:    export KUBECONFIG={self.cluster.kubeconfig.resolve()}")
            self.say(f"Prometheus: {self.cluster.prometheus_url}")
            self.proxy = ServiceProxy.for_service(
                self.cluster.api_endpoint(), NAMESPACE, NAME
            ).start_in_thread()
            self._start_operator(workdir)
            self._apply()
            self._wait_for_pods()
            self._start_load()
            converged = self._watch()
            self._report(converged)
            if cfg.keep_running:
                self._keep_running(converged)
            self._stop_load()
            return 0 if converged else 1
        except KeyboardInterrupt:
            self.say("interrupted: stopping everything")
            return 130
        finally:
            self.shutdown()

    def _keep_running(self, converged: bool) -> None:
        """Go on serving, tuning and printing until Ctrl-C (or SIGTERM); then the report is
        written again with everything that happened."""
        assert self.cluster is not None
        self.say(
            "still running: press Ctrl-C to stop. kubectl: "
            f"KUBECONFIG={self.cluster.kubeconfig.resolve()} kubectl get vllmd; "
            f"Prometheus: {self.cluster.prometheus_url}"
        )
        try:
            while True:
                self._ensure_load()
                self._observe(print_every_s=30.0)
                time.sleep(2.0)
        except KeyboardInterrupt:
            self.say("Ctrl-C: writing the report and stopping")
            self._stop_load()
            self._report(converged)

    def shutdown(self) -> None:
        self._stop_load()
        if self.operator is not None and self.operator.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.operator.pid, signal.SIGTERM)
            try:
                self.operator.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.operator.pid, signal.SIGKILL)
                self.operator.wait(5)
        if self.proxy is not None:
            self.proxy.stop()
        if self.cluster is not None:
            self.cluster.stop()

    def _endpoints(self) -> list[tuple[str, str]]:
        return self.cluster.endpoints(NAMESPACE, NAME) if self.cluster is not None else []

    def _start_operator(self, workdir: Path) -> None:
        assert self.cluster is not None
        cmd = [
            sys.executable, "-m", "vllm_autotuner.cli", "run",
            "--kubeconfig", str(self.cluster.kubeconfig),
            "--prometheus-url", self.cluster.prometheus_url,
            "--prometheus-rate-scale", str(self.config.time_scale),
            "--prometheus-min-window", "30s",
            "--reconcile-interval", f"{self.config.reconcile_interval_s}s",
            "--liveness-port", "0",
            "--metrics-port", "0",
        ]  # fmt: skip
        log = (workdir / "operator.log").open("wb")
        self.operator = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.say(f"operator started (pid {self.operator.pid}); log: {workdir / 'operator.log'}")

    def _api(self, method: str, path: str, body: Any = None) -> Any:
        assert self.cluster is not None
        status, answer = self.cluster.request(method, path, body)
        if status == 404:
            return None
        if status >= 400:
            raise RuntimeError(f"{method} {path}: {status} {answer}")
        return answer

    def _apply(self) -> None:
        self._api("POST", POLICY_PATH, DEMO_POLICY)
        self._api("POST", CR_PATH, DEMO_DEPLOYMENT)
        slo = DEMO_POLICY["spec"]["slo"]
        spec = DEMO_DEPLOYMENT["spec"]
        rollout = spec["rollout"]
        self.say(
            f"applied VLLMTuningPolicy demo ({percentile_label('ttft', slo)} <= "
            f"{slo['ttft']['thresholdMs']} ms, {percentile_label('itl', slo)} <= "
            f"{slo['itl']['thresholdMs']} ms) and VLLMDeployment {NAME} ({spec['model']}, "
            f"{spec['replicas']} replicas on simulated H100s, mode Auto; rollouts surge "
            f"{rollout['maxSurge']} pod and drain each pod they stop)"
        )

    # ------------------------------------------------------------------------ traffic

    def _wait_for_pods(self, timeout_s: float = 120.0) -> None:
        """Traffic starts once every replica is an endpoint of the Service, as a client would
        see it (a later one would only take over part of the load)."""
        deadline = time.monotonic() + timeout_s
        replicas = int(DEMO_DEPLOYMENT["spec"].get("replicas", 1))
        while len(self._endpoints()) < replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{replicas} pods of {NAME} did not become ready within {timeout_s:.0f}s"
                )
            if self.operator is not None and self.operator.poll() is not None:
                raise RuntimeError("the operator exited; see operator.log")
            time.sleep(0.5)
        self.say(f"{NAME} is serving: {', '.join(p for p, _ in self._endpoints())}")

    def _start_load(self) -> None:
        from vllm_sim.loadgen import run_http
        from vllm_sim.workload import WorkloadSpec

        cfg = self.config
        horizon_wall = cfg.max_minutes * 60.0
        spec = WorkloadSpec.preset(cfg.workload, cfg.rate, horizon_wall * cfg.time_scale, seed=1)
        assert self.proxy is not None
        url = self.proxy.url

        def main() -> None:
            async def body() -> None:
                self._load_loop = asyncio.get_running_loop()
                self._load_task = asyncio.ensure_future(
                    run_http(
                        url,
                        spec,
                        model=DEMO_DEPLOYMENT["spec"]["model"],
                        time_scale=cfg.time_scale,
                        duration=horizon_wall,
                        timeout=horizon_wall + 120,
                        concurrency=256,
                        on_done=self.traffic.count,
                    )
                )
                try:
                    self.load_result = await self._load_task
                except asyncio.CancelledError:
                    pass
                except Exception as exc:  # shown, not swallowed: the demo is pointless without
                    self.say(f"the load generator failed: {type(exc).__name__}: {exc}")

            asyncio.run(body())

        self._load_thread = threading.Thread(target=main, name="demo-load", daemon=True)
        self._load_thread.start()
        self.say(
            f"sending '{cfg.workload}' traffic: {cfg.rate:g} req/s of simulated time "
            f"({cfg.rate * cfg.time_scale:g} req/s wall) through the Service"
        )

    def _ensure_load(self) -> None:
        """Traffic never stops while the demo keeps running: a new chunk when one ends."""
        if self._load_thread is not None and not self._load_thread.is_alive():
            self._load_thread = None
            self._load_loop = self._load_task = None
            self._start_load()

    def _stop_load(self) -> None:
        if self._load_loop is not None and self._load_task is not None:
            with contextlib.suppress(RuntimeError):
                self._load_loop.call_soon_threadsafe(self._load_task.cancel)
        if self._load_thread is not None:
            self._load_thread.join(30)
            self._load_thread = None

    # ------------------------------------------------------------------------ watching

    def _sample(self) -> dict[str, Any]:
        obj = self._api("GET", f"{CR_PATH}/{NAME}") or {}
        status = dict(obj.get("status") or {})
        self.timeline.samples.append(
            sample_of(status, time.monotonic() - self.started, self.traffic.failed)
        )
        return status

    def _observe(self, print_every_s: float = 10.0) -> dict[str, Any]:
        """Sample the status, print every new decision, and a state line now and then."""
        status = self._sample()
        for action, reason in self.narrator.news(status, self._events()):
            self.timeline.decisions.append((time.monotonic() - self.started, action, reason))
            self.say(f"decision: {action}: {reason}")
        now = time.monotonic()
        if now - self._last_line >= print_every_s:
            self._last_line = now
            self.say(console_line(status, DEMO_POLICY["spec"]["slo"], self.traffic.failed))
        return status

    def _watch(self) -> bool:
        cfg = self.config
        deadline = self.started + cfg.max_minutes * 60.0
        committed_at: float | None = None
        while time.monotonic() < deadline:
            if self.operator is not None and self.operator.poll() is not None:
                self.say(f"the operator exited with code {self.operator.returncode}")
                return False
            status = self._observe()
            tuning = dict(status.get("tuning") or {})
            now = time.monotonic()
            trials = tuning.get("trials") or []
            if committed_at is None and any(t.get("outcome") == "Committed" for t in trials):
                committed_at = now
                self.say("a trial was committed; watching the SLO settle")
            if committed_at is not None and now - committed_at >= cfg.settle_after_commit_s:
                met = _condition(status, "SLOMet").get("status") == "True"
                if met and tuning.get("phase") not in ("RollingOut", "Verifying", "Promoting"):
                    self.timeline.converged_at = now - self.started
                    return True
            time.sleep(2.0)
        self.say("time is up")
        last = self.timeline.samples[-1] if self.timeline.samples else None
        return committed_at is not None and last is not None and last.slo_met == "True"

    # ------------------------------------------------------------------------ report

    def _events(self) -> list[dict[str, Any]]:
        """The Events of the VLLMDeployment (the operator's Kubernetes Events)."""
        found = self._api(
            "GET",
            f"/api/v1/namespaces/{NAMESPACE}/events?fieldSelector=involvedObject.name%3D{NAME}",
        )
        return list((found or {}).get("items") or [])

    def _report(self, converged: bool) -> None:
        from vllm_localcluster.demo_report import console_measures, write_report

        final = self._api("GET", f"{CR_PATH}/{NAME}") or {}
        tuning = dict((final.get("status") or {}).get("tuning") or {})
        for line in console_measures(self.timeline, tuning, self.traffic, self.proxy):
            self.say(line)
        paths = write_report(
            self.config.out,
            self.timeline,
            final,
            self._events(),
            DEMO_POLICY,
            converged,
            self.proxy,
            self.traffic,
        )
        self.say(("converged" if converged else "did NOT converge") + f"; report: {paths[0]}")
        for p in paths[1:]:
            self.say(f"  plot: {p}")


def sample_of(status: Mapping[str, Any], t: float, failed: int) -> Sample:
    """What the timeline keeps of one status."""
    slo = DEMO_POLICY["spec"]["slo"]
    tuning = dict(status.get("tuning") or {})
    observed = dict(status.get("observed") or {})
    analysis = dict(tuning.get("analysis") or {}) if canary_running(tuning) else {}
    return Sample(
        t=t,
        phase=tuning.get("phase"),
        knobs=knob_label(observed.get("knobs")),
        ttft_ms=latency(observed, "ttft", slo),
        itl_ms=latency(observed, "itl", slo),
        kv=observed.get("kvCacheUsage"),
        rate=observed.get("requestRate"),
        slo_met=_condition(status, "SLOMet").get("status"),
        ready=_condition(status, "Ready").get("status"),
        applied=knob_label(tuning.get("applied")),
        failed=failed,
        canary=knob_label(tuning.get("candidate")) if canary_running(tuning) else None,
        canary_itl=(analysis.get("canary") or {}).get("itlMs"),
        baseline_itl=(analysis.get("baseline") or {}).get("itlMs"),
    )


def run_demo(config: DemoConfig, out: TextIO = sys.stdout) -> int:
    demo = Demo(config, out)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        return demo.run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def dump_json(timeline: Timeline) -> str:
    return json.dumps(
        {
            "samples": [s.__dict__ for s in timeline.samples],
            "decisions": timeline.decisions,
            "written": datetime.now(tz=UTC).isoformat(),
        },
        indent=1,
    )


__all__: list[str] = ["DEMO_DEPLOYMENT", "DEMO_POLICY", "DemoConfig", "run_demo"]
