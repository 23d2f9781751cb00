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
from vllm_autotuner.core.tuning_types import (
    Knobs,
    Measured,
    ModelCheck,
    PodHealth,
    Predicted,
    Recommendation,
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


def test_capacity_is_the_models_for_the_applied_knobs() -> None:
    state = replace(TuningState.initial(KNOBS), model_check=_check(KNOBS, 6.5))
    cap = published_capacity(state)
    assert cap is not None and (cap.per_replica_rps, cap.source, cap.knobs) == (6.5, "Model", KNOBS)
    assert published_capacity(TuningState.initial(KNOBS)) is None  # nothing known yet


def test_capacity_changes_at_once_when_a_configuration_commits() -> None:
    verifying = replace(rolling_state(CAND), phase="Verifying", verify_until=NOW - timedelta(1))
    verifying = replace(
        verifying,
        baseline=Measured(4.0, 300.0, 80.0, None, 0.9, 5.0),
        model_check=_check(KNOBS, 5.0),
        recommendation=Recommendation(CAND, "r", Predicted(9.0, 300.0, 20.0), 80.0, NOW),
    )
    during = published_capacity(verifying)
    assert during is not None and during.source == "Trial" and during.per_replica_rps == 5.0
    snap = make_snapshot(CAND, itl_p95=30.0, time=NOW)
    d = decide(
        verifying, Observation(snap, ready_pods(CAND)), make_policy(), CTX, NOW, AnalyticModel()
    )
    assert d.action == "commit", d.reason
    after = published_capacity(d.new_state)
    assert after is not None and after.knobs == CAND and after.source == "Verified"
    assert d.new_state.baseline is not None
    assert after.per_replica_rps == d.new_state.baseline.capacity_rps
    assert after.per_replica_rps != during.per_replica_rps


def test_a_trial_publishes_the_lower_of_last_good_and_candidate() -> None:
    state = replace(
        rolling_state(CAND),
        baseline=Measured(4.0, capacity_rps=7.0),
        recommendation=Recommendation(CAND, "r", Predicted(3.0, 300.0, 20.0), 5.0, NOW),
    )
    cap = published_capacity(state)
    assert cap is not None and (cap.per_replica_rps, cap.source) == (3.0, "Trial")


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
