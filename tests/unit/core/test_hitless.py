"""Hitless knob changes in decide(): headroom, surge, the one-pod canary, recovery.

The rules held here, over random loads, replica counts, rollout settings, clocks and pods
(hypothesis, on the real analytic model; its answers are shared, see shared_model.py):

- a crashing or OOM-killed candidate (canary or rolling, any trial phase) is rolled back at
  the same reconcile, whatever the headroom, the load or a headroom wait in progress;
- without surge, no rollout starts unless the pods that stay can carry the traffic, or the
  headroom wait has reached its break-even (the gain lost by waiting equals the overload's
  extra cost, at most headroomTimeout), and then only to fix a confirmed violation whose
  gain exceeds the cost with the overload; the wait never passes headroomTimeout and is
  announced once;
- a canary is never started with one replica (nor when the rollout settings turn it off);
- during a canary (RollingOut, Verifying) the stable Deployment's knobs (`state.applied`)
  never change and nothing is applied; promotion applies the candidate to every pod
  (Promoting), and the trial commits only when every pod runs it;
- CanaryStarted, CanaryReady, CanaryPromoted and TuningRolledBack are emitted once, on their
  transition;
- after a trial ends, a queue is the restart's: the tuner holds while it drains (at most two
  evaluation windows); the canary's paired window waits for the baseline pods' queue, at
  most half the verify window;
- a person's promote or abort acts only on a running canary;
- every state survives status: TuningState.to_dict/from_dict and the API's TuningStatus.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.unit.core.shared_model import SharedModel, scaled
from tests.unit.core.test_decide import (
    KNOBS,
    NOW,
    make_policy,
    make_snapshot,
    ready_pods,
    violating_snapshot,
)
from vllm_autotuner.api.status import TuningStatus
from vllm_autotuner.core.canary import miss_share
from vllm_autotuner.core.decide import (
    CANARY_WINDOW_FACTOR,
    Decision,
    _canary_cannot_credit,
    _canary_min_requests,
    canary_command,
    decide,
)
from vllm_autotuner.core.economics import headroom, headroom_wait_s, worth_restart
from vllm_autotuner.core.perf_model import Workload
from vllm_autotuner.core.rollout import rollout_progress, utc_day
from vllm_autotuner.core.snapshot import Observation, Snapshot
from vllm_autotuner.core.topology import CANARY_PHASES, topology
from vllm_autotuner.core.tuning_types import (
    TRIAL_PHASES,
    CanaryAnalysis,
    DeploymentContext,
    Knobs,
    Measured,
    ModelCheck,
    Phase,
    PodHealth,
    RolloutRules,
    RolloutSettings,
    Strategy,
    Trial,
    TuningPolicy,
    TuningState,
)

BASE = KNOBS
CAND = Knobs(2048, 256, 0.92)


def expensive(examples: int) -> Any:
    """Settings of a property whose examples run decide() with the model."""
    return settings(
        max_examples=scaled(examples),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


FAILURES = {
    "CrashLoopBackOff": "Crashed",
    "RunContainerError": "Crashed",
    "CreateContainerError": "Crashed",
    "OOMKilled": "OOMKilled",
}


def hctx(
    replicas: int = 2, surge: int = 0, canary: bool = True, load_time_s: float = 120.0
) -> DeploymentContext:
    return DeploymentContext(
        model="meta-llama/Llama-3.1-8B-Instruct",
        gpu_product="H100",
        replicas=replicas,
        rollout=RolloutSettings(max_surge=surge, canary=canary, load_time_s=load_time_s),
    )


def hpolicy(headroom_timeout_s: float = 3600.0, **kw: Any) -> TuningPolicy:
    rules = RolloutRules(
        min_interval_s=0.0,
        max_per_day=12,
        verify_window_s=600.0,
        ready_timeout_s=900.0,
        headroom_timeout_s=headroom_timeout_s,
    )
    return make_policy("Auto", rollout=rules, **kw)


def trial_state(
    phase: Phase, strategy: Strategy = "Canary", t0: datetime = NOW, **kw: Any
) -> TuningState:
    """A trial of CAND from BASE begun at t0: a canary keeps BASE applied until promoted."""
    applied = CAND if strategy == "Rolling" or phase == "Promoting" else BASE
    verify_until = t0 + timedelta(seconds=600) if phase == "Verifying" else None
    return TuningState(
        applied=applied,
        last_good=BASE,
        phase=phase,
        candidate=CAND,
        strategy=strategy,
        trials=(Trial(1, CAND, t0),),
        rollout_started_at=t0,
        verify_until=verify_until,
        last_rollout_at=t0,
        rollouts_today=1,
        rollout_day=utc_day(t0),
        **kw,
    )


def itl_window(
    knobs: Knobs,
    requests: int = 1200,
    miss: float = 0.02,
    rate: float = 4.0,
    waiting: float = 0.0,
    pods: int = 1,
) -> Snapshot:
    """A window whose ITL histogram puts `miss` of the gaps over the 50 ms threshold."""
    total = requests * 100.0
    under = total * (1.0 - miss)
    snap = make_snapshot(
        knobs,
        rate=rate * pods,
        completed=requests,
        waiting_mean=waiting,
        num_pods=pods,
        itl_p95=45.0 if miss < 0.05 else 80.0,
    )
    buckets = ((25.0, under * 0.6), (50.0, under), (100.0, total - 0.2 * (total - under)))
    return replace(snap, itl=replace(snap.itl, buckets=(*buckets, (math.inf, total))))


def status_round_trip(state: TuningState) -> None:
    """to_dict/from_dict are inverse, through JSON and through the API's pydantic model,
    which drops no field the tuner writes."""
    wire = json.loads(json.dumps(state.to_dict()))
    assert TuningState.from_dict(wire).to_dict() == wire
    model = TuningStatus.model_validate(wire)
    dumped = model.model_dump(by_alias=True, mode="json")
    for key, value in wire.items():
        assert key in dumped, key
        if isinstance(value, dict) and key != "calibration":
            assert set(value) <= set(dumped[key] or {}), key
    assert TuningState.from_dict(dumped).to_dict() == wire


def reasons(d: Decision) -> list[str]:
    return [e.reason for e in d.events]


# ------------------------------------------------------------------ failures never wait


@expensive(100)
@given(
    strategy=st.sampled_from(["Rolling", "Canary"]),
    phase=st.sampled_from(list(TRIAL_PHASES)),
    failure=st.sampled_from(sorted(FAILURES)),
    replicas=st.integers(1, 6),
    surge=st.integers(0, 1),
    rate=st.sampled_from([0.5, 4.0, 40.0, 400.0]),
    elapsed=st.integers(0, 5000),
    waited=st.one_of(st.none(), st.integers(0, 20000)),
    healthy=st.integers(0, 3),
)
def test_a_failing_candidate_is_rolled_back_at_once(
    strategy: Strategy,
    phase: Phase,
    failure: str,
    replicas: int,
    surge: int,
    rate: float,
    elapsed: int,
    waited: int | None,
    healthy: int,
) -> None:
    if strategy == "Rolling" and phase == "Promoting":
        phase = "Verifying"
    now = NOW + timedelta(seconds=elapsed)
    since = None if waited is None else now - timedelta(seconds=waited)
    state = trial_state(phase, strategy, headroom_wait_since=since)
    oom = failure == "OOMKilled"
    bad = PodHealth(
        ready=False,
        restarts=3,
        waiting_reason=None if oom else failure,
        last_termination_reason="OOMKilled" if oom else "Error",
        revision_knobs=CAND,
        name="candidate-0",
    )
    pods = (*ready_pods(BASE, healthy), bad)
    base = itl_window(BASE, rate=rate, pods=max(1, replicas - 1), waiting=50.0)
    obs = Observation(base, pods, itl_window(CAND, rate=rate))
    d = decide(state, obs, hpolicy(), hctx(replicas, surge), now, SharedModel())
    assert d.action == "rollback", d.reason
    assert d.knobs_to_apply == BASE == d.new_state.applied
    assert (d.new_state.phase, d.new_state.candidate, d.new_state.strategy) == (
        "RolledBack",
        None,
        "Rolling",
    )
    assert d.new_state.trials[-1].outcome == FAILURES[failure]
    assert d.new_state.infeasible[-1].knobs == CAND
    assert reasons(d) == ["TuningRolledBack"] and d.events[0].type == "Warning"
    assert "headroom" not in d.reason
    assert topology(d.new_state, hctx(replicas, surge)).canary is None
    status_round_trip(d.new_state)


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_committed_configuration_that_fails_later_goes_back_without_waiting(
    failure: str,
) -> None:
    """No headroom at all (one replica, no surge, heavy load, a wait in progress): the
    failing configuration still goes back to the one before it at once."""
    oom = failure == "OOMKilled"
    state = TuningState(
        applied=CAND,
        last_good=CAND,
        phase="Observing",
        trials=(Trial(1, CAND, NOW, NOW, "Committed"),),
        headroom_wait_since=NOW - timedelta(minutes=5),
    )
    bad = PodHealth(
        ready=False,
        waiting_reason=None if oom else failure,
        last_termination_reason="OOMKilled" if oom else None,
        revision_knobs=CAND,
    )
    obs = Observation(itl_window(CAND, rate=400.0), (bad,))
    later = NOW + timedelta(hours=2)
    d = decide(state, obs, hpolicy(), hctx(1, 0), later, SharedModel(), origin=BASE)
    assert d.action == "rollback", d.reason
    assert d.knobs_to_apply == BASE == d.new_state.applied == d.new_state.last_good
    assert reasons(d) == ["TuningRolledBack"]


# ---------------------------------------------------------------- headroom and surge


def _applied_capacity(d: Decision) -> float:
    assert d.predictions and d.predictions[0][0] == BASE
    return d.predictions[0][1].capacity_rps


def _break_even(
    d: Decision, ctx: DeploymentContext, policy: TuningPolicy, snap: Snapshot, peak: float
) -> tuple[float, bool]:
    """When a rollout without headroom may go (seconds into the wait), and whether it may at
    all: the economics of the decision's own predictions, at its load and peak."""
    (_, now), (_, new) = d.predictions
    strategy: Strategy = "Canary" if ctx.replicas >= 2 and ctx.rollout.canary else "Rolling"
    violated = d.diagnosis is not None and d.diagnosis.violates_slo
    rate = snap.per_pod_rate()
    miss = miss_share(snap, policy.slo) if violated else 0.0
    w = worth_restart(
        ctx, policy.rollout, strategy, now.capacity_rps, new.capacity_rps, rate,
        max(rate, peak), miss,
    )  # fmt: skip
    limit = policy.rollout.headroom_timeout_s
    go_at = headroom_wait_s(w.cost_now_requests, w.cost_requests, w.gain_rate, limit)
    return go_at, violated and w.gain_requests > w.cost_now_requests


