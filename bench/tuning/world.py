"""The live deployment in virtual time: pods, traffic, restarts, crashes and scrapes.

One `World` is one VLLMDeployment as the cluster would run it: `replicas` pods, each one
simulated vLLM engine with the scenario's hidden reality, behind a Service that spreads
requests at random over the ready pods. Traffic keeps arriving whatever happens; a request
that finds no ready pod, or is in flight when its pod is replaced or crashes, fails and is
counted. Changing the knobs (`apply`) replaces pods as a Deployment with maxSurge 0 and
maxUnavailable 1 would on full GPU nodes: one pod at a time, each restart costing the model
loading time. A run-time OOM (`EngineCrashed`) or a failed start puts the pod into restart
back-off (10 s doubling to 5 min, shown as CrashLoopBackOff) and it loads again afterwards.

Every `scrape_s` the ready pods' metrics are sampled into a `TSDB` with vLLM's names and
labels, which is all a tuner reads. Each engine keeps its own clock starting at its pod's
start (so a run-time OOM hazard counts from the start of the pod, as on a GPU); arrivals and
records are shifted between the two clocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from bench.tuning.promsim import TSDB, Evaluator
from bench.tuning.scenario import Scenario
from bench.tuning.truth import engine_config
from vllm_autotuner.core.snapshot import fraction_below, histogram_quantile
from vllm_autotuner.core.tuning_types import Knobs, PodHealth
from vllm_sim.engine import Engine
from vllm_sim.metrics import Histogram
from vllm_sim.types import EngineCrashed, Request, RequestRecord, StartupError

NAMESPACE = "bench"
BACKOFF_START_S = 10.0
BACKOFF_MAX_S = 300.0
# A minute counts as violated when more than this share of its arrivals failed outright.
FAILED_SHARE_VIOLATION = 0.01

PodPhase = Literal["loading", "ready", "backoff"]


def revision(knobs: Knobs) -> str:
    return (
        f"t{knobs.max_num_batched_tokens}-s{knobs.max_num_seqs}-"
        f"g{round(knobs.gpu_memory_utilization * 100)}"
    )


@dataclass
class Pod:
    slot: int
    knobs: Knobs
    name: str
    phase: PodPhase
    phase_until: float
    engine: Engine | None = None
    t0: float = 0.0  # world time of the engine's clock zero
    ready_since: float | None = None
    restarts: int = 0
    last_termination: str | None = None
    in_flight: set[str] = field(default_factory=set)


@dataclass
class Accounting:
    """Per-minute counts of what the users saw (ground truth, not Prometheus)."""

    minutes: int
    arrivals: np.ndarray = field(init=False)
    failed: np.ndarray = field(init=False)
    good: np.ndarray = field(init=False)
    finished: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.arrivals = np.zeros(self.minutes + 1)
        self.failed = np.zeros(self.minutes + 1)
        self.good = np.zeros(self.minutes + 1)
        self.finished = np.zeros(self.minutes + 1)

    def at(self, t: float) -> int:
        return min(self.minutes, max(0, int(t // 60)))


class World:
    def __init__(
        self,
        scenario: Scenario,
        knobs: Knobs,
        horizon_s: float | None = None,
        scrape_s: float = 15.0,
        seed: int | None = None,
    ) -> None:
        self.s = scenario
        self.horizon = float(horizon_s if horizon_s is not None else scenario.horizon_s)
        self.scrape_s = scrape_s
        self.seed = scenario.seed if seed is None else seed
        self.desired = knobs
        self.t = 0.0
        self.db = TSDB()
        self.requests: list[Request] = scenario.deployment_workload(self.horizon).generate()
        self._next = 0
        self._rng = np.random.default_rng(self.seed + 17)
        self._seeds = 1000 * self.seed
        self.acc = Accounting(math.ceil(self.horizon / 60.0))
        self.crashes = 0  # engine deaths at run time or at start
        self.replacements = 0  # pods replaced by rollouts
        self.events: list[tuple[float, str]] = []
        self.knob_timeline: list[tuple[float, Knobs]] = [(0.0, knobs)]
        slo = scenario.slo
        self._ttft = None if slo.ttft is None else slo.ttft.threshold_ms / 1000.0
        self._itl = None if slo.itl is None else slo.itl.threshold_ms / 1000.0
        self._e2e = None if slo.e2e is None else slo.e2e.threshold_ms / 1000.0
        self.pods = [self._new_pod(i, knobs, 0.0, ready=True) for i in range(scenario.replicas)]

    # ------------------------------------------------------------------------- pods

    def _new_pod(self, slot: int, knobs: Knobs, t: float, ready: bool = False) -> Pod:
        self._seeds += 1
        pod = Pod(
            slot=slot,
            knobs=knobs,
            name=f"vllm-{revision(knobs)}-{self._seeds % 100000:05d}",
            phase="loading",
            phase_until=t + (0.0 if ready else self.s.load_time_s),
        )
        if ready:
            self._start_engine(pod, t)
        return pod

    def _start_engine(self, pod: Pod, t: float) -> None:
        self._seeds += 1
        try:
            pod.engine = Engine(
                engine_config(self.s, pod.knobs), self.s.reality, seed=self._seeds, record_itl=False
            )
        except (StartupError, ValueError) as exc:
            self._crash(pod, t, f"failed to start: {exc}")
            return
        pod.t0 = t
        pod.phase = "ready"
        pod.ready_since = t

    def _lose_in_flight(self, pod: Pod, t: float) -> None:
        if pod.in_flight:
            self.acc.failed[self.acc.at(t)] += len(pod.in_flight)
            pod.in_flight.clear()
        pod.engine = None

    def _crash(self, pod: Pod, t: float, why: str) -> None:
        self.crashes += 1
        self._lose_in_flight(pod, t)
        backoff = min(BACKOFF_MAX_S, BACKOFF_START_S * 2.0**pod.restarts)
        pod.restarts += 1
        pod.phase = "backoff"
        pod.phase_until = t + backoff
        pod.ready_since = None
        pod.last_termination = "Error"
        self.events.append((t, f"{pod.name} crashed ({why[:60]}); back-off {backoff:.0f}s"))

    def _lifecycle(self, t: float) -> None:
        for pod in self.pods:
            if pod.phase == "backoff" and t >= pod.phase_until:
                pod.phase = "loading"
                pod.phase_until = t + self.s.load_time_s
            if pod.phase == "loading" and t >= pod.phase_until:
                self._start_engine(pod, t)
        stale = [p for p in self.pods if not p.knobs.same_as(self.desired)]
        if not stale:
            return
        # Unavailable old pods go first (their loss costs nothing); a ready one only when
        # every pod is available (maxUnavailable 1, maxSurge 0).
        down = [p for p in stale if p.phase != "ready"]
        victims = down or ([stale[0]] if all(p.phase == "ready" for p in self.pods) else [])
        for old in victims:
            self._lose_in_flight(old, t)
            self.replacements += 1
            self.pods[self.pods.index(old)] = self._new_pod(old.slot, self.desired, t)

    # ------------------------------------------------------------------------- public

    def apply(self, knobs: Knobs) -> None:
        """Change the Deployment's knobs; pods are replaced from the next step on."""
        if not knobs.same_as(self.desired):
            self.desired = knobs
            self.knob_timeline.append((self.t, knobs))
            self.events.append((self.t, f"apply {knobs.describe()}"))

    def pod_health(self) -> tuple[PodHealth, ...]:
        out = []
        for p in self.pods:
            waiting = "CrashLoopBackOff" if p.phase == "backoff" else None
            if p.phase == "loading":
                waiting = None
            out.append(
                PodHealth(
                    ready=p.phase == "ready",
                    restarts=p.restarts,
                    waiting_reason=waiting,
                    last_termination_reason=p.last_termination,
                    revision_knobs=p.knobs,
                    name=p.name,
                )
            )
        return tuple(out)

    def ready_pods(self, knobs: Knobs) -> tuple[list[str], float | None]:
        """Names of ready pods running `knobs`, and when the last of them became ready."""
        pods = [p for p in self.pods if p.phase == "ready" and p.knobs.same_as(knobs)]
        since = max((p.ready_since or 0.0 for p in pods), default=None)
        return sorted(p.name for p in pods), since

    def advance_to(self, t_end: float) -> None:
        t_end = min(t_end, self.horizon)
        while self.t < t_end - 1e-9:
            self._step(min(self.t + self.scrape_s, t_end))

    # ------------------------------------------------------------------------- stepping

    def _step(self, t1: float) -> None:
        t0 = self.t
        self._lifecycle(t0)
        ready = [p for p in self.pods if p.phase == "ready" and p.engine is not None]
        reqs = self.requests
        while self._next < len(reqs) and reqs[self._next].arrival_time < t1:
            r = reqs[self._next]
            self._next += 1
            self.acc.arrivals[self.acc.at(r.arrival_time)] += 1
            if not ready:
                self.acc.failed[self.acc.at(r.arrival_time)] += 1
                continue
            pod = ready[int(self._rng.integers(len(ready)))]
            assert pod.engine is not None
            local = Request(
                r.request_id,
                r.prompt_len,
                r.max_tokens,
                r.arrival_time - pod.t0,
                r.prefix_id,
                r.prefix_len,
            )
            try:
                pod.engine.add_request(local)
            except ValueError:  # rejected (HTTP 400), e.g. a prompt over max_model_len
                self.acc.failed[self.acc.at(r.arrival_time)] += 1
                continue
            pod.in_flight.add(r.request_id)
        for pod in ready:
            engine = pod.engine
            assert engine is not None
            try:
                engine.run_until(t1 - pod.t0)
            except EngineCrashed:
                self._collect(pod)
                self._crash(pod, pod.t0 + engine.now, "run-time OOM")
                continue
            self._collect(pod)
        self.t = t1
        for pod in self.pods:
            if pod.phase == "ready" and pod.engine is not None:
                self._scrape(pod, t1)

    def _collect(self, pod: Pod) -> None:
        assert pod.engine is not None
        for rec in pod.engine.pop_finished():
            pod.in_flight.discard(rec.request_id)
            self._account(rec, pod.t0)

    def _account(self, rec: RequestRecord, t0: float) -> None:
        minute = self.acc.at(rec.arrival_time + t0)
        if rec.finish_reason in ("abort", "error"):
            self.acc.failed[minute] += 1
            return
        self.acc.finished[minute] += 1
        ttft = rec.ttft
        good = (
            (self._ttft is None or (ttft is not None and ttft <= self._ttft))
            and (self._itl is None or rec.tpot <= self._itl)
            and (self._e2e is None or rec.e2e <= self._e2e)
        )
        if good:
            self.acc.good[minute] += 1

    def _scrape(self, pod: Pod, t: float) -> None:
        engine = pod.engine
        assert engine is not None
        m = engine.metrics
        m.flush()
        base = {
            "namespace": NAMESPACE,
            "pod": pod.name,
            "model_name": self.s.model,
            "engine": "0",
            "job": "vllm",
        }
        db = self.db
        for c in (
            m.request_success,
            m.num_preemptions,
            m.prefix_cache_queries,
            m.prefix_cache_hits,
        ):
            for label, v in c.values.items():
                labels = {**base, "__name__": c.name + "_total"}
                if c.extra_label:
                    labels[c.extra_label] = label
                db.append(labels, t, v)
        hists: tuple[Histogram, ...] = (
            m.ttft, m.itl, m.e2e, m.queue, m.prefill, m.prompt_tokens_h, m.generation_tokens_h,
            m.iteration_tokens,
        )  # fmt: skip
        for h in hists:
            for bound, cum in h.bucket_counts():
                le = "+Inf" if math.isinf(bound) else repr(float(bound))
                db.append({**base, "__name__": h.name + "_bucket", "le": le}, t, float(cum))
            db.append({**base, "__name__": h.name + "_sum"}, t, h.sum)
        if m.gauge_provider is not None:
            running, waiting, usage = m.gauge_provider()
            db.append({**base, "__name__": "vllm:num_requests_running"}, t, float(running))
            db.append({**base, "__name__": "vllm:num_requests_waiting"}, t, float(waiting))
            db.append({**base, "__name__": "vllm:kv_cache_usage_perc"}, t, float(usage))
        info = {k: v for k, v in m.cache_config_labels}
        info.update(namespace=NAMESPACE, pod=pod.name, engine="0", job="vllm")
        db.append({**info, "__name__": "vllm:cache_config_info"}, t, 1.0)

    # ------------------------------------------------------------------------- results

    def minute_view(self) -> MinuteView:
        """What Prometheus showed for each minute: SLO percentiles and attainment."""
        ev = Evaluator(self.db)
        n = self.acc.minutes
        violated = np.zeros(n, dtype=bool)
        attainment = np.full(n, np.nan)
        for i in range(n):
            t = (i + 1) * 60.0
            if t > self.horizon + 1e-9:
                break
            worst_att = 1.0
            bad = False
            seen = False
            for metric, target in self.s.slo.targets():
                name = {
                    "ttft": "vllm:time_to_first_token_seconds",
                    "itl": "vllm:inter_token_latency_seconds",
                    "e2e": "vllm:e2e_request_latency_seconds",
                }[metric]
                vec = ev.query(f"sum by (le) (increase({name}_bucket[60s]))", t)
                buckets = sorted((float(lab["le"]), v) for lab, v in vec)
                # Monotone, as histogram_quantile makes it.
                running = 0.0
                mono = []
                for b, v in buckets:
                    running = max(running, v)
                    mono.append((b, running))
                q = histogram_quantile(target.percentile / 100.0, mono)
                if q is None:
                    continue
                seen = True
                if q * 1000.0 > target.threshold_ms:
                    bad = True
                f = fraction_below(target.threshold_ms / 1000.0, mono)
                if f is not None:
                    worst_att = min(worst_att, f)
            arrivals = self.acc.arrivals[i]
            failed_share = self.acc.failed[i] / arrivals if arrivals > 0 else 0.0
            if failed_share > FAILED_SHARE_VIOLATION:
                bad = True
            violated[i] = bad
            attainment[i] = worst_att if seen else (0.0 if arrivals > 0 else np.nan)
        return MinuteView(violated, attainment)

    def goodput(self) -> float:
        return float(self.acc.good.sum()) / self.horizon

    def failed(self) -> int:
        return int(self.acc.failed.sum())

    def crash_left_standing(self) -> bool:
        """A pod of the final configuration is down for a crash at the end of the run."""
        return any(p.phase == "backoff" or p.restarts > 0 for p in self.pods)


@dataclass(frozen=True)
class MinuteView:
    violated: np.ndarray
    attainment: np.ndarray
