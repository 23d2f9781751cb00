"""The live deployment in virtual time: Deployments, pods, GPUs, drains, traffic and scrapes.

One `World` is one VLLMDeployment as a Kubernetes cluster would run it:

- **Deployments.** A stable Deployment and, while the tuner runs a canary, a canary Deployment
  of one pod (`apply_topology`, from the operator's own `core.topology`). Pods carry their
  track and knobs; canary pods are named `vllm-canary-...`. A Service spreads requests at
  random over the ready, non-terminating pods of both.
- **Rolling updates** as the Deployment controller does them: maxSurge = the topology's
  `max_surge`, maxUnavailable = 0 with surge and 1 without; old pods that are not ready go
  first. Terminating pods do not count against the surge, but GPUs are finite: the cluster has
  `replicas + rollout.max_surge` of them, and a pod holds its GPU from the start of its loading
  until it has drained. A new pod without a free GPU stays Pending, so with surge 0 the
  replacement starts loading only once the old pod has terminated.
- **Drain on every termination** (rollout or scale-down): the pod leaves routing at once
  (endpoint removal), runs the pre-stop delay, then vLLM's `--shutdown-timeout`: the engine
  keeps stepping its in-flight requests, without new arrivals, until they are done or until
  `pre_stop_s + shutdown_timeout_s` after the termination began; the rest is aborted. The pod
  ends when its last request finishes (not before its pre-stop delay). Timeout 0 and pre-stop
  0 is vLLM's default: abort at once.
- **Crashes.** A run-time OOM (`EngineCrashed`) or a failed start puts the pod into restart
  back-off (10 s doubling to 5 min, shown as CrashLoopBackOff); it keeps its GPU and loads again.

Accounting per minute (ground truth, not Prometheus): arrivals, good requests (their own TTFT,
mean ITL and E2E meet the thresholds), failures, and the failures' causes: *tuning* (aborted by
a rollout's drain or scale-down, or no ready pod while a rollout or scale-down is in progress),
*crash* (in flight at an engine death, or no ready pod with no rollout in progress) and
*rejected* (HTTP 400, or given up by the engine). Every latency observation the engines make
(TTFT per request, ITL per token, E2E per request: what vLLM's histograms receive) is also
compared, exactly, with its threshold, in the minute Prometheus sees it in; that gives
violation minutes from exact latencies next to the ones `histogram_quantile` shows.
Requests still unfinished at the horizon are neither good nor failed (`unfinished`); those
that had already missed the TTFT threshold are counted apart, as are requests a drain aborted
after they had missed it (`failed_tuning_late`): a restart that aborts a queue and a queue left
to the horizon then read alike.

**A replica autoscaler** (`autoscaler`, bench/tuning/autoscaler.py) may own the replica count:
every `sync_s` it reads the TSDB and writes `replica_target` (the VLLMDeployment's
spec.replicas); `render` (the operator's topology for that count, by default the stable knobs on
that many pods) turns it into the Deployments at once, as the operator's watch would. The
cluster then has `max_replicas + max_surge` GPUs; `gpu_seconds` integrates the GPUs held
(pods loading, serving, draining or backing off): the replica-minutes an autoscaler costs.

Every `scrape_s` the running pods' metrics (draining ones included, as a PodMonitor scrapes
them) are sampled into a `TSDB` with vLLM's names and labels, which is all a tuner reads. Each
engine keeps its own clock starting at its pod's start (so a run-time OOM hazard counts from the
start of the pod, as on a GPU); arrivals and records are shifted between the two clocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from bench.tuning.autoscaler import HPA
from bench.tuning.promsim import TSDB, Evaluator
from bench.tuning.scenario import Scenario
from bench.tuning.truth import engine_config
from vllm_autotuner.core.snapshot import fraction_below, histogram_quantile
from vllm_autotuner.core.topology import Topology
from vllm_autotuner.core.tuning_types import Knobs, PodHealth
from vllm_sim.engine import Engine
from vllm_sim.metrics import Histogram
from vllm_sim.types import EngineCrashed, Request, RequestRecord, StartupError

NAMESPACE = "bench"
BACKOFF_START_S = 10.0
BACKOFF_MAX_S = 300.0
# A minute counts as violated when more than this share of its arrivals failed outright.
FAILED_SHARE_VIOLATION = 0.01
EPS = 1e-9

PodPhase = Literal["pending", "loading", "ready", "backoff", "terminating", "gone"]
Track = Literal["stable", "canary"]
Cause = Literal["tuning", "crash", "rejected"]
METRICS = ("ttft", "itl", "e2e")
# Which pods go first when a Deployment removes some (as the ReplicaSet controller ranks them:
# unscheduled, then not ready, then the most recently ready).
_DOOM_ORDER = {"pending": 0, "loading": 1, "backoff": 2, "ready": 3}


def revision(knobs: Knobs) -> str:
    return (
        f"t{knobs.max_num_batched_tokens}-s{knobs.max_num_seqs}-"
        f"g{round(knobs.gpu_memory_utilization * 100)}"
    )


@dataclass
class Pod:
    slot: int  # creation order (unique)
    track: Track
    knobs: Knobs
    name: str
    phase: PodPhase
    created: float
    phase_until: float = math.inf  # loading: ready at; backoff: loads again at
    engine: Engine | None = None
    t0: float = 0.0  # world time of the engine's clock zero
    ready_since: float | None = None
    restarts: int = 0
    last_termination: str | None = None
    in_flight: set[str] = field(default_factory=set)
    gpu: bool = False  # holds a GPU (loading, ready, backoff, or draining)
    # Termination: when it began, when SIGTERM follows the pre-stop delay, the drain deadline.
    terminating_since: float | None = None
    sigterm_at: float = math.inf
    drain_deadline: float = math.inf
    last_finish: float = 0.0  # world time of the last finished request
    loading_since: float | None = None  # when it got its GPU and started loading
    ended_at: float | None = None  # when it was gone (drained, aborted or never started)
    # Routing history, for per-pod arrival rates: [routable_since, routable_until).
    routable_since: float | None = None
    routable_until: float | None = None
    arrivals: list[float] = field(default_factory=list)


@dataclass
class Deployment:
    track: Track
    knobs: Knobs
    replicas: int
    max_surge: int = 0
    # A rollout or scale is under way (the Deployment's Progressing condition, not yet done).
    progressing: bool = False


@dataclass
class Accounting:
    """Per-minute counts of what the users saw (ground truth, not Prometheus)."""

    minutes: int
    arrivals: np.ndarray = field(init=False)
    failed: np.ndarray = field(init=False)
    failed_tuning: np.ndarray = field(init=False)
    failed_crash: np.ndarray = field(init=False)
    failed_rejected: np.ndarray = field(init=False)
    failed_tuning_late: np.ndarray = field(init=False)  # aborted after missing the TTFT SLO
    good: np.ndarray = field(init=False)
    finished: np.ndarray = field(init=False)
    # Exact SLO observations per minute and metric: how many, how many above the threshold.
    observed: dict[str, np.ndarray] = field(init=False)
    over: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        n = self.minutes + 1
        for name in ("arrivals", "failed", "failed_tuning", "failed_crash", "failed_rejected",
                     "failed_tuning_late", "good", "finished"):  # fmt: skip
            setattr(self, name, np.zeros(n))
        self.observed = {m: np.zeros(n) for m in METRICS}
        self.over = {m: np.zeros(n) for m in METRICS}

    def at(self, t: float) -> int:
        return min(self.minutes, max(0, int(t // 60)))

    def fail(self, t: float, cause: Cause, n: int = 1) -> None:
        if n <= 0:
            return
        i = self.at(t)
        self.failed[i] += n
        {"tuning": self.failed_tuning, "crash": self.failed_crash,
         "rejected": self.failed_rejected}[cause][i] += n  # fmt: skip

    def observe(self, metric: str, t: float, n: int, over: int) -> None:
        i = self.at(t)
        self.observed[metric][i] += n
        self.over[metric][i] += over


class ExactCount(Histogram):
    """An engine's latency histogram that also counts, exactly, how many of its observations
    were above one threshold (no buckets): every observation vLLM's histogram gets, the same
    instant, compared with the raw value. Every path into the histogram ends in `observe`,
    `observe_repeated` or `add_values`. The world reads and resets the counts every step."""

    def __init__(self, inner: Histogram, limit: float) -> None:
        super().__init__(inner.name, inner.help, inner.bound_list)
        self.limit = limit
        self.n = 0
        self.n_over = 0

    def observe(self, value: float) -> None:
        super().observe(value)
        self.n += 1
        self.n_over += int(value > self.limit)

    def observe_repeated(self, value: float, n: int) -> None:
        super().observe_repeated(value, n)
        if n > 0:
            self.n += n
            self.n_over += n if value > self.limit else 0

    def add_values(self, values: np.ndarray, weight: int = 1) -> None:
        super().add_values(values, weight)
        self.n += int(values.size) * weight
        self.n_over += int(np.count_nonzero(values > self.limit)) * weight

    def take(self) -> tuple[int, int]:
        out = (self.n, self.n_over)
        self.n = self.n_over = 0
        return out


class World:
    def __init__(
        self,
        scenario: Scenario,
        knobs: Knobs,
        horizon_s: float | None = None,
        scrape_s: float = 15.0,
        seed: int | None = None,
        autoscaler: HPA | None = None,
    ) -> None:
        self.s = scenario
        self.rollout = scenario.rollout
        self.horizon = float(horizon_s if horizon_s is not None else scenario.horizon_s)
        self.scrape_s = scrape_s
        self.seed = scenario.seed if seed is None else seed
        self.autoscaler = autoscaler
        most = max(scenario.replicas, autoscaler.spec.max_replicas if autoscaler else 0)
        self.gpus = most + scenario.rollout.max_surge
        self.replica_target = scenario.replicas
        self.replica_timeline: list[tuple[float, int]] = [(0.0, scenario.replicas)]
        self.render: Callable[[int], Topology] = lambda n: Topology(
            self.desired, n, None, self.rollout.max_surge
        )
        self.gpu_seconds = 0.0
        self.t = 0.0
        self.db = TSDB()
        self.requests: list[Request] = scenario.deployment_workload(self.horizon).generate()
        self._next = 0
        self._rng = np.random.default_rng(self.seed + 17)
        self._seeds = 1000 * self.seed
        self._slots = 0
        self.acc = Accounting(math.ceil(self.horizon / 60.0))
        self.crashes = 0  # engine deaths at run time or at start
        self.replacements = 0  # pods terminated by rollouts and scale-downs
        self.events: list[tuple[float, str]] = []
        self.knob_timeline: list[tuple[float, Knobs]] = [(0.0, knobs)]
        first = Topology(knobs, scenario.replicas, None, scenario.rollout.max_surge)
        self.topology_timeline: list[tuple[float, Topology]] = [(0.0, first)]
        self.deployments: dict[Track, Deployment] = {
            "stable": Deployment("stable", knobs, scenario.replicas, first.max_surge),
            "canary": Deployment("canary", knobs, 0, first.max_surge),
        }
        slo = scenario.slo
        self._limit = {
            m: (None if t is None else t.threshold_ms / 1000.0)
            for m, t in (("ttft", slo.ttft), ("itl", slo.itl), ("e2e", slo.e2e))
        }
        self.pods: list[Pod] = []  # every pod not yet gone (terminating ones included)
        self.all_pods: dict[str, Pod] = {}
        for _ in range(scenario.replicas):
            pod = self._create(self.deployments["stable"], 0.0)
            pod.gpu = True
            self._start_engine(pod, 0.0)

    @property
    def desired(self) -> Knobs:
        """The stable Deployment's knobs."""
        return self.deployments["stable"].knobs

    # ------------------------------------------------------------------------- public

    def apply_topology(self, topo: Topology) -> None:
        """Set both Deployments; the cluster acts on it from the next step on."""
        canary = self.deployments["canary"]
        wanted = (
            (self.deployments["stable"], topo.stable, topo.stable_replicas),
            (canary, topo.canary or canary.knobs, topo.canary_replicas),
        )
        changed = False
        for dep, knobs, replicas in wanted:
            dep.max_surge = max(0, topo.max_surge)
            if dep.knobs.same_as(knobs) and dep.replicas == replicas:
                continue
            if not dep.knobs.same_as(knobs) and dep.track == "stable":
                self.knob_timeline.append((self.t, knobs))
            dep.knobs, dep.replicas, dep.progressing = knobs, replicas, True
            changed = True
        if changed:
            self.topology_timeline.append((self.t, topo))
            what = f"stable {topo.stable.describe()} x{topo.stable_replicas}"
            if topo.canary is not None:
                what += f", canary {topo.canary.describe()} x1"
            self.events.append((self.t, f"apply {what} (surge {topo.max_surge})"))

    def apply(self, knobs: Knobs) -> None:
        """One Deployment of `replicas` pods on `knobs` (no canary)."""
        self.apply_topology(Topology(knobs, self.replica_target, None, self.rollout.max_surge))

    def pod_health(self) -> tuple[PodHealth, ...]:
        """Every pod that exists, as the Kubernetes adapter would list it (terminating and
        pending pods included, not ready)."""
        return tuple(
            PodHealth(
                ready=p.phase == "ready",
                restarts=p.restarts,
                waiting_reason="CrashLoopBackOff" if p.phase == "backoff" else None,
                last_termination_reason=p.last_termination,
                revision_knobs=p.knobs,
                name=p.name,
            )
            for p in self.pods
        )

    def ready_pods(
        self, knobs: Knobs, track: Track | None = None
    ) -> tuple[list[str], float | None]:
        """Names of ready pods running `knobs` (of `track`, if given), and when the last of
        them became ready."""
        pods = [
            p
            for p in self.pods
            if p.phase == "ready" and p.knobs.same_as(knobs) and (track is None or p.track == track)
        ]
        since = max((p.ready_since or 0.0 for p in pods), default=None)
        return sorted(p.name for p in pods), since

    def arrival_rate(self, names: list[str] | tuple[str, ...], start: float, end: float) -> float:
        """Requests per second per pod that the Service sent to these pods in [start, end)."""
        count, exposure = 0, 0.0
        for name in names:
            pod = self.all_pods.get(name)
            if pod is None or pod.routable_since is None:
                continue
            lo = max(start, pod.routable_since)
            hi = min(end, pod.routable_until if pod.routable_until is not None else end)
            if hi <= lo:
                continue
            exposure += hi - lo
            a = np.asarray(pod.arrivals)
            count += int(np.count_nonzero((a >= lo) & (a < hi)))
        return count / exposure if exposure > 0 else 0.0

    def rollout_in_progress(self) -> bool:
        return any(d.progressing for d in self.deployments.values())

    def advance_to(self, t_end: float) -> None:
        t_end = min(t_end, self.horizon)
        while self.t < t_end - EPS:
            self._reconcile(self.t)
            nxt = math.floor(self.t / self.scrape_s + EPS) * self.scrape_s + self.scrape_s
            self._step(min(nxt, t_end, self._next_event()))
            self._autoscale()

    def _autoscale(self) -> None:
        """The autoscaler's sync, on its grid: a new count is rendered at once."""
        hpa = self.autoscaler
        if hpa is None or abs(self.t / hpa.spec.sync_s - round(self.t / hpa.spec.sync_s)) > 1e-6:
            return
        n = hpa.sync(self, self.t)
        if n == self.replica_target:
            return
        self.events.append((self.t, f"autoscaler ({hpa.signal}): {self.replica_target} -> {n}"))
        self.replica_target = n
        self.replica_timeline.append((self.t, n))
        self.apply_topology(self.render(n))

    # ------------------------------------------------------------------------- pods

    def _create(self, dep: Deployment, t: float) -> Pod:
        self._seeds += 1
        self._slots += 1
        infix = "canary-" if dep.track == "canary" else ""
        pod = Pod(
            slot=self._slots,
            track=dep.track,
            knobs=dep.knobs,
            name=f"vllm-{infix}{revision(dep.knobs)}-{self._seeds % 100000:05d}",
            phase="pending",
            created=t,
        )
        self.pods.append(pod)
        self.all_pods[pod.name] = pod
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
        metrics = pod.engine.metrics
        for metric, limit in self._limit.items():
            if limit is not None:
                setattr(metrics, metric, ExactCount(getattr(metrics, metric), limit))
        pod.t0 = t
        pod.phase = "ready"
        pod.ready_since = t
        pod.routable_since = t
        pod.routable_until = None

    def _unroute(self, pod: Pod, t: float) -> None:
        if pod.routable_since is not None and pod.routable_until is None:
            pod.routable_until = t

    def _lose_in_flight(self, pod: Pod, t: float, cause: Cause) -> None:
        self.acc.fail(t, cause, len(pod.in_flight))
        if cause == "tuning":
            self.acc.failed_tuning_late[self.acc.at(t)] += self.late_requests(pod, t)
        pod.in_flight.clear()
        pod.engine = None

    def _crash(self, pod: Pod, t: float, why: str) -> None:
        self.crashes += 1
        self._unroute(pod, t)
        if pod.engine is not None:
            self._collect(pod)
        self._lose_in_flight(pod, t, "crash")
        if pod.phase == "terminating":  # it was going away anyway
            self._gone(pod, t)
            return
        backoff = min(BACKOFF_MAX_S, BACKOFF_START_S * 2.0**pod.restarts)
        pod.restarts += 1
        pod.phase = "backoff"
        pod.phase_until = t + backoff
        pod.ready_since = None
        pod.last_termination = "Error"
        self.events.append((t, f"{pod.name} crashed ({why[:60]}); back-off {backoff:.0f}s"))

    def _terminate(self, pod: Pod, t: float) -> None:
        """The Deployment deletes the pod: it drains (see the module docstring)."""
        self.replacements += 1
        self._unroute(pod, t)
        if pod.phase in ("pending", "backoff"):  # no process to drain
            self._gone(pod, t)
            return
        was_loading = pod.phase == "loading"
        pod.phase = "terminating"
        pod.terminating_since = t
        pod.sigterm_at = t + self.rollout.pre_stop_s
        pod.drain_deadline = (
            pod.sigterm_at if was_loading else pod.sigterm_at + self.rollout.shutdown_timeout_s
        )
        self._drain_check(pod, t)

    def _drain_check(self, pod: Pod, t: float) -> None:
        """End a drain that is complete at `t`, or abort what is left at its deadline."""
        if pod.phase != "terminating":
            return
        if pod.engine is not None:
            self._collect(pod)
        if pod.engine is not None and not pod.in_flight and t >= pod.sigterm_at - EPS:
            done = max(pod.sigterm_at, min(pod.last_finish, t, pod.drain_deadline))
            self._gone(pod, done)
        elif t >= pod.drain_deadline - EPS:
            self._lose_in_flight(pod, t, "tuning")
            self._gone(pod, pod.drain_deadline)

    def _gone(self, pod: Pod, t: float) -> None:
        pod.phase = "gone"
        pod.ended_at = t
        pod.engine = None
        pod.in_flight.clear()
        self.pods.remove(pod)
        if pod.gpu:
            pod.gpu = False
            self._schedule(t)

    def _schedule(self, t: float) -> None:
        """Give free GPUs to Pending pods, oldest first; they start loading at `t`."""
        free = self.gpus - sum(1 for p in self.pods if p.gpu)
        for pod in sorted((p for p in self.pods if p.phase == "pending"), key=lambda p: p.slot):
            if free <= 0:
                return
            free -= 1
            pod.gpu = True
            pod.phase = "loading"
            pod.loading_since = t
            pod.phase_until = t + self.s.load_time_s

    # ------------------------------------------------------------------------- controllers

    def _reconcile(self, t: float) -> None:
        for pod in list(self.pods):
            if pod.phase == "backoff" and t >= pod.phase_until - EPS:
                pod.phase = "loading"
                pod.phase_until = t + self.s.load_time_s
            if pod.phase == "loading" and t >= pod.phase_until - EPS:
                self._start_engine(pod, t)
            self._drain_check(pod, t)
        for _ in range(4):  # the controllers react within the same instant until stable
            before = [(p.name, p.phase) for p in self.pods]
            for dep in self.deployments.values():
                self._control(dep, t)
            self._schedule(t)
            if before == [(p.name, p.phase) for p in self.pods]:
                break
        for dep in self.deployments.values():
            if dep.progressing and self._complete(dep):
                dep.progressing = False

    def _complete(self, dep: Deployment) -> bool:
        mine = [p for p in self.pods if p.track == dep.track]
        return len(mine) == dep.replicas and all(
            p.phase == "ready" and p.knobs.same_as(dep.knobs) for p in mine
        )

    def _control(self, dep: Deployment, t: float) -> None:
        """One sync of the Deployment controller (rolling update, or scale)."""
        live = [p for p in self.pods if p.track == dep.track and p.phase != "terminating"]
        new = [p for p in live if p.knobs.same_as(dep.knobs)]
        old = [p for p in live if not p.knobs.same_as(dep.knobs)]
        r = dep.replicas
        if not old or r == 0:
            excess = (live if r == 0 else _doomed_first(new))[: max(0, len(live) - r)]
            for pod in excess:
                self._terminate(pod, t)
            for _ in range(r - len(live)):
                self._create(dep, t)
            return
        unavailable = 0 if dep.max_surge > 0 else 1
        for _ in range(max(0, min(r + dep.max_surge - len(live), r - len(new)))):
            new.append(self._create(dep, t))
        live = old + new
        min_available = r - unavailable
        budget = len(live) - min_available - sum(1 for p in new if p.phase != "ready")
        for pod in _doomed_first([p for p in old if p.phase != "ready"]):
            if budget <= 0:
                return
            self._terminate(pod, t)
            live.remove(pod)
            budget -= 1
        ready = sum(1 for p in live if p.phase == "ready")
        can = min(budget, ready - min_available)
        for pod in _doomed_first([p for p in old if p.phase == "ready"])[: max(0, can)]:
            self._terminate(pod, t)

    def _next_event(self) -> float:
        times = [math.inf]
        for p in self.pods:
            if p.phase in ("loading", "backoff"):
                times.append(p.phase_until)
            elif p.phase == "terminating":
                times += [x for x in (p.sigterm_at, p.drain_deadline) if x > self.t + EPS]
        return max(min(times), self.t + EPS)

    # ------------------------------------------------------------------------- stepping

    def _step(self, t1: float) -> None:
        t0 = self.t
        self.gpu_seconds += (t1 - t0) * sum(1 for p in self.pods if p.gpu)
        ready = [p for p in self.pods if p.phase == "ready" and p.engine is not None]
        self._route(t1, ready)
        for pod in [p for p in self.pods if p.engine is not None]:
            engine = pod.engine
            assert engine is not None
            try:
                engine.run_until(t1 - pod.t0)
            except EngineCrashed:
                self._exact(engine, t0)
                self._crash(pod, pod.t0 + engine.now, "run-time OOM")
                continue
            self._exact(engine, t0)
            self._collect(pod)
        for pod in [p for p in self.pods if p.phase == "terminating"]:
            self._drain_check(pod, t1)
        self.t = t1
        if abs(t1 / self.scrape_s - round(t1 / self.scrape_s)) < 1e-6 and t1 > t0:
            for pod in self.pods:
                if pod.engine is not None:
                    self._scrape(pod, t1)

    def _route(self, t1: float, ready: list[Pod]) -> None:
        reqs = self.requests
        while self._next < len(reqs) and reqs[self._next].arrival_time < t1:
            r = reqs[self._next]
            self._next += 1
            self.acc.arrivals[self.acc.at(r.arrival_time)] += 1
            if not ready:
                cause: Cause = "tuning" if self.rollout_in_progress() else "crash"
                self.acc.fail(r.arrival_time, cause)
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
                self.acc.fail(r.arrival_time, "rejected")
                continue
            pod.arrivals.append(r.arrival_time)
            pod.in_flight.add(r.request_id)

    def _exact(self, engine: Engine, t0: float) -> None:
        """The step's exact SLO observations, in the minute Prometheus sees them in (a step
        never crosses the scrape grid, and minutes are on it)."""
        engine.metrics.flush()
        for metric, limit in self._limit.items():
            hist = getattr(engine.metrics, metric)
            if limit is not None and isinstance(hist, ExactCount):
                n, over = hist.take()
                self.acc.observe(metric, t0, n, over)

    def _collect(self, pod: Pod) -> None:
        assert pod.engine is not None
        for rec in pod.engine.pop_finished():
            pod.in_flight.discard(rec.request_id)
            pod.last_finish = max(pod.last_finish, rec.finish_time + pod.t0)
            self._account(rec, pod.t0)

    def _account(self, rec: RequestRecord, t0: float) -> None:
        if rec.finish_reason in ("abort", "error"):  # the engine gave up on it
            self.acc.fail(rec.finish_time + t0, "rejected")
            return
        minute = self.acc.at(rec.arrival_time + t0)
        self.acc.finished[minute] += 1
        ttft = rec.ttft
        lim = self._limit
        good = (
            (lim["ttft"] is None or (ttft is not None and ttft <= lim["ttft"]))
            and (lim["itl"] is None or rec.tpot <= lim["itl"])
            and (lim["e2e"] is None or rec.e2e <= lim["e2e"])
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
            if h is m.ttft:  # the one _count the adapter reads (burstiness); the rest unread
                count = h.bucket_counts()[-1][1]  # the +Inf bucket
                db.append({**base, "__name__": h.name + "_count"}, t, float(count))
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
        """Each minute's SLO verdict as Prometheus showed it (bucket increases summed over pods,
        `histogram_quantile`) and from exact latencies (nearest-rank percentile of every
        observation in the minute); either way a minute in which more than 1 % of the arrivals
        failed outright is violated."""
        ev = Evaluator(self.db)
        n = self.acc.minutes
        violated = np.zeros(n, dtype=bool)
        exact = np.zeros(n, dtype=bool)
        attainment = np.full(n, np.nan)
        for i in range(n):
            if (i + 1) * 60.0 > self.horizon + EPS:
                break
            bad, worst, seen = self._prometheus_minute(ev, i)
            arrivals = self.acc.arrivals[i]
            failing = arrivals > 0 and self.acc.failed[i] / arrivals > FAILED_SHARE_VIOLATION
            violated[i] = bad or failing
            exact[i] = self._exact_minute(i) or failing
            attainment[i] = worst if seen else (0.0 if arrivals > 0 else np.nan)
        return MinuteView(violated, attainment, exact)

    def _prometheus_minute(self, ev: Evaluator, i: int) -> tuple[bool, float, bool]:
        t = (i + 1) * 60.0
        worst, bad, seen = 1.0, False, False
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
                worst = min(worst, f)
        return bad, worst, seen

    def _exact_minute(self, i: int) -> bool:
        for metric, target in self.s.slo.targets():
            n = self.acc.observed[metric][i]
            if n <= 0:
                continue
            rank = math.ceil(target.percentile / 100.0 * n - 1e-9)  # nearest-rank percentile
            if n - self.acc.over[metric][i] < rank:
                return True
        return False

    def goodput(self) -> float:
        return float(self.acc.good.sum()) / self.horizon

    def failed(self) -> int:
        return int(self.acc.failed.sum())

    def late_requests(self, pod: Pod, t: float) -> int:
        """How many of the pod's unfinished requests had missed the TTFT threshold by world
        time `t`: no first token that long after arrival, or a first token that came later."""
        limit = self._limit["ttft"]
        if pod.engine is None or limit is None:
            return 0
        now = t - pod.t0
        sched = pod.engine.sched
        late = 0
        for seq in (*sched.waiting, *sched.running):
            first = now if seq.first_token_time is None else seq.first_token_time
            late += int(first - seq.arrival > limit)
        return late

    def unfinished(self) -> tuple[int, int]:
        """Requests unfinished now (queued or running, neither good nor failed), and how many
        of them had already missed the TTFT threshold."""
        pods = [p for p in self.pods if p.engine is not None]
        return sum(len(p.in_flight) for p in pods), sum(self.late_requests(p, self.t) for p in pods)

    def failed_by_cause(self) -> dict[str, int]:
        return {
            "tuning": int(self.acc.failed_tuning.sum()),
            "crash": int(self.acc.failed_crash.sum()),
            "rejected": int(self.acc.failed_rejected.sum()),
        }

    def arrivals(self) -> int:
        return int(self.acc.arrivals.sum())

    def crash_left_standing(self) -> bool:
        """A pod of the final configuration is down for a crash at the end of the run."""
        return any(
            p.phase == "backoff" or p.restarts > 0 for p in self.pods if p.phase != "terminating"
        )


def _doomed_first(pods: list[Pod]) -> list[Pod]:
    """Pods in the order a ReplicaSet removes them: unscheduled, then not ready, then the most
    recently ready, then the most restarted, then the newest."""
    return sorted(
        pods,
        key=lambda p: (
            _DOOM_ORDER.get(p.phase, 0),
            -(p.ready_since if p.ready_since is not None else math.inf),
            -p.restarts,
            -p.slot,
        ),
    )


@dataclass(frozen=True)
class MinuteView:
    violated: np.ndarray  # as Prometheus showed it
    attainment: np.ndarray
    violated_exact: np.ndarray  # from exact latencies
