"""Living beside a replica autoscaler (core/autoscaling.py): the count of the moment, its motion,
the tuner's hold while it moves, the capacity published for the autoscaler, and who owns a
Deployment's spec.replicas."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.core.test_decide import (
    CTX,
    KNOBS,
    NOW,
    make_policy,
    make_snapshot,
    ready_pods,
    rolling_state,
    violating_snapshot,
)
from tests.unit.core.test_decide_properties import assert_safe, scenario
from vllm_autotuner.core.autoscaling import (
    owns_replicas,
    published_capacity,
    replicas_now,
    scaling_from_status,
    scaling_to_status,
    serving_pods,
    spans_change,
    track,
)
from vllm_autotuner.core.decide import decide
from vllm_autotuner.core.economics import keep_time_s, replicas_freed_requests, worth_restart
from vllm_autotuner.core.perf_model import AnalyticModel
from vllm_autotuner.core.rollout import pod_failure
from vllm_autotuner.core.snapshot import Observation, Scaling
from vllm_autotuner.core.topology import Topology
from vllm_autotuner.core.tuning_types import (
    CanaryAnalysis,
    Knobs,
    Measured,
    ModelCheck,
    PodHealth,
    Predicted,
    Recommendation,
    Trial,
    TuningState,
)

CAND = Knobs(1024, 1024, 0.92)
MOVING = Scaling(3, 2, NOW - timedelta(seconds=20), None)


# ----------------------------------------------------------------------- count and motion


def test_the_count_of_the_moment_is_the_live_deployments_when_an_autoscaler_owns_it() -> None:
    live = {"spec": {"replicas": 5}}
    assert replicas_now("Deployment", 2, live) == 5
    assert replicas_now("Deployment", 2, None) == 2  # not created yet: the initial size
    assert replicas_now("Deployment", 2, {"spec": {}}) == 2
    assert replicas_now("VLLMDeployment", 2, live) == 2  # the VLLMDeployment's own count


def test_a_change_moves_until_the_serving_pods_match_it() -> None:
    first = track(None, 2, 2, 2, NOW)
    assert first == Scaling(2) and not first.moving  # the first look is no change
    t1 = NOW + timedelta(seconds=30)
    up = track(first, 3, 2, 3, t1)
    assert up.moving and (up.previous, up.changed_at) == (2, t1)
    t2 = t1 + timedelta(seconds=30)
    still = track(up, 3, 2, 3, t2)
    assert still == up  # nothing new: the same record, so status is not rewritten
    t3 = t2 + timedelta(seconds=30)
    settled = track(still, 3, 3, 3, t3)
    assert not settled.moving and settled.settled_at == t3 and settled.changed_at == t1
    down = track(settled, 1, 3, 1, t3 + timedelta(seconds=1))
    assert down.moving and down.previous == 3  # the old settle time stays, before the change


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=30
    )
)
def test_moving_means_changed_and_not_yet_matched(looks: list[tuple[int, int, int]]) -> None:
    """Against a reference: the count moves exactly when it changed and no look since the
    change (the change's own included) found the serving pods at the expected number."""
    s: Scaling | None = None
    changed, matched = False, False
    last: int | None = None
    for i, (replicas, serving, expected) in enumerate(looks):
        s = track(s, replicas, serving, expected, NOW + timedelta(seconds=i))
        if last is not None and replicas != last:
            changed, matched = True, False
        if changed and serving == expected:
            matched = True
        last = replicas
        assert s.replicas == replicas
        assert s.moving == (changed and not matched)
        assert scaling_from_status(scaling_to_status(s, "VLLMDeployment")) == s


def test_serving_pods_are_ready_and_not_terminating() -> None:
    def pod(ready: bool, deleting: bool = False) -> dict[str, Any]:
        meta = {"deletionTimestamp": "2026-12-02T12:00:00Z"} if deleting else {}
        cond = {"type": "Ready", "status": "True" if ready else "False"}
        return {"metadata": meta, "status": {"conditions": [cond]}}

    assert serving_pods([pod(True), pod(True, deleting=True), pod(False), {}]) == 1


# ----------------------------------------------------------------------------- the hold


def _obs(snap: Any, pods: tuple[PodHealth, ...], scaling: Scaling | None) -> Observation:
    return Observation(snap, pods, scaling=scaling)


def test_no_rollout_starts_while_the_count_moves_and_one_does_after() -> None:
    state = TuningState.initial(KNOBS)
    snap = violating_snapshot(time=NOW)
    wanted = decide(
        state, _obs(snap, ready_pods(KNOBS), None), make_policy(), CTX, NOW, AnalyticModel()
    )
    assert wanted.action == "rollout", wanted.reason
    d = decide(
        state, _obs(snap, ready_pods(KNOBS), MOVING), make_policy(), CTX, NOW, AnalyticModel()
    )
    assert d.action == "hold" and d.knobs_to_apply is None
    assert "moves from 2 to 3" in d.reason and d.new_state.phase == "Holding"
    settled = Scaling(3, 2, NOW - timedelta(seconds=500), NOW - timedelta(seconds=400))
    after = decide(
        state, _obs(snap, ready_pods(KNOBS), settled), make_policy(), CTX, NOW, AnalyticModel()
    )
    assert after.action == "rollout", after.reason


def test_a_window_that_spans_the_change_is_not_judged() -> None:
    state = TuningState.initial(KNOBS)
    snap = violating_snapshot(time=NOW)  # a 300 s window: it began at NOW - 300 s
    settled = Scaling(3, 2, NOW - timedelta(seconds=150), NOW - timedelta(seconds=100))
    assert spans_change(_obs(snap, (), settled), settled)
    d = decide(
        state, _obs(snap, ready_pods(KNOBS), settled), make_policy(), CTX, NOW, AnalyticModel()
    )
    assert d.action == "hold" and "window began before the replica count settled" in d.reason


def test_a_verdict_waits_and_its_window_is_extended() -> None:
    verifying = replace(rolling_state(CAND), phase="Verifying", verify_until=NOW - timedelta(1))
    verifying = replace(verifying, baseline=Measured(4.0, 300.0, 80.0, None, 0.9, 1.0))
    snap = make_snapshot(CAND, itl_p95=30.0, time=NOW)
    policy = make_policy()
    plain = decide(verifying, _obs(snap, ready_pods(CAND), None), policy, CTX, NOW, AnalyticModel())
    assert plain.action == "commit", plain.reason
    d = decide(verifying, _obs(snap, ready_pods(CAND), MOVING), policy, CTX, NOW, AnalyticModel())
    assert d.action == "verify" and d.new_state.phase == "Verifying"
    assert d.new_state.verify_until is not None
    assert d.new_state.verify_until >= NOW + timedelta(seconds=policy.evaluation_window_s)
    assert d.new_state.trials == verifying.trials  # nothing concluded


def test_a_crashing_candidate_goes_back_whatever_the_count_does() -> None:
    verifying = replace(rolling_state(CAND), phase="Verifying", verify_until=NOW)
    oom = (
        PodHealth(
            ready=False, restarts=1, last_termination_reason="OOMKilled", revision_knobs=CAND
        ),
    )
    d = decide(
        verifying, _obs(make_snapshot(CAND), oom, MOVING), make_policy(), CTX, NOW, AnalyticModel()
    )
    assert d.action == "rollback" and d.new_state.trials[-1].outcome == "OOMKilled"


def test_a_rollout_under_way_keeps_counting_its_pods() -> None:
    rolling = rolling_state(CAND)
    pods = ready_pods(CAND)
    at = NOW + timedelta(seconds=120)
    plain = decide(
        rolling, _obs(make_snapshot(CAND), pods, None), make_policy(), CTX, at, AnalyticModel()
    )
    moving = decide(
        rolling, _obs(make_snapshot(CAND), pods, MOVING), make_policy(), CTX, at, AnalyticModel()
    )
    assert plain == moving and moving.action == "verify"


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario(), st.integers(0, 600), st.booleans())
def test_nothing_is_started_or_concluded_on_a_moving_count(
    sc: dict[str, Any], ago: int, moving: bool
) -> None:
    """Whatever the state and the window: while the count moves, or when the window began
    before it settled, decide() never rolls out, promotes or commits, and stays safe."""
    state: TuningState = sc["state"]
    now: datetime = sc["now"]
    obs: Observation = sc["obs"]
    changed = now - timedelta(seconds=ago + 1)
    scaling = Scaling(3, 2, changed, None if moving else changed + timedelta(seconds=ago))
    if not moving and not spans_change(replace(obs, scaling=scaling), scaling):
        return  # a clean window after the change: decide as usual
    obs = replace(obs, scaling=scaling)
    d = decide(state, obs, sc["policy"], CTX, now, AnalyticModel())
    assert_safe(d, state, obs, sc["policy"], now)
    if state.phase in ("RollingOut", "Promoting"):
        return  # progress is counted against the count of the moment
    assert d.action in ("hold", "verify", "rollback"), d.reason
    if d.action == "rollback":  # only a failing candidate (or committed configuration)
        watched = state.candidate if state.candidate is not None else state.applied
        assert pod_failure(obs.pods, watched) is not None, d.reason


