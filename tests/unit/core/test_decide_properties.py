"""Safety properties of decide() over random states, snapshots, pods and policies (hypothesis).

Whatever the inputs, decide() must never: leave the bounds or move more than maxStep (except
a rollback to lastGood), propose a known-bad configuration or its neighbourhood, act on too
little or unusable data, break the daily budget, the cooldown or the maintenance windows, act in
Off or Recommend mode, raise gpu_memory_utilization more than its step above the stable value,
start a second rollout during one, or be non-deterministic.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import UTC, datetime, time, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.unit.core.shared_model import SharedModel, scaled
from tests.unit.core.test_decide import CTX, NOW, make_policy, make_snapshot
from vllm_autotuner.core.decide import Decision, decide
from vllm_autotuner.core.memory import ProvenMemory
from vllm_autotuner.core.rollout import roll_day
from vllm_autotuner.core.search import is_forbidden
from vllm_autotuner.core.snapshot import Observation, Snapshot
from vllm_autotuner.core.tuning_types import (
    Bounds,
    InfeasibleConfig,
    InfeasibleKind,
    KnobBounds,
    Knobs,
    MaintenanceWindow,
    Phase,
    PodHealth,
    RolloutRules,
    Trial,
    TuningPolicy,
    TuningState,
)

KINDS: list[InfeasibleKind] = ["OOMKilled", "Crashed", "NotReady", "Regression"]
PHASES: list[Phase] = [
    "Idle",
    "Observing",
    "Candidate",
    "RollingOut",
    "Verifying",
    "Committed",
    "RolledBack",
    "Holding",
]


@st.composite
def bounds_st(draw: st.DrawFn) -> Bounds:
    lo_t = draw(st.sampled_from([256, 512, 1024, 2048]))
    hi_t = draw(st.sampled_from([4096, 8192, 16384]))
    lo_s = draw(st.sampled_from([8, 16, 64]))
    hi_s = draw(st.sampled_from([128, 256, 1024]))
    lo_g = draw(st.sampled_from([0.5, 0.8, 0.85]))
    hi_g = draw(st.sampled_from([0.9, 0.92, 0.95]))
    return Bounds(
        KnobBounds(lo_t, hi_t, draw(st.sampled_from([256, 1024, 4096, 8192]))),
        KnobBounds(lo_s, hi_s, draw(st.sampled_from([8, 64, 256]))),
        KnobBounds(lo_g, hi_g, draw(st.sampled_from([0.01, 0.02, 0.05]))),
    )


@st.composite
def knobs_in(draw: st.DrawFn, b: Bounds) -> Knobs:
    mns = draw(st.integers(int(b.mns.min), int(b.mns.max)))
    mnbt = draw(st.integers(max(int(b.mnbt.min), mns), int(b.mnbt.max)))
    gmu = round(draw(st.floats(b.gmu.min, b.gmu.max)), 3)
    return Knobs(mnbt, mns, min(max(gmu, b.gmu.min), b.gmu.max))


@st.composite
def scenario(draw: st.DrawFn) -> dict[str, Any]:
    b = draw(bounds_st())
    applied = draw(knobs_in(b))
    last_good = draw(st.one_of(st.just(applied), knobs_in(b)))
    phase = draw(st.sampled_from(PHASES)) if draw(st.integers(0, 2)) == 0 else "Observing"
    rolling = phase in ("RollingOut", "Verifying")
    candidate = applied if rolling else None
    now = NOW + timedelta(minutes=draw(st.integers(0, 7 * 24 * 60)))
    infeasible = tuple(
        InfeasibleConfig(k, "failed", NOW, kind)
        for k, kind in draw(
            st.lists(
                st.tuples(knobs_in(b), st.sampled_from(KINDS)),
                max_size=4,
            )
        )
    )
    state = TuningState(
        applied=applied,
        last_good=last_good,
        phase=phase,
        candidate=candidate,
        rollout_started_at=now - timedelta(seconds=draw(st.integers(0, 3000))) if rolling else None,
        verify_until=(now + timedelta(seconds=draw(st.integers(-1500, 600))))
        if phase == "Verifying"
        else None,
        last_rollout_at=draw(
            st.one_of(
                st.none(),
                st.none(),
                st.integers(0, 20000).map(lambda s: now - timedelta(seconds=s)),
            )
        ),
        rollouts_today=draw(st.integers(0, 5)),
        rollout_day=draw(st.sampled_from([None, now.strftime("%Y-%m-%d"), "2026-01-01"])),
        proven_memory=ProvenMemory.of(
            draw(
                st.lists(
                    st.tuples(st.integers(b.mnbt.min, b.mnbt.max), st.floats(0.5, 0.95)),
                    max_size=4,
                )
            )
        ),
        trials=(Trial(1, applied, NOW),) if rolling else (),
        infeasible=infeasible,
    )
    observed = draw(knobs_in(b)) if draw(st.integers(0, 4)) == 0 else applied
    if draw(st.integers(0, 5)) > 0:
        snap = make_snapshot(
            observed,
            rate=draw(st.floats(0.0, 20.0)),
            completed=draw(st.integers(0, 3000)),
            ttft_p95=draw(st.floats(20.0, 5000.0)),
            itl_mean=(itl_mean := draw(st.floats(5.0, 60.0))),
            itl_p95=itl_mean * draw(st.floats(1.0, 4.0)),
            kv_max=draw(st.floats(0.0, 1.0)),
            preemption_rate=draw(st.sampled_from([0.0, 0.0, 0.5, 3.0])),
            running_max=draw(st.floats(0.0, float(observed.max_num_seqs))),
            waiting_mean=draw(st.floats(0.0, 50.0)),
            prompt=(p := draw(st.floats(50.0, 4000.0)), p * draw(st.floats(1.0, 3.0))),
            gen=(g := draw(st.floats(10.0, 800.0)), g * draw(st.floats(1.0, 3.0))),
            num_pods=draw(st.integers(1, 3)),
            time=now,
        )
    else:
        snap = Snapshot.unavailable(now, 300, "Prometheus unreachable")
    pods = tuple(
        PodHealth(
            ready=draw(st.booleans()),
            restarts=draw(st.integers(0, 5)),
            waiting_reason=draw(st.sampled_from([None] * 5 + ["CrashLoopBackOff"])),
            last_termination_reason=draw(st.sampled_from([None] * 6 + ["OOMKilled", "Error"])),
            revision_knobs=draw(st.sampled_from([applied, last_good, None])),
        )
        for _ in range(draw(st.integers(0, 3)))
    )
    windows: tuple[MaintenanceWindow, ...] = ()
    if draw(st.integers(0, 3)) == 0:
        windows = (
            MaintenanceWindow(
                frozenset(draw(st.sets(st.integers(0, 6), min_size=1))),
                time(draw(st.integers(0, 23))),
                time(draw(st.integers(0, 23))),
            ),
        )
    rules = RolloutRules(
        min_interval_s=draw(st.sampled_from([0.0, 600.0, 3600.0])),
        max_per_day=draw(st.integers(0, 4)),
        maintenance_windows=windows,
        verify_window_s=600.0,
        ready_timeout_s=900.0,
    )
    policy = make_policy(
        draw(st.sampled_from(["Off", "Recommend", "Auto", "Auto", "Auto", "Auto"])),
        bounds=b,
        rollout=rules,
        min_requests=draw(st.sampled_from([1, 200, 1000])),
        min_gain_pct=draw(st.sampled_from([0.0, 5.0, 10.0])),
    )
    return {"state": state, "obs": Observation(snap, pods), "policy": policy, "now": now}


@settings(
    max_examples=scaled(200),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario())
def test_decide_is_safe(sc: dict[str, Any]) -> None:
    state: TuningState = sc["state"]
    policy = sc["policy"]
    obs: Observation = sc["obs"]
    now: datetime = sc["now"]
    d = decide(state, obs, policy, CTX, now, SharedModel())
    event(d.action)

    # Determinism: the same inputs give the same decision.
    assert decide(state, obs, policy, CTX, now, SharedModel()) == d
    # A remembered search of the same evidence stands in for the search, changing nothing.
    if d.search_memo is not None:
        assert decide(state, obs, policy, CTX, now, SharedModel(), memo=d.search_memo) == d
    assert_safe(d, state, obs, policy, now)


def assert_safe(
    d: Decision, state: TuningState, obs: Observation, policy: TuningPolicy, now: datetime
) -> None:
    # A person can read why, with numbers.
    assert d.reason and any(ch.isdigit() for ch in d.reason)
    assert d.new_state.last_decision is not None and d.new_state.last_decision.time == now
    # The state always survives status.
    assert TuningState.from_dict(d.new_state.to_dict()).to_dict() == d.new_state.to_dict()

    if policy.mode == "Off":
        assert d.action == "hold" and d.knobs_to_apply is None
    if policy.mode == "Recommend":
        assert d.knobs_to_apply is None
    if d.knobs_to_apply is None:
        assert d.action not in ("rollout", "rollback")
        return
    k = d.knobs_to_apply
    assert d.new_state.applied == k
    if d.action == "rollback":
        assert k == state.last_good
        return
    assert d.action == "rollout"
    # Never two rollouts at once.
    assert state.phase not in ("RollingOut", "Verifying")
    # Enough usable data, of the applied revision only.
    snap = obs.snapshot
    assert snap.available
    assert snap.knobs is not None and snap.knobs.same_as(state.applied)
    assert snap.completed_requests >= policy.min_requests_per_window
    # Bounds, step, known-bad configurations, memory rise.
    assert policy.bounds.contains(k)
    assert policy.bounds.within_step(state.applied, k)
    assert is_forbidden(k, state.infeasible) is None
    # Memory: at most one step past what is proven at the candidate's token budget, and one
    # memory experiment at a time (past the proof, never more tokens too).
    memory = state.memory()
    if not memory.covers(k):
        proven = memory.at(k.max_num_batched_tokens)
        assert k.gpu_memory_utilization <= proven + policy.gmu_rise_step + 1e-9
        if k.gpu_memory_utilization > proven + 1e-9:
            assert k.max_num_batched_tokens <= state.applied.max_num_batched_tokens
    assert k.max_num_batched_tokens >= k.max_num_seqs
    # Budget, cooldown, windows.
    rolled = roll_day(state, now)
    assert rolled.rollouts_today < policy.rollout.max_per_day
    assert d.new_state.rollouts_today == rolled.rollouts_today + 1
    if state.last_rollout_at is not None:
        assert (now - state.last_rollout_at).total_seconds() >= policy.rollout.min_interval_s
    if policy.rollout.maintenance_windows:
        assert any(w.contains(now) for w in policy.rollout.maintenance_windows)


@settings(
    max_examples=scaled(150),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario(), st.data())
def test_a_remembered_search_never_smuggles_in_an_unsafe_candidate(
    sc: dict[str, Any], data: st.DataObject
) -> None:
    """A memo whose proposal is anything at all (corrupted, or made under rules that have
    changed since) is held to every safety rule when it is reused."""
    state: TuningState = sc["state"]
    policy = sc["policy"]
    obs: Observation = sc["obs"]
    now: datetime = sc["now"]
    if data.draw(st.integers(0, 3)) > 0:
        # Mostly the steady state in which searches are remembered: usable data of the
        # applied knobs, healthy pods, a mode that tunes.
        state = replace(state, phase="Observing", candidate=None, trials=())
        snap = obs.snapshot if obs.snapshot.available else make_snapshot(time=now)
        snap = replace(snap, knobs=state.applied, completed_requests=5000)
        obs = Observation(snap, (PodHealth(ready=True, revision_knobs=state.applied),))
        policy = replace(policy, mode=data.draw(st.sampled_from(["Recommend", "Auto"])))
    first = decide(state, obs, policy, CTX, now, SharedModel())
    memo = first.search_memo
    if memo is None:
        return
    wide = Bounds(KnobBounds(1, 65536, 65536), KnobBounds(1, 4096, 4096), KnobBounds(0.1, 1.0, 1.0))
    honest = memo.result.best or state.applied
    rogue = data.draw(st.one_of(knobs_in(wide), knobs_in(policy.bounds), st.just(honest)))
    pred = first.prediction or memo.result.current
    forged = replace(
        memo,
        result=replace(memo.result, best=rogue, prediction=pred, worth_rollout=True),
        conclusion=f"forged {rogue.describe()}",
    )
    later = now + timedelta(seconds=data.draw(st.integers(0, 400)))
    d = decide(state, obs, policy, CTX, later, SharedModel(), memo=forged)
    event(f"memo reused: {forged.conclusion in d.reason}")
    assert_safe(d, state, obs, policy, later)


@pytest.mark.parametrize(("max_per_day", "gap_s"), [(0, 0.0), (2, 0.0), (3, 3600.0), (9, 5400.0)])
def test_cooldown_and_budget_over_a_sequence_of_reconciles(max_per_day: int, gap_s: float) -> None:
    """Drive decide() through many reconciles of one day; count the rollouts it starts."""
    from tests.unit.core.test_decide import KNOBS, ready_pods, violating_snapshot

    rules = RolloutRules(
        min_interval_s=gap_s, max_per_day=max_per_day, verify_window_s=0, ready_timeout_s=60
    )
    policy = make_policy("Auto", rollout=rules, min_gain_pct=0.0)
    state = TuningState.initial(KNOBS)
    starts: list[datetime] = []
    now = datetime(2026, 12, 2, 0, 5, tzinfo=UTC)
    while now.day == 2:
        # Pods crash-loop on every candidate: each rollout fails and is rolled back, so the
        # tuner keeps wanting to try again; only the budget and cooldown stop it.
        cand = state.candidate
        pods = ready_pods(state.applied)
        if cand is not None:
            pods = (PodHealth(ready=False, waiting_reason="CrashLoopBackOff", revision_knobs=cand),)
        snap = violating_snapshot(state.applied, time=now)
        d = decide(state, Observation(snap, pods), policy, CTX, now, SharedModel())
        if d.action == "rollout":
            starts.append(now)
        state = d.new_state
        now += timedelta(minutes=20)
    assert len(starts) <= max_per_day
    for a, b in itertools.pairwise(starts):
        assert (b - a).total_seconds() >= gap_s
    # With any budget at all, the tuner did try (the guards are not simply always closed).
    assert (len(starts) > 0) == (max_per_day > 0)