@expensive(120)
@given(
    replicas=st.integers(1, 4),
    surge=st.integers(0, 1),
    canary=st.booleans(),
    rate=st.sampled_from([2.0, 8.0, 14.0]),
    violated=st.booleans(),
    load_time=st.sampled_from([30.0, 120.0, 600.0]),
    timeout=st.sampled_from([0.0, 600.0, 3600.0]),
    waited=st.one_of(st.none(), st.integers(0, 7200)),
    peak=st.one_of(st.none(), st.sampled_from([4.0, 30.0])),
)
def test_no_rollout_without_headroom_or_surge_before_the_break_even(
    replicas: int,
    surge: int,
    canary: bool,
    rate: float,
    violated: bool,
    load_time: float,
    timeout: float,
    waited: int | None,
    peak: float | None,
) -> None:
    ctx = hctx(replicas, surge, canary, load_time)
    policy = hpolicy(timeout)
    since = None if waited is None else NOW - timedelta(seconds=waited)
    state = replace(
        TuningState.initial(BASE),
        phase="Holding" if since else "Observing",
        headroom_wait_since=since,
        peak_rate=peak,
        peak_rate_at=None if peak is None else NOW - timedelta(hours=1),
    )
    snap = (violating_snapshot if violated else make_snapshot)(
        BASE, rate=rate * replicas, num_pods=replicas
    )
    d = decide(
        state, Observation(snap, ready_pods(BASE, replicas)), policy, ctx, NOW, SharedModel()
    )
    status_round_trip(d.new_state)
    if not d.predictions:
        return  # held before the model was asked (e.g. idle)
    room = headroom(ctx, _applied_capacity(d), rate)
    waits = "rollout waits for headroom" in d.reason
    gave_up = "RolloutAbandoned" in reasons(d)
    waited = 0.0 if since is None else (NOW - since).total_seconds()
    go_at, may_go = (0.0, False)
    if len(d.predictions) == 2:
        go_at, may_go = _break_even(d, ctx, policy, snap, peak or 0.0)
    event(f"{d.action}{' (waits)' if waits else ''}{' (gave up)' if gave_up else ''}")
    if d.action == "rollout":
        s = d.new_state
        if surge == 0 and not room.ok:
            # Only from the break-even on, and only to fix a violation worth the overload.
            assert may_go and waited >= go_at, (waited, go_at)
            assert f"going without headroom after waiting {waited / 60:.0f} min" in d.reason
            assert f"break-even {go_at / 60:.0f} min" in d.reason
        assert s.headroom_wait_since is None
        if s.strategy == "Canary":
            assert replicas >= 2 and canary
            assert d.knobs_to_apply is None and s.applied == BASE
            assert s.candidate is not None and not s.candidate.same_as(BASE)
            assert reasons(d) == ["CanaryStarted"]
            topo = topology(s, ctx)
            assert topo.canary == s.candidate and topo.stable == BASE
            assert topo.pods <= replicas + surge
        else:
            assert replicas < 2 or not canary
            assert d.knobs_to_apply == s.applied == s.candidate
            assert reasons(d) == ["RolloutStarted"]
    if waits:
        assert surge == 0 and not room.ok and waited <= timeout  # never past headroomTimeout
        assert not (may_go and waited >= go_at)
        assert "break-even" in d.reason
        assert d.action == "hold" and d.knobs_to_apply is None
        assert d.new_state.phase == "Holding"
        assert d.new_state.headroom_wait_since == (since or NOW)
        # Announced when the wait begins, not every reconcile.
        assert reasons(d) == ([] if since else ["WaitingForHeadroom"])
        assert "min)" in d.reason and "req/s" in d.reason
    if gave_up:
        assert waited > timeout and not may_go and d.new_state.headroom_wait_since is None
        assert d.new_state.phase == "Observing"
    if surge > 0:
        assert not waits and not gave_up
    if not waits:
        # A hold for another reason keeps the clock while the SLO is still violated (the
        # proposal may change between windows); a met SLO, a rollout or giving up ends it.
        violated = d.diagnosis is not None and d.diagnosis.violates_slo
        kept = since if violated and d.action == "hold" and not gave_up else None
        assert d.new_state.headroom_wait_since == kept