# ----------------------------------------------------------------------------- capacity


def _check(knobs: Knobs, cap: float) -> ModelCheck:
    return ModelCheck(NOW, knobs, 3.0, cap, 0.8, 0.8, 0.01, True)


ONE = Topology(KNOBS, 1)


def _rec(knobs: Knobs, cap: float) -> Recommendation:
    return Recommendation(knobs, "r", Predicted(cap, 300.0, 20.0), 50.0, NOW)


def _canary(
    base: float, cand: float, stable: int, surge: int, analysed: float | None = None
) -> tuple[TuningState, Topology]:
    """A canary of CAND beside `stable` pods of KNOBS (their capacity `base`), the candidate
    predicted at `cand` and, once the window is judged, measured at `analysed`."""
    state = TuningState(
        applied=KNOBS,
        last_good=KNOBS,
        phase="Verifying",
        candidate=CAND,
        strategy="Canary",
        rollout_started_at=NOW,
        model_check=_check(KNOBS, base),
        recommendation=_rec(CAND, cand),
        analysis=None
        if analysed is None
        else CanaryAnalysis(
            NOW, 300.0, Measured(4.0), Measured(4.0, capacity_rps=analysed), "", ""
        ),
    )
    return state, Topology(KNOBS, stable, CAND, surge)


