"""decide(): the tuning loop's state machine, one reconcile at a time (table-driven).

The builders at the top are shared by the other core tuner tests (diagnosis, search, rollout,
properties), so every test speaks about the same synthetic deployment: Llama-3.1-8B on H100.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.unit.core.shared_model import SharedModel
from vllm_autotuner.core.decide import Decision, decide
from vllm_autotuner.core.memory import ProvenMemory
from vllm_autotuner.core.snapshot import (
    KVCacheInfo,
    LatencySummary,
    LengthSummary,
    Observation,
    Snapshot,
)
from vllm_autotuner.core.tuning_types import (
    SLO,
    Bounds,
    DeploymentContext,
    InfeasibleConfig,
    KnobBounds,
    Knobs,
    Measured,
    Mode,
    PodHealth,
    RolloutRules,
    RolloutSettings,
    SLOTarget,
    Trial,
    TuningPolicy,
    TuningState,
)

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
# One replica with surge: a restart costs no capacity and needs no headroom, so these tests
# are about the tuner's judgement; tests/unit/core/test_hitless.py covers surge-free pods.
CTX = DeploymentContext(
    model="meta-llama/Llama-3.1-8B-Instruct",
    gpu_product="H100",
    rollout=RolloutSettings(max_surge=1),
)
KNOBS = Knobs(8192, 1024, 0.92)
SLO_DEFAULT = SLO(ttft=SLOTarget(95.0, 1000.0), itl=SLOTarget(95.0, 50.0))
BOUNDS = Bounds(
    mnbt=KnobBounds(256, 16384, 7168),
    mns=KnobBounds(8, 1024, 256),
    gmu=KnobBounds(0.5, 0.95, 0.03),
)


def make_policy(mode: Mode = "Auto", **kw: Any) -> TuningPolicy:
    rules = kw.pop("rollout", RolloutRules(min_interval_s=1800, max_per_day=4))
    return TuningPolicy(
        slo=kw.pop("slo", SLO_DEFAULT),
        bounds=kw.pop("bounds", BOUNDS),
        rollout=rules,
        min_requests_per_window=kw.pop("min_requests", 200),
        mode=mode,
        **kw,
    )


def make_snapshot(
    knobs: Knobs = KNOBS,
    *,
    rate: float = 4.0,
    completed: int = 1200,
    ttft_p95: float = 400.0,
    itl_p95: float = 30.0,
    itl_mean: float = 20.0,
    kv_max: float = 0.5,
    preemption_rate: float = 0.0,
    running_max: float = 60.0,
    waiting_mean: float = 0.0,
    prompt: tuple[float, float] = (1000.0, 2000.0),
    gen: tuple[float, float] = (200.0, 400.0),
    **kw: Any,
) -> Snapshot:
    """A snapshot of one healthy-looking pod; override what a test is about."""
    return Snapshot(
        time=kw.pop("time", NOW),
        window_s=300.0,
        knobs=knobs,
        num_pods=kw.pop("num_pods", 1),
        request_rate=rate,
        completed_requests=completed,
        ttft=LatencySummary(p50_ms=ttft_p95 / 3.0, p95_ms=ttft_p95, p99_ms=ttft_p95 * 1.5),
        itl=LatencySummary(p50_ms=itl_mean * 0.9, p95_ms=itl_p95, mean_ms=itl_mean),
        e2e=LatencySummary(p95_ms=ttft_p95 + gen[1] * itl_mean),
        kv_usage_mean=kv_max * 0.7,
        kv_usage_max=kv_max,
        preemption_rate=preemption_rate,
        running_mean=running_max * 0.6,
        running_max=running_max,
        waiting_mean=waiting_mean,
        waiting_max=waiting_mean * 3,
        prompt_len=LengthSummary(prompt[0], prompt[0] * 0.8, prompt[1]),
        generation_len=LengthSummary(gen[0], gen[0] * 0.8, gen[1]),
        kv_cache=kw.pop(
            "kv_cache",
            KVCacheInfo(
                num_gpu_blocks=25000,
                block_size=16,
                gpu_memory_utilization=knobs.gpu_memory_utilization,
            ),
        ),
        **kw,
    )


def violating_snapshot(knobs: Knobs = KNOBS, **kw: Any) -> Snapshot:
    """ITL well over its 50 ms SLO: the tuner should want to shrink the step."""
    return make_snapshot(knobs, itl_p95=kw.pop("itl_p95", 80.0), itl_mean=25.0, **kw)


def ready_pods(knobs: Knobs, n: int = 1) -> tuple[PodHealth, ...]:
    return tuple(PodHealth(ready=True, revision_knobs=knobs, name=f"p{i}") for i in range(n))


def run(
    state: TuningState,
    snap: Snapshot,
    policy: TuningPolicy | None = None,
    now: datetime = NOW,
    pods: tuple[PodHealth, ...] | None = None,
) -> Decision:
    knobs = snap.knobs or state.applied
    return decide(
        state,
        Observation(snap, ready_pods(knobs) if pods is None else pods),
        policy or make_policy(),
        CTX,
        now,
        SharedModel(),
    )


SMALL_STEP = Knobs(1024, 1024, 0.92)


def rolling_state(cand: Knobs = SMALL_STEP, **kw: Any) -> TuningState:
    """A state one reconcile after a rollout of `cand` started at NOW."""
    d = run(TuningState.initial(KNOBS), violating_snapshot())
    assert d.action == "rollout", d.reason
    assert d.knobs_to_apply is not None
    state = d.new_state
    if not d.knobs_to_apply.same_as(cand):
        state = replace(state, applied=cand, candidate=cand, trials=(Trial(1, cand, NOW),))
    return replace(state, **kw)


# ------------------------------------------------------------------------------------- tests


def test_a_violation_in_auto_mode_starts_a_rollout_with_a_reason_and_an_event() -> None:
    d = run(TuningState.initial(KNOBS), violating_snapshot())
    assert d.action == "rollout"
    assert d.knobs_to_apply is not None
    assert d.knobs_to_apply.max_num_batched_tokens < KNOBS.max_num_batched_tokens
    assert "ITL p95 80 ms > 50 ms" in d.reason
    s = d.new_state
    assert (s.phase, s.rollouts_today, s.last_rollout_at) == ("RollingOut", 1, NOW)
    assert s.applied == d.knobs_to_apply == s.candidate
    assert s.last_good == KNOBS
    assert s.trials[-1].outcome == "Pending"
    assert [e.reason for e in d.events] == ["RolloutStarted"]


def test_recommend_mode_publishes_but_never_applies() -> None:
    d = run(TuningState.initial(KNOBS), violating_snapshot(), make_policy("Recommend"))
    assert d.action == "recommend"
    assert d.knobs_to_apply is None
    assert d.new_state.applied == KNOBS
    assert d.new_state.recommendation is not None
    assert d.new_state.recommendation.knobs.max_num_batched_tokens < 8192
    assert d.events and d.events[0].reason == "TuningRecommendation"
    # The same recommendation again is not a new Event.
    again = run(d.new_state, violating_snapshot(), make_policy("Recommend"))
    assert again.action == "recommend"
    assert again.events == ()


def test_off_mode_never_acts_but_reports() -> None:
    d = run(TuningState.initial(KNOBS), violating_snapshot(), make_policy("Off"))
    assert (d.action, d.knobs_to_apply, d.new_state.phase) == ("hold", None, "Idle")
    assert "Off" in d.reason and "8192" in d.reason


@pytest.mark.parametrize(
    ("snap", "expected"),
    [
        (violating_snapshot(completed=37), "not enough data: 37 of 200 requests"),
        (Snapshot.unavailable(NOW, 300, "Prometheus unreachable"), "Prometheus unreachable"),
        (violating_snapshot(Knobs(4096, 1024, 0.92)), "mixed revisions"),
    ],
)
def test_no_action_on_unusable_data(snap: Snapshot, expected: str) -> None:
    d = run(TuningState.initial(KNOBS), snap, pods=ready_pods(KNOBS))
    assert d.action == "hold"
    assert d.knobs_to_apply is None
    assert expected in d.reason


def test_idle_traffic_holds() -> None:
    d = run(TuningState.initial(KNOBS), make_snapshot(rate=0.0, completed=300))
    assert d.action == "hold" and d.new_state.phase == "Idle"
    assert "too little traffic" in d.reason


# (phase setup, pods, snapshot, time offset) → (action, phase, trial outcome)
def _transitions() -> list[tuple[str, TuningState, Any, Any, float, str, str, str | None]]:
    cand = Knobs(1024, 1024, 0.92)
    rolling = rolling_state(cand)
    verifying = replace(rolling, phase="Verifying", verify_until=NOW + timedelta(seconds=600))
    verifying = replace(verifying, baseline=Measured(4.0, 300.0, 80.0, None, 0.9, 1.0))
    good = make_snapshot(cand, itl_p95=30.0)
    bad = make_snapshot(cand, itl_p95=120.0, itl_mean=60.0)
    half = (PodHealth(ready=True, revision_knobs=cand), PodHealth(ready=False, revision_knobs=cand))
    crash = (
        PodHealth(
            ready=False,
            restarts=4,
            waiting_reason="CrashLoopBackOff",
            last_termination_reason="Error",
            revision_knobs=cand,
        ),
    )
    oom = (
        PodHealth(
            ready=False, restarts=1, last_termination_reason="OOMKilled", revision_knobs=cand
        ),
    )
    old = ready_pods(KNOBS)
    return [
        ("ready", rolling, ready_pods(cand), good, 120, "verify", "Verifying", "Pending"),
        ("waiting", rolling, (*old, *half[1:]), good, 120, "hold", "RollingOut", "Pending"),
        ("timeout", rolling, half[1:], good, 901, "rollback", "RolledBack", "NotReady"),
        ("crashloop", rolling, crash, good, 60, "rollback", "RolledBack", "Crashed"),
        ("oom", rolling, oom, good, 60, "rollback", "RolledBack", "OOMKilled"),
        ("verify early", verifying, ready_pods(cand), good, 300, "verify", "Verifying", "Pending"),
        ("commit", verifying, ready_pods(cand), good, 601, "commit", "Committed", "Committed"),
        ("regress", verifying, ready_pods(cand), bad, 601, "rollback", "RolledBack", "RolledBack"),
        ("oom verify", verifying, oom, good, 300, "rollback", "RolledBack", "OOMKilled"),
        (
            "no data",
            verifying,
            ready_pods(cand),
            violating_snapshot(cand, completed=5),
            700,
            "verify",
            "Verifying",
            "Pending",
        ),
        (
            "gave up",
            verifying,
            ready_pods(cand),
            violating_snapshot(cand, completed=5),
            1300,
            "rollback",
            "RolledBack",
            "RolledBack",
        ),
    ]


@pytest.mark.parametrize(
    ("name", "state", "pods", "snap", "dt", "action", "phase", "outcome"),
    _transitions(),
    ids=[t[0] for t in _transitions()],
)
def test_rollout_state_machine(
    name: str,
    state: TuningState,
    pods: tuple[PodHealth, ...],
    snap: Snapshot,
    dt: float,
    action: str,
    phase: str,
    outcome: str | None,
) -> None:
    d = run(state, snap, now=NOW + timedelta(seconds=dt), pods=pods)
    assert (d.action, d.new_state.phase) == (action, phase), d.reason
    assert d.new_state.trials[-1].outcome == outcome
    assert d.reason
    if action == "rollback":
        assert d.knobs_to_apply == state.last_good
        assert d.new_state.applied == state.last_good
        assert d.events[0].type == "Warning"
        assert state.recommendation is not None
        assert d.new_state.recommendation is None  # the failed proposal is not recommended
        if outcome in ("NotReady", "Crashed", "OOMKilled"):
            assert d.new_state.infeasible[-1].knobs == state.candidate
            assert d.new_state.infeasible[-1].kind == outcome
    elif action == "commit":
        assert d.knobs_to_apply is None
        assert d.new_state.last_good == state.candidate == d.new_state.applied
        assert d.new_state.baseline is not None
        assert d.new_state.trials[-1].measured is not None
    else:
        assert d.knobs_to_apply is None


def _window_served(cand: Knobs, **kw: Any) -> TuningState:
    """A rolling trial of `cand` whose verify window ends now, with 0.92 proven stable."""
    return replace(
        rolling_state(cand),
        phase="Verifying",
        verify_until=NOW,
        proven_memory=ProvenMemory.of([(cand.max_num_batched_tokens, 0.92)]),
        **kw,
    )


def test_commit_proves_the_candidates_memory_at_its_token_budget() -> None:
    cand = Knobs(8192, 1024, 0.94)
    state = _window_served(cand)
    d = run(state, make_snapshot(cand), now=NOW + timedelta(seconds=1), pods=ready_pods(cand))
    assert d.action == "commit", d.reason
    assert d.new_state.stable_gmu() == pytest.approx(0.94)
    assert d.new_state.memory().covers(cand)
    assert d.new_state.memory().at(8192) == pytest.approx(0.94)


def test_a_violation_at_another_load_is_judged_against_the_model_at_that_load() -> None:
    """Four times the baseline's load: "no worse than the baseline measured at 1 req/s" is no
    evidence. The candidate is kept only if it beats what the model, calibrated on the
    baseline's window, says the previous knobs would do at 4 req/s."""
    cand = Knobs(1024, 1024, 0.92)
    base_window = make_snapshot(KNOBS, rate=1.0, itl_p95=30.0, itl_mean=15.0)
    observed = run(TuningState.initial(KNOBS), base_window).new_state
    state = replace(
        rolling_state(cand),
        phase="Verifying",
        verify_until=NOW,
        calibration=observed.calibration,
        baseline=Measured(1.0, 300.0, 30.0, None, 0.99, 2.0),
    )
    snap = make_snapshot(cand, rate=4.0, itl_p95=60.0, itl_mean=30.0, prompt=(3000.0, 6000.0))
    d = run(state, snap, now=NOW + timedelta(seconds=1), pods=ready_pods(cand))
    assert "previous knobs would" in d.reason, d.reason
    assert "at 4.00 req/s/pod" in d.reason
    assert d.action in ("commit", "rollback")