@pytest.mark.parametrize(
    ("load_time", "ends"),
    [(30.0, "break-even"), (120.0, "headroomTimeout"), (600.0, "abandoned")],
)
def test_the_headroom_wait_is_bounded_over_reconciles(load_time: float, ends: str) -> None:
    """Two replicas without surge at a load one pod cannot carry: the rollout waits (one
    Event), every reconcile keeps the same start of the wait, and it goes ahead for the
    confirmed violation at the first reconcile at or after the break-even (30 s restarts:
    12 min), or at headroomTimeout (30 min) when the break-even is later (120 s restarts);
    when the overload would cost more than the gain (600 s restarts) it gives up there."""
    ctx, policy = hctx(2, 0, load_time_s=load_time), hpolicy(headroom_timeout_s=1800.0)
    snap = violating_snapshot(BASE, rate=2 * 14.0, num_pods=2)
    state = TuningState.initial(BASE)
    now, ended, go_at, d = NOW, None, None, None
    announced: list[str] = []
    for _ in range(12):
        d = decide(state, Observation(snap, ready_pods(BASE, 2)), policy, ctx, now, SharedModel())
        announced += [r for r in reasons(d) if r == "WaitingForHeadroom"]
        go_at = go_at or _break_even(d, ctx, policy, snap, 0.0)[0]
        if d.action == "rollout" or "RolloutAbandoned" in reasons(d):
            ended = now
            break
        assert "rollout waits for headroom" in d.reason, d.reason
        assert d.new_state.headroom_wait_since == NOW
        state = d.new_state
        now += timedelta(minutes=5)
    assert announced == ["WaitingForHeadroom"]
    assert d is not None and ended is not None and go_at is not None
    waited = (ended - NOW).total_seconds()
    if ends == "abandoned":
        assert d.action == "hold" and 1800.0 < waited <= 1800.0 + 300.0
        return
    assert d.action == "rollout"
    assert go_at <= waited < go_at + 300.0
    assert (go_at < 1800.0) == (ends == "break-even")