def test_capacity_is_the_models_for_the_applied_knobs() -> None:
    state = replace(TuningState.initial(KNOBS), model_check=_check(KNOBS, 6.5))
    cap = published_capacity(state, ONE)
    assert cap is not None and (cap.per_replica_rps, cap.source, cap.knobs) == (6.5, "Model", KNOBS)
    assert published_capacity(TuningState.initial(KNOBS), ONE) is None  # nothing known yet


def test_capacity_changes_at_once_when_a_configuration_commits() -> None:
    verifying = replace(rolling_state(CAND), phase="Verifying", verify_until=NOW - timedelta(1))
    verifying = replace(
        verifying,
        baseline=Measured(4.0, 300.0, 80.0, None, 0.9, 5.0),
        model_check=_check(KNOBS, 5.0),
        recommendation=_rec(CAND, 9.0),
    )
    topo = Topology(CAND, 1)
    during = published_capacity(verifying, topo)
    assert during is not None and during.source == "Trial" and during.per_replica_rps == 5.0
    snap = make_snapshot(CAND, itl_p95=30.0, time=NOW)
    d = decide(
        verifying, Observation(snap, ready_pods(CAND)), make_policy(), CTX, NOW, AnalyticModel()
    )
    assert d.action == "commit", d.reason
    after = published_capacity(d.new_state, topo)
    assert after is not None and after.knobs == CAND and after.source == "Verified"
    assert d.new_state.baseline is not None
    assert after.per_replica_rps == d.new_state.baseline.capacity_rps
    assert after.per_replica_rps != during.per_replica_rps


def test_a_rolling_trial_publishes_the_lower_of_last_good_and_candidate() -> None:
    state = replace(rolling_state(CAND), model_check=_check(KNOBS, 7.0))
    state = replace(state, recommendation=_rec(CAND, 3.0))
    cap = published_capacity(state, Topology(CAND, 4, None, 1))
    assert cap is not None and (cap.per_replica_rps, cap.source) == (3.0, "Trial")
    better = published_capacity(replace(state, recommendation=_rec(CAND, 30.0)), ONE)
    assert better is not None and better.per_replica_rps == 7.0  # a trial can still roll back


def test_a_surge_canary_leaves_the_count_at_the_last_good_capacity() -> None:
    """The surge pod is on top of the count and leaves with the trial: per replica of the
    count, the fleet carries what the stable pods carry, however good or bad the candidate."""
    for cand, analysed in ((40.0, None), (2.0, None), (40.0, 1.0)):
        state, topo = _canary(20.0, cand, stable=3, surge=1, analysed=analysed)
        cap = published_capacity(state, topo)
        assert cap is not None and (cap.per_replica_rps, cap.source) == (20.0, "Trial")
        assert cap.knobs == KNOBS  # the knobs the stable pods run