def test_cooldown_daily_budget_and_window_block_a_rollout() -> None:
    state = replace(TuningState.initial(KNOBS), last_rollout_at=NOW - timedelta(minutes=10))
    d = run(state, violating_snapshot())
    assert d.action == "hold" and "cooldown" in d.reason and d.knobs_to_apply is None
    assert d.new_state.recommendation is not None  # still published

    state = replace(TuningState.initial(KNOBS), rollouts_today=4, rollout_day="2026-12-02")
    d = run(state, violating_snapshot())
    assert d.action == "hold" and "daily budget" in d.reason
    # A new UTC day resets the budget.
    d = run(state, violating_snapshot(), now=NOW + timedelta(days=1))
    assert d.action == "rollout" and d.new_state.rollouts_today == 1


def test_state_survives_a_json_round_trip_mid_rollout() -> None:
    state = rolling_state()
    state = state.with_infeasible(InfeasibleConfig(Knobs(16384, 1024, 0.95), "OOMKilled", NOW))
    wire = json.loads(json.dumps(state.to_dict()))
    back = TuningState.from_dict(wire)
    assert back.to_dict() == state.to_dict()
    assert set(wire) >= {"phase", "applied", "lastGood", "candidate", "trials", "infeasible"}
    # A restarted operator continues the same rollout rather than starting another.
    d = run(
        back,
        make_snapshot(back.applied),
        now=NOW + timedelta(seconds=60),
        pods=ready_pods(back.applied),
    )
    assert d.action == "verify"