def test_a_rollout_that_only_gains_capacity_gives_up_when_headroom_never_comes() -> None:
    """The SLO is met; the gain is at the peak seen this morning (30 req/s/pod), but the
    pod that would stay cannot carry today's traffic: past headroomTimeout the tuner gives
    up (an Event says so) rather than overload it for a gain that is not urgent."""
    since = NOW - timedelta(minutes=50)
    state = replace(
        TuningState.initial(BASE),
        phase="Holding",
        headroom_wait_since=since,
        peak_rate=30.0,
        peak_rate_at=NOW - timedelta(hours=1),
    )
    # A mean ITL well inside the target: the model sees room for a gain at the peak.
    snap = make_snapshot(BASE, rate=2 * 14.0, num_pods=2, itl_mean=15.0)
    obs = Observation(snap, ready_pods(BASE, 2))
    d = decide(state, obs, hpolicy(600.0), hctx(2, 0), NOW, SharedModel())
    assert (d.action, reasons(d)) == ("hold", ["RolloutAbandoned"]), d.reason
    assert "given up after waiting 50 min for headroom (headroomTimeout 10 min)" in d.reason
    assert d.new_state.headroom_wait_since is None and d.new_state.phase == "Observing"
    # With surge the same decision rolls out: no pod is taken away.
    d = decide(state, obs, hpolicy(600.0), hctx(2, 1), NOW, SharedModel())
    assert d.action == "rollout" and reasons(d) == ["CanaryStarted"], d.reason


@pytest.mark.parametrize(("rate", "shown"), [(50.0, True), (0.05, False)])
def test_a_canary_that_could_not_show_its_gain_is_not_started(rate: float, shown: bool) -> None:
    """With the SLO met, a canary wins only on a gain that holds at the SLO its own requests
    cannot rule out. A 3 % gain at 50 req/s per pod (90,000 requests in its longest window,
    p95 becomes p95.1) can be shown; at 0.05 (90 requests, p95 becomes p98.8) it cannot, and
    no pod is restarted for it."""
    snap = make_snapshot(BASE, rate=2 * 14.0, num_pods=2, itl_mean=15.0)
    policy, ctx, model = hpolicy(), hctx(2, 1), SharedModel()
    w = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
    cal = model.calibrate(snap, BASE, ctx, w, None)
    best = Knobs(2048, 512, 0.92)
    central = model.predict(best, w, cal).capacity_rps
    assert central > 0
    why = _canary_cannot_credit(model, best, w, cal, central / 1.03, policy, rate)
    assert (why is None) == shown, why
    if why is not None:
        assert "counts about 90 requests in the 1800 s its window may run" in why
        assert "too few to show the predicted gain" in why