def test_a_canary_that_takes_a_stable_pods_place_weighs_in_at_its_lower_capacity() -> None:
    """Without surge, one of the count's 4 pods is the canary: 3 at 20 req/s and the canary at
    the lower of its 8 req/s and 20 req/s give 17 per replica; a better canary counts at 20,
    never more (it is not verified yet)."""
    worse, topo = _canary(20.0, 8.0, stable=3, surge=0)
    cap = published_capacity(worse, topo)
    assert cap is not None and cap.per_replica_rps == pytest.approx((3 * 20.0 + 8.0) / 4)
    better, topo = _canary(20.0, 40.0, stable=3, surge=0)
    assert published_capacity(better, topo) == published_capacity(replace(better), topo)
    cap = published_capacity(better, topo)
    assert cap is not None and cap.per_replica_rps == pytest.approx(20.0)
    # The judged window's own capacity replaces the prediction once there is one.
    judged, topo = _canary(20.0, 40.0, stable=3, surge=0, analysed=4.0)
    cap = published_capacity(judged, topo)
    assert cap is not None and cap.per_replica_rps == pytest.approx((3 * 20.0 + 4.0) / 4)
    alone, topo = _canary(20.0, 8.0, stable=0, surge=0)  # one replica: the canary is all of it
    cap = published_capacity(alone, topo)
    assert cap is not None and cap.per_replica_rps == pytest.approx(8.0)


def test_a_commit_without_a_measured_capacity_keeps_a_number() -> None:
    """A canary promoted early (it fixed the baseline's violation) commits without a capacity
    of its own: the number stays published (the lower of the replaced knobs' and the
    candidate's prediction) instead of falling to the autoscaler's fallback."""
    state = TuningState(
        applied=CAND,
        last_good=CAND,
        phase="Committed",
        baseline=Measured(4.0),
        model_check=_check(KNOBS, 12.0),
        recommendation=_rec(CAND, 30.0),
        trials=(Trial(1, CAND, NOW, NOW + timedelta(minutes=20), "Committed"),),
    )
    cap = published_capacity(state, ONE)
    assert cap is not None and (cap.per_replica_rps, cap.source, cap.knobs) == (
        12.0,
        "Verified",
        CAND,
    )
    assert cap.time == NOW + timedelta(minutes=20)


def test_a_canary_rollback_publishes_the_last_good_capacity_at_once() -> None:
    state, _ = _canary(20.0, 8.0, stable=3, surge=0)
    crashed = (
        *ready_pods(KNOBS, 3),
        PodHealth(ready=False, revision_knobs=CAND, name="c", restarts=3,
                  waiting_reason="CrashLoopBackOff"),
    )  # fmt: skip
    d = decide(
        state, Observation(make_snapshot(), crashed), make_policy(), CTX, NOW, AnalyticModel()
    )
    assert d.action == "rollback", d.reason
    after = published_capacity(d.new_state, Topology(KNOBS, 4))
    assert after is not None and (after.per_replica_rps, after.knobs) == (20.0, KNOBS)


CAPACITIES = st.one_of(st.none(), st.floats(0.5, 60.0))


@st.composite
def trial_states(draw: st.DrawFn) -> tuple[TuningState, Topology, float | None, float | None]:
    """Any state a published number can come from: no trial, a rolling trial, a canary in any
    phase, promoted; the last good knobs' capacity and the candidate's known or not. Also the
    last good and candidate capacities it was built with."""
    base, cand, analysed = draw(CAPACITIES), draw(CAPACITIES), draw(CAPACITIES)
    kind = draw(st.sampled_from(["none", "rolling", "canary", "promoting"]))
    phase = {"none": draw(st.sampled_from(["Idle", "Observing", "Committed", "RolledBack"])),
             "rolling": draw(st.sampled_from(["RollingOut", "Verifying"])),
             "canary": draw(st.sampled_from(["RollingOut", "Verifying"])),
             "promoting": "Promoting"}[kind]  # fmt: skip
    check_on = draw(st.sampled_from([KNOBS, CAND]))  # CAND: a check of other knobs
    committed = draw(st.booleans())  # the last good knobs came from a trial
    state = TuningState(
        applied=KNOBS if kind in ("none", "canary") else CAND,
        last_good=KNOBS,
        phase=phase,  # type: ignore[arg-type]
        candidate=None if kind == "none" else CAND,
        strategy="Canary" if kind in ("canary", "promoting") else "Rolling",
        rollout_started_at=None if kind == "none" else NOW,
        model_check=None if base is None else _check(check_on, base),
        baseline=draw(st.sampled_from([None, Measured(4.0, capacity_rps=base)])),
        recommendation=None if cand is None else _rec(CAND, cand),
        trials=(Trial(1, KNOBS, NOW, NOW, "Committed"),) if committed else (),
        analysis=None
        if analysed is None or kind == "rolling"
        else CanaryAnalysis(
            NOW, 300.0, Measured(4.0), Measured(4.0, capacity_rps=analysed), "", ""
        ),
    )
    surge = draw(st.integers(0, 2))  # a canary runs beside at least one replica's worth
    stable = draw(st.integers(1 if surge else 0, 8))
    topo = Topology(state.applied, stable, CAND if kind == "canary" else None, surge)
    good = None
    if base is not None and (check_on == KNOBS or state.baseline is not None or committed):
        good = base
    can = analysed if state.analysis is not None and analysed is not None else cand
    return state, topo, good, can