def test_trials_and_infeasible_lists_are_bounded() -> None:
    state = TuningState.initial(KNOBS)
    for i in range(30):
        state = state.with_trial(Trial(state.next_trial_id(), KNOBS, NOW, outcome="Committed"))
        state = state.with_infeasible(InfeasibleConfig(KNOBS, f"r{i}", NOW))
    state = state.with_infeasible(InfeasibleConfig(KNOBS, "last", NOW))
    assert len(state.trials) == 20 and state.trials[-1].id == 30
    assert len(state.infeasible) <= 50 and state.infeasible[-1].reason == "last"


def test_engine_backed_decide_fixes_a_violation_the_engine_confirms() -> None:
    """Closed loop against the simulator's ground truth: observe, roll out, verify, judge.

    The SLO is set below what the starting knobs achieve, so there is a violation to fix
    whatever the simulator's exact step-time constants are; the engine, not the test, says
    which knobs fix it.
    """
    from tests.unit.core.test_perf_model import ENGINE_CTX, ground_truth
    from vllm_autotuner.core.perf_model import EngineModel

    def truth(k: Knobs) -> Snapshot:
        return ground_truth(k, rate=3.0, prompt_mean=3000.0)  # long prompts, as in RAG

    start = Knobs(2048, 256, 0.9)
    before = truth(start)
    assert before.itl.p95_ms is not None
    threshold = 0.8 * before.itl.p95_ms
    policy = make_policy(
        slo=SLO(ttft=SLOTarget(95.0, 5000.0), itl=SLOTarget(95.0, threshold)),
        bounds=Bounds(
            KnobBounds(256, 16384, 6144), KnobBounds(8, 1024, 128), KnobBounds(0.5, 0.95, 0.03)
        ),
    )
    model = EngineModel()
    obs = Observation(before, ready_pods(start))
    d = decide(TuningState.initial(start), obs, policy, ENGINE_CTX, NOW, model)
    assert d.action == "rollout", d.reason
    assert d.knobs_to_apply is not None and d.prediction is not None
    after = truth(d.knobs_to_apply)
    assert after.itl.p95_ms is not None
    assert after.itl.p95_ms < before.itl.p95_ms
    verifying = replace(d.new_state, phase="Verifying", verify_until=NOW)
    obs = Observation(after, ready_pods(d.knobs_to_apply))
    v = decide(verifying, obs, policy, ENGINE_CTX, NOW + timedelta(seconds=1), model)
    assert v.action == ("commit" if after.itl.p95_ms <= threshold else "rollback"), v.reason