@pytest.mark.parametrize(
    ("replicas", "canary", "surge", "strategy"),
    [
        (1, True, 1, "Rolling"),
        (2, True, 1, "Canary"),
        (2, False, 1, "Rolling"),
        (4, True, 1, "Canary"),
    ],
)
def test_a_canary_needs_two_replicas_and_the_setting(
    replicas: int, canary: bool, surge: int, strategy: Strategy
) -> None:
    ctx = hctx(replicas, surge, canary)
    snap = violating_snapshot(BASE, rate=4.0 * replicas, num_pods=replicas)
    obs = Observation(snap, ready_pods(BASE, replicas))
    d = decide(TuningState.initial(BASE), obs, hpolicy(), ctx, NOW, SharedModel())
    assert d.action == "rollout", d.reason
    assert d.new_state.strategy == strategy
    if strategy == "Canary":
        assert d.knobs_to_apply is None and d.new_state.applied == BASE
        assert d.reason.startswith("canary ")
    else:
        assert d.knobs_to_apply == d.new_state.applied == d.new_state.candidate


# -------------------------------------------------------------------- the canary walk


BASE_WINDOWS = [
    itl_window(BASE, miss=m, waiting=w, pods=1) for m in (0.02, 0.15) for w in (0.0, 10.0)
]
CANARY_WINDOWS = [itl_window(CAND, requests=n, miss=m) for n in (10, 400) for m in (0.0, 0.3)]
UNAVAILABLE = Snapshot.unavailable(NOW, 300.0, "no ready pod scraped yet")


@st.composite
def observation(draw: st.DrawFn, state: TuningState, replicas: int, surge: int) -> Observation:
    crash = draw(st.integers(0, 40)) == 0
    if state.phase == "Promoting":
        new = draw(st.sampled_from([replicas, replicas, replicas - 1, 0]))
        old = draw(st.sampled_from([0, 0, replicas - new]))
        pods = (*ready_pods(CAND, new), *ready_pods(BASE, old))
    else:
        stable = replicas if surge else replicas - 1
        canary_ready = draw(st.integers(0, 3)) > 0
        pods = (
            *ready_pods(BASE, stable),
            PodHealth(ready=canary_ready, revision_knobs=CAND, name="canary"),
        )
    if crash:
        pods = (*pods, PodHealth(False, 2, "CrashLoopBackOff", "Error", CAND, "crashing"))
    base = draw(st.sampled_from([*BASE_WINDOWS, UNAVAILABLE]))
    can = draw(st.sampled_from([*CANARY_WINDOWS, UNAVAILABLE, None]))
    return Observation(base, pods, can)


def check_step(
    before: TuningState,
    d: Decision,
    obs: Observation,
    ctx: DeploymentContext,
    policy: TuningPolicy,
    now: datetime,
    by_hand: str | None,
) -> None:
    after = d.new_state
    assert len(d.events) <= 1
    status_round_trip(after)
    topo = topology(after, ctx)
    assert topo.pods <= ctx.replicas + ctx.rollout.max_surge
    assert (topo.canary is not None) == (after.phase in CANARY_PHASES)
    if d.action == "rollback":
        assert d.knobs_to_apply == BASE == after.applied and after.phase == "RolledBack"
        assert reasons(d) == ["TuningRolledBack"]
        return
    if before.phase in CANARY_PHASES:
        if d.action == "promote":
            assert before.phase == "Verifying" or by_hand == "promote"
            assert d.knobs_to_apply == CAND == after.applied and after.phase == "Promoting"
            assert reasons(d) == ["CanaryPromoted"]
            return
        # The stable Deployment keeps its knobs; nothing is applied.
        assert after.applied == BASE and d.knobs_to_apply is None
        assert after.phase in CANARY_PHASES and after.candidate == CAND
        ready = any(p.ready and CAND.same_as(p.revision_knobs) for p in obs.pods)
        became_ready = before.phase == "RollingOut" and after.phase == "Verifying"
        assert reasons(d) == (["CanaryReady"] if became_ready else [])
        assert not became_ready or ready
        _check_baseline_queue_wait(before, after, obs, policy, now)
        return
    assert before.phase == "Promoting"
    complete = rollout_progress(obs.pods, CAND, ctx.replicas)[1]
    if d.action == "commit":
        assert complete
        assert after.applied == after.last_good == CAND and after.phase == "Committed"
        assert reasons(d) == ["TuningCommitted"]
    else:
        assert not complete and d.action == "hold"
        assert after.applied == CAND and d.knobs_to_apply is None and not d.events