@given(trial_states())
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_the_published_capacity_never_promises_more_than_the_pods_can_carry(
    drawn: tuple[TuningState, Topology, float | None, float | None],
) -> None:
    """For the knobs the stable pods run; equal to the last good knobs' when no trial runs;
    during a trial never above the last good knobs' capacity (a candidate that fails later was
    never promised) nor below the lower of the two, so never above the higher of the two."""
    state, topo, good, cand = drawn
    cap = published_capacity(state, topo)
    in_trial = state.candidate is not None
    if cap is None:  # nothing known of what the pods carry
        assert good is None and (not in_trial or cand is None or topo.canary is not None)
        return
    assert cap.knobs == state.applied and cap.per_replica_rps > 0
    if not in_trial:
        assert good is None or cap.per_replica_rps == good
        assert cap.source in ("Model", "Verified")
        return
    assert cap.source == "Trial"
    known = [c for c in (good, cand) if c is not None]
    assert min(known) - 1e-9 <= cap.per_replica_rps <= max(known) + 1e-9
    if good is not None:
        assert cap.per_replica_rps <= good + 1e-9
    if topo.canary is not None and topo.max_surge > 0 and good is not None:
        assert cap.per_replica_rps == good  # a surge canary adds nothing to the count


# ----------------------------------------------------------------------------- ownership


@pytest.mark.parametrize(
    ("entries", "owned"),
    [
        ([{"manager": "vllm-autotuner", "operation": "Apply",
           "fieldsV1": {"f:spec": {"f:replicas": {}, "f:template": {}}}}], True),
        ([{"manager": "vllm-autotuner", "operation": "Apply",
           "fieldsV1": {"f:spec": {"f:template": {}}}}], False),
        ([{"manager": "vllm-autotuner", "operation": "Update", "subresource": "status",
           "fieldsV1": {"f:spec": {"f:replicas": {}}}}], False),
        ([{"manager": "hpa", "operation": "Update", "subresource": "scale",
           "fieldsV1": {"f:spec": {"f:replicas": {}}}}], False),
        (None, False),
    ],
)  # fmt: skip
def test_who_owns_the_replica_count(entries: list[dict[str, Any]] | None, owned: bool) -> None:
    assert owns_replicas(entries, "vllm-autotuner") is owned


# ----------------------------------------------------------------------------- economics


def test_beside_an_autoscaler_more_capacity_is_worth_the_replicas_it_frees() -> None:
    """Below capacity a pod serves no more with better knobs; an autoscaler then gives back
    replicas: at 8 req/s/pod on 3 pods, capacity 14 -> 30 frees 53 % of the GPU time."""
    rules = make_policy().rollout
    canary = replace(CTX, replicas=3, rollout=replace(CTX.rollout, max_surge=0))
    plain = worth_restart(canary, rules, "Canary", 14.0, 30.0, 8.0, 8.0)
    assert plain.gain_requests == 0 and not plain.worth
    scaled = worth_restart(replace(canary, autoscaled=True), rules, "Canary", 14.0, 30.0, 8.0, 8.0)
    keep = keep_time_s(rules)
    assert scaled.gain_requests == pytest.approx(8.0 * 3 * keep * (1 - 14.0 / 30.0))
    assert scaled.worth and "53% fewer replicas" in scaled.text
    worse = worth_restart(replace(canary, autoscaled=True), rules, "Canary", 14.0, 12.0, 8.0, 8.0)
    assert worse.gain_requests == 0 and not worse.worth


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.1, 100.0),
    st.floats(0.1, 100.0),
    st.floats(0.1, 100.0),
    st.floats(0.0, 50.0),
    st.integers(1, 16),
)
def test_freed_replicas_grow_with_the_new_capacity(
    now: float, new: float, more: float, rate: float, replicas: int
) -> None:
    ctx = replace(CTX, replicas=replicas, autoscaled=True)
    low = replicas_freed_requests(now, new, rate, ctx, 3600.0)
    high = replicas_freed_requests(now, new + more, rate, ctx, 3600.0)
    assert 0.0 <= low <= high <= rate * replicas * 3600.0 + 1e-6
    assert (low > 0) == (new > now and rate > 0)