def test_a_rolled_back_trial_keeps_what_its_window_measured() -> None:
    """The search reads finished trials as evidence (core/evidence.py): a regression's window
    is the evidence, so it stays on the trial (it used to be dropped at the rollback)."""
    regress = next(t for t in _transitions() if t[0] == "regress")
    _, state, pods, snap, dt, *_ = regress
    d = run(state, snap, now=NOW + timedelta(seconds=dt), pods=pods)
    assert d.action == "rollback", d.reason
    measured = d.new_state.trials[-1].measured
    assert measured is not None and measured.request_rate > 0


def test_a_candidate_rejected_after_its_whole_window_proves_its_memory() -> None:
    """A candidate that served its whole verify window without a crash proves its memory as a
    commit does, even when it is rolled back for doing worse."""
    cand = Knobs(8192, 1024, 0.94)
    state = _window_served(cand, baseline=Measured(4.0, 300.0, 30.0, None, 0.99, 50.0))
    worse = make_snapshot(cand, itl_p95=200.0, itl_mean=60.0)
    d = run(state, worse, now=NOW + timedelta(seconds=1), pods=ready_pods(cand))
    assert d.action == "rollback", d.reason
    assert d.new_state.trials[-1].outcome == "RolledBack"
    assert d.new_state.memory().covers(cand)
    assert d.new_state.applied == state.last_good