def _check_baseline_queue_wait(
    before: TuningState,
    after: TuningState,
    obs: Observation,
    policy: TuningPolicy,
    now: datetime,
) -> None:
    """The paired window starts once the baseline's queue is gone, or half the verify
    window after the canary became ready, whichever comes first."""
    if before.phase != "Verifying" or before.analysis is not None:
        return
    assert before.verify_until is not None
    ready_at = before.verify_until - timedelta(seconds=policy.rollout.verify_window_s)
    settling = (now - ready_at).total_seconds()
    base = obs.snapshot
    queued = base.available and (base.waiting_mean or 0.0) >= max(
        2.0, 0.1 * (base.running_mean or 0)
    )
    if after.analysis is None:
        assert queued and settling < policy.rollout.verify_window_s / 2
        assert "work off the queue" in (after.last_decision.reason if after.last_decision else "")
    else:
        assert not queued or settling >= policy.rollout.verify_window_s / 2
        assert after.analysis.since == now
        assert after.verify_until == now + timedelta(seconds=policy.rollout.verify_window_s)


@expensive(60)
@given(
    data=st.data(),
    replicas=st.integers(2, 4),
    surge=st.integers(0, 1),
    steps=st.lists(st.sampled_from([20, 120, 300, 700]), min_size=4, max_size=14),
)
def test_a_canary_walk_keeps_the_stable_knobs_and_emits_each_event_once(
    data: st.DataObject, replicas: int, surge: int, steps: list[int]
) -> None:
    ctx, policy = hctx(replicas, surge), hpolicy()
    state, now = trial_state("RollingOut"), NOW
    emitted: Counter[str] = Counter()
    for dt in steps:
        now += timedelta(seconds=dt)
        obs = data.draw(observation(state, replicas, surge))
        by_hand = data.draw(st.sampled_from([None] * 30 + ["promote", "abort"]))
        d = canary_command(state, by_hand, policy, now) if by_hand else None
        if d is None:
            by_hand = None
            d = decide(state, obs, policy, ctx, now, SharedModel())
        check_step(state, d, obs, ctx, policy, now, by_hand)
        emitted.update(reasons(d))
        state = d.new_state
        if state.phase not in TRIAL_PHASES:
            break
    event(f"walk ends in {state.phase} after {'/'.join(sorted(emitted)) or 'no event'}")
    assert all(n == 1 for n in emitted.values()), emitted
    assert set(emitted) <= {"CanaryReady", "CanaryPromoted", "TuningRolledBack", "TuningCommitted"}


def test_a_winning_canary_is_promoted_then_committed_when_every_pod_runs_it() -> None:
    ctx, policy = hctx(3, 0), hpolicy()
    pods_canary = (*ready_pods(BASE, 2), PodHealth(True, revision_knobs=CAND, name="canary"))
    state = trial_state("RollingOut")
    base, good = itl_window(BASE, miss=0.15, pods=2), itl_window(CAND, requests=400, miss=0.0)
    steps: list[tuple[int, tuple[PodHealth, ...], str, Phase]] = [
        (60, pods_canary, "verify", "Verifying"),  # CanaryReady
        (60, pods_canary, "verify", "Verifying"),  # the paired window starts
        (60, pods_canary, "promote", "Promoting"),  # the baseline misses 15%, the canary 0%
        (60, (*ready_pods(CAND, 2), *ready_pods(BASE, 1)), "hold", "Promoting"),
        (60, ready_pods(CAND, 3), "commit", "Committed"),
    ]
    now, seen = NOW, []
    for dt, pods, action, phase in steps:
        now += timedelta(seconds=dt)
        d = decide(state, Observation(base, pods, good), policy, ctx, now, SharedModel())
        assert (d.action, d.new_state.phase) == (action, phase), d.reason
        seen += reasons(d)
        state = d.new_state
    assert seen == ["CanaryReady", "CanaryPromoted", "TuningCommitted"]
    assert state.applied == state.last_good == CAND
    assert state.analysis is not None and state.analysis.verdict == "Promote"
    assert state.trials[-1].outcome == "Committed"
    # The trial keeps the pair its verdict compared: later predictions answer to it.
    assert state.trials[-1].baseline == state.analysis.baseline
    assert state.trials[-1].baseline_knobs == BASE


def test_a_losing_canary_costs_one_pod_and_never_touches_the_baseline() -> None:
    ctx, policy = hctx(3, 0), hpolicy()
    pods = (*ready_pods(BASE, 2), PodHealth(True, revision_knobs=CAND, name="canary"))
    base, bad = itl_window(BASE, miss=0.02, pods=2), itl_window(CAND, requests=400, miss=0.3)
    state = trial_state("Verifying")
    state = replace(
        state,
        analysis=CanaryAnalysis(NOW, 0.0, Measured(0.0), Measured(0.0), "Pending", "starts"),
    )
    d = decide(
        state, Observation(base, pods, bad), policy, ctx, NOW + timedelta(seconds=60), SharedModel()
    )
    assert d.action == "rollback", d.reason
    assert d.knobs_to_apply == BASE and "canary" in d.reason and "removed" in d.reason
    assert d.new_state.trials[-1].outcome == "RolledBack"
    assert d.new_state.infeasible[-1].kind == "Regression"
    assert d.new_state.analysis is not None and d.new_state.analysis.verdict == "Reject"
    assert d.new_state.trials[-1].baseline == d.new_state.analysis.baseline
    assert d.new_state.trials[-1].baseline_knobs == BASE


@pytest.mark.parametrize("min_requests", [30, 66])
def test_a_canary_short_of_requests_at_the_window_end_waits_for_them(min_requests: int) -> None:
    """A pod at a low rate fills a fixed window only by luck: the paired window runs on
    while either side has too few requests, concludes as soon as both have them, and is
    lost for want of data only after CANARY_WINDOW_FACTOR verify windows."""
    replicas = 3
    ctx, policy = hctx(replicas, 1), hpolicy(min_requests=min_requests * replicas)
    need = _canary_min_requests(policy, ctx)
    pods = (*ready_pods(BASE, replicas), PodHealth(True, revision_knobs=CAND, name="canary"))
    base = itl_window(BASE, requests=3 * need, miss=0.0, pods=replicas)
    analysis = CanaryAnalysis(NOW, 0.0, Measured(0.0), Measured(0.0), "Pending", "starts")
    state = replace(trial_state("Verifying"), analysis=analysis)
    window_s = policy.rollout.verify_window_s
    last = NOW + timedelta(seconds=CANARY_WINDOW_FACTOR * window_s)

    def step(seconds: float, canary_requests: int) -> Decision:
        obs = Observation(base, pods, itl_window(CAND, requests=canary_requests, miss=0.0))
        return decide(state, obs, policy, ctx, NOW + timedelta(seconds=seconds), SharedModel())

    for t in (window_s, window_s + 1, 2 * window_s, (last - NOW).total_seconds() - 1):
        d = step(t, need - 1)
        assert d.action == "verify" and d.knobs_to_apply is None, d.reason
        assert f"of {need} needed" in d.reason
    lost = step((last - NOW).total_seconds(), need - 1)
    assert lost.action == "rollback" and "window ended" in lost.reason, lost.reason
    # Enough requests at any point after the window's end: a verdict at once.
    done = step(window_s + 120, need)
    assert done.action in ("promote", "rollback") and "needed" not in done.reason, done.reason


# ---------------------------------------------------------------- queues after restarts


@given(
    since_s=st.integers(0, 3 * 300),
    queue=st.sampled_from([0.0, 1.0, 3.0, 50.0]),
    settled=st.integers(0, 600),
    replicas=st.integers(2, 4),
)
def test_the_paired_window_waits_for_the_baselines_queue_at_most_half_the_window(
    since_s: int, queue: float, settled: int, replicas: int
) -> None:
    ready_at = NOW
    state = trial_state("Verifying", t0=NOW - timedelta(seconds=200))
    state = replace(state, verify_until=ready_at + timedelta(seconds=600), analysis=None)
    now = ready_at + timedelta(seconds=settled)
    base = itl_window(BASE, waiting=queue, pods=replicas - 1)
    pods = (*ready_pods(BASE, replicas - 1), PodHealth(True, revision_knobs=CAND))
    obs = Observation(base, pods, itl_window(CAND))
    policy = hpolicy()
    d = decide(state, obs, policy, hctx(replicas), now, SharedModel())
    assert d.action == "verify" and d.knobs_to_apply is None and not d.events
    _check_baseline_queue_wait(state, d.new_state, obs, policy, now)


@expensive(60)
@given(
    ended_s=st.integers(0, 4 * 300),
    queue=st.sampled_from([0.0, 1.0, 3.0, 50.0]),
    outcome=st.sampled_from(["Committed", "RolledBack"]),
)
def test_a_queue_after_a_rollout_is_the_restarts_for_two_evaluation_windows(
    ended_s: int, queue: float, outcome: str
) -> None:
    ended = NOW - timedelta(seconds=ended_s)
    state = replace(
        TuningState.initial(BASE),
        phase="Committed",
        trials=(Trial(1, BASE, ended - timedelta(minutes=20), ended, outcome),),  # type: ignore[arg-type]
    )
    snap = violating_snapshot(BASE, waiting_mean=queue)
    policy = hpolicy()
    d = decide(state, Observation(snap, ready_pods(BASE)), policy, hctx(1, 1), NOW, SharedModel())
    queued = queue >= max(2.0, 0.1 * (snap.running_mean or 0.0))
    recovering = queued and ended_s < 2 * policy.evaluation_window_s
    assert ("recovering from the last rollout" in d.reason) == recovering, d.reason
    if recovering:
        assert d.action == "hold" and d.new_state.phase == "Holding" and d.knobs_to_apply is None
        assert d.predictions == ()  # the window is not judged at all


# --------------------------------------------------------------------- promote / abort


@given(
    phase=st.sampled_from(
        ["Idle", "Observing", "RollingOut", "Verifying", "Promoting", "Committed"]
    ),
    strategy=st.sampled_from(["Rolling", "Canary"]),
    command=st.sampled_from(["promote", "abort"]),
)
def test_promote_and_abort_act_only_on_a_running_canary(
    phase: Phase, strategy: Strategy, command: str
) -> None:
    if phase in TRIAL_PHASES:
        state = trial_state(phase, strategy)
    else:
        state = replace(TuningState.initial(BASE), phase=phase, strategy=strategy)
    later = NOW + timedelta(seconds=30)
    d = canary_command(state, command, hpolicy(), later)
    if not (strategy == "Canary" and phase in CANARY_PHASES):
        assert d is None
        return
    assert d is not None
    status_round_trip(d.new_state)
    if command == "promote":
        assert d.action == "promote" and d.knobs_to_apply == CAND == d.new_state.applied
        assert d.new_state.phase == "Promoting" and d.new_state.rollout_started_at == later
        assert reasons(d) == ["CanaryPromoted"] and "by hand" in d.reason
    else:
        assert d.action == "rollback" and d.knobs_to_apply == BASE == d.new_state.applied
        assert d.new_state.infeasible == ()  # not the candidate's fault
        assert d.new_state.trials[-1].outcome == "RolledBack"
        assert reasons(d) == ["TuningRolledBack"] and "aborted by hand" in d.reason


# ------------------------------------------------------------------------------ status

times = st.integers(0, 10**6).map(lambda s: NOW + timedelta(seconds=s, microseconds=s % 7))
finite = st.floats(0.0, 1e4, allow_nan=False)
measured = st.builds(
    Measured,
    request_rate=finite,
    ttft_ms=st.one_of(st.none(), finite),
    itl_ms=st.one_of(st.none(), finite),
    e2e_ms=st.one_of(st.none(), finite),
    slo_attainment=st.one_of(st.none(), st.floats(0.0, 1.0)),
    capacity_rps=st.one_of(st.none(), finite),
)
knobs = st.builds(
    Knobs,
    st.integers(256, 65536),
    st.integers(1, 256),
    st.floats(0.5, 0.99).map(lambda g: round(g, 4)),
)


@given(
    phase=st.sampled_from(["Observing", "RollingOut", "Verifying", "Promoting", "Holding"]),
    strategy=st.sampled_from(["Rolling", "Canary"]),
    applied=knobs,
    candidate=st.one_of(st.none(), knobs),
    analysis=st.one_of(
        st.none(),
        st.builds(
            CanaryAnalysis,
            since=times,
            window_s=finite,
            baseline=measured,
            canary=measured,
            verdict=st.sampled_from(["Pending", "Promote", "Reject"]),
            reason=st.text(max_size=40),
        ),
    ),
    check=st.one_of(
        st.none(),
        st.builds(
            ModelCheck,
            time=times,
            knobs=knobs,
            measured_rate_rps=finite,
            predicted_capacity_rps=finite,
            predicted_slo_ratio=st.one_of(st.none(), finite, st.just(math.inf)),
            measured_slo_ratio=st.one_of(st.none(), finite, st.just(math.inf)),
            fit_error=st.one_of(st.none(), st.floats(0.0, 5.0)),
            agrees=st.booleans(),
        ),
    ),
    peak=st.one_of(st.none(), finite),
    peak_at=st.one_of(st.none(), times),
    wait_since=st.one_of(st.none(), times),
)
def test_the_new_status_fields_survive_a_round_trip(
    phase: Phase,
    strategy: Strategy,
    applied: Knobs,
    candidate: Knobs | None,
    analysis: CanaryAnalysis | None,
    check: ModelCheck | None,
    peak: float | None,
    peak_at: datetime | None,
    wait_since: datetime | None,
) -> None:
    state = TuningState(
        applied=applied,
        last_good=applied,
        phase=phase,
        candidate=candidate,
        strategy=strategy,
        peak_rate=peak,
        peak_rate_at=peak_at,
        headroom_wait_since=wait_since,
        analysis=analysis,
        model_check=check,
    )
    status_round_trip(state)
    back = TuningState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert back.strategy == strategy
    assert back.headroom_wait_since == wait_since
    assert (back.analysis is None) == (analysis is None)
    if analysis is not None and back.analysis is not None:
        assert back.analysis.verdict == analysis.verdict and back.analysis.since == analysis.since
    if check is not None:
        assert back.model_check is not None
        assert back.model_check.agrees == check.agrees
        assert back.model_check.trusted == (
            check.agrees and check.fit_error is not None and round(check.fit_error, 4) <= 0.15
        )
        if check.predicted_slo_ratio is not None and math.isinf(check.predicted_slo_ratio):
            assert back.model_check.predicted_slo_ratio is None  # JSON has no infinity
