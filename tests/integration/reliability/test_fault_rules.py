"""The pure rules behind the reliability fixes, one reconcile at a time (no cluster).

The end-to-end tests in this package show the behaviour through the operator; these pin down
each rule's edges quickly: bad metrics, late failures, tightened bounds, adopting an
unrecorded rollout, retry backoff, drift messages and reading the live knobs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from tests.unit.core.test_decide import (
    BOUNDS,
    CTX,
    KNOBS,
    NOW,
    SLO_DEFAULT,
    make_policy,
    make_snapshot,
    rolling_state,
    run,
    violating_snapshot,
)
from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_autotuner.core import render
from vllm_autotuner.core.decide import Decision, decide
from vllm_autotuner.core.memory import ProvenMemory
from vllm_autotuner.core.perf_model import AnalyticModel
from vllm_autotuner.core.rollout import adopt_unrecorded
from vllm_autotuner.core.snapshot import LatencySummary, Observation, Snapshot, defect
from vllm_autotuner.core.tuning_inputs import deployment_knobs
from vllm_autotuner.core.tuning_types import (
    Bounds,
    InfeasibleConfig,
    KnobBounds,
    Knobs,
    PodHealth,
    RolloutRules,
    Trial,
    TuningPolicy,
    TuningState,
)
from vllm_autotuner.operator import retry_delay

GOOD = Knobs(4096, 512, 0.9)
TARGETS = SLO_DEFAULT.targets()


def decide_with_origin(
    state: TuningState,
    snap: Snapshot,
    pods: tuple[PodHealth, ...],
    *,
    origin: Knobs,
    policy: TuningPolicy | None = None,
) -> Decision:
    observation = Observation(snap, pods)
    return decide(state, observation, policy or make_policy(), CTX, NOW, AnalyticModel(), origin)


# ------------------------------------------------------------------------------ bad metrics


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"request_rate": math.nan}, "request_rate=nan"),
        ({"request_rate": -3.0}, "request_rate=-3"),
        ({"itl": LatencySummary(p95_ms=math.inf)}, "itl.p95_ms=inf"),
        ({"itl": LatencySummary()}, "partial data: no ITL p95"),
    ],
)
def test_defect_names_what_is_wrong(change: dict[str, Any], words: str) -> None:
    snap = replace(make_snapshot(), **change)
    found = defect(snap, TARGETS)
    assert found is not None and words in found


def test_a_sound_or_unavailable_snapshot_has_no_defect() -> None:
    assert defect(make_snapshot(), TARGETS) is None
    assert defect(replace(make_snapshot(), available=False), TARGETS) is None
    # No requests, no latency: that is idle traffic, not a partial scrape.
    idle = replace(make_snapshot(), completed_requests=0, itl=LatencySummary())
    assert defect(idle, TARGETS) is None


@pytest.mark.parametrize(
    "change",
    [
        {"request_rate": math.nan},
        {"itl": LatencySummary(p95_ms=math.nan), "ttft": LatencySummary(p95_ms=math.nan)},
        {"request_rate": -5.0, "completed_requests": -100},
        {"itl": LatencySummary()},
    ],
)
def test_no_change_on_bad_data_even_when_the_slo_looks_violated(change: dict[str, Any]) -> None:
    state = TuningState.initial(KNOBS)
    assert run(state, violating_snapshot()).action == "rollout"  # good data would act
    decision = run(state, replace(violating_snapshot(), **change))
    assert decision.action == "hold" and decision.knobs_to_apply is None
    assert "metrics unusable" in decision.reason


def test_bad_data_during_verification_never_commits() -> None:
    state = replace(rolling_state(), phase="Verifying", verify_until=NOW - timedelta(seconds=1))
    cand = state.candidate
    assert cand is not None
    bad = replace(make_snapshot(cand), request_rate=math.nan)
    decision = run(state, bad)
    assert decision.action == "verify", decision.reason  # waits for data, does not judge


# ----------------------------------------------------------------------------- late failure


def _committed(knobs: Knobs, **kw: Any) -> TuningState:
    trial = Trial(1, knobs, NOW - timedelta(hours=5), NOW - timedelta(hours=4), "Committed")
    return replace(
        TuningState(applied=knobs, last_good=knobs, phase="Observing", trials=(trial,)), **kw
    )


def _oom(knobs: Knobs) -> tuple[PodHealth, ...]:
    return (
        PodHealth(
            ready=True,
            restarts=1,
            last_termination_reason="OOMKilled",
            revision_knobs=knobs,
            name="p0",
        ),
    )


def _crash_loop(knobs: Knobs) -> tuple[PodHealth, ...]:
    return (
        PodHealth(
            ready=False,
            restarts=1,
            last_termination_reason="Error",
            waiting_reason="CrashLoopBackOff",
            revision_knobs=knobs,
            name="p0",
        ),
    )


@pytest.mark.parametrize(("pods", "kind"), [(_oom, "OOMKilled"), (_crash_loop, "Crashed")])
def test_a_committed_configuration_that_fails_later_is_rolled_back_and_remembered(
    pods: Callable[[Knobs], tuple[PodHealth, ...]], kind: str
) -> None:
    state = _committed(GOOD, proven_memory=ProvenMemory.of([(GOOD.max_num_batched_tokens, 0.9)]))
    snap = make_snapshot(GOOD)
    decision = decide_with_origin(state, snap, pods(GOOD), origin=KNOBS)
    assert decision.action == "rollback"
    assert decision.knobs_to_apply == KNOBS
    new = decision.new_state
    assert new.applied == new.last_good == KNOBS
    assert [(i.knobs, i.kind) for i in new.infeasible] == [(GOOD, kind)]
    assert new.stable_gmu() <= KNOBS.gpu_memory_utilization
    assert not new.proven_memory.covers(GOOD)  # the proof that claimed GOOD safe is gone
    assert new.trials[0].outcome == "Committed"  # history is not rewritten


def test_the_previous_committed_configuration_wins_over_the_origin() -> None:
    older = Knobs(6144, 768, 0.9)
    state = _committed(GOOD)
    first = Trial(1, older, NOW - timedelta(hours=9), NOW - timedelta(hours=8), "Committed")
    second = replace(state.trials[0], id=2)
    state = replace(state, trials=(first, second))
    decision = decide_with_origin(state, make_snapshot(GOOD), _oom(GOOD), origin=KNOBS)
    assert decision.knobs_to_apply == older


def test_a_late_failure_without_a_fallback_or_outside_auto_only_holds() -> None:
    state = TuningState.initial(GOOD)
    decision = decide_with_origin(state, make_snapshot(GOOD), _oom(GOOD), origin=GOOD)
    assert decision.action == "hold" and decision.knobs_to_apply is None
    recommend = make_policy("Recommend")
    decision = decide_with_origin(
        _committed(GOOD), make_snapshot(GOOD), _oom(GOOD), origin=KNOBS, policy=recommend
    )
    assert decision.knobs_to_apply is None


# --------------------------------------------------------------------------- policy changes

TIGHT = Bounds(mnbt=KnobBounds(6000, 16384, 7168), mns=BOUNDS.mns, gmu=BOUNDS.gmu)


def test_a_candidate_outside_tightened_bounds_is_abandoned_without_blame() -> None:
    state = rolling_state(Knobs(1024, 1024, 0.92))
    decision = run(state, make_snapshot(Knobs(1024, 1024, 0.92)), make_policy(bounds=TIGHT))
    assert decision.action == "rollback"
    assert decision.knobs_to_apply == state.last_good
    assert decision.new_state.infeasible == ()
    assert "policy" in decision.new_state.trials[-1].reason


def test_running_knobs_outside_tightened_bounds_move_inside_as_a_trial() -> None:
    tight = Bounds(mnbt=KnobBounds(256, 4096, 7168), mns=BOUNDS.mns, gmu=BOUNDS.gmu)
    state = TuningState.initial(KNOBS)
    decision = run(state, make_snapshot(), make_policy(bounds=tight))
    assert decision.action == "rollout"
    assert decision.knobs_to_apply == replace(KNOBS, max_num_batched_tokens=4096)
    assert decision.new_state.phase == "RollingOut"
    # The rules still apply: with the daily budget spent it waits.
    spent = replace(state, rollouts_today=4, rollout_day="2026-12-02")
    held = run(spent, make_snapshot(), make_policy(bounds=tight))
    assert held.action == "hold" and "budget" in held.reason


# ----------------------------------------------------------------------- adopting a rollout


def test_an_applied_but_unrecorded_rollout_is_adopted_as_the_next_trial() -> None:
    state = _committed(GOOD)
    adopted = adopt_unrecorded(state, Knobs(3072, 512, 0.9), make_policy(), NOW)
    assert adopted is not None
    assert adopted.phase == "RollingOut" and adopted.candidate == Knobs(3072, 512, 0.9)
    assert [t.id for t in adopted.trials] == [1, 2] and adopted.trials[-1].outcome == "Pending"


@pytest.mark.parametrize(
    "case", ["same", "none", "recommend", "in-flight", "infeasible", "failed-trial", "bounds"]
)
def test_what_is_never_adopted(case: str) -> None:
    other = Knobs(3072, 512, 0.9)
    state, policy, live = _committed(GOOD), make_policy(), other
    if case == "same":
        live = GOOD
    elif case == "none":
        live = None  # type: ignore[assignment]
    elif case == "recommend":
        policy = make_policy("Recommend")
    elif case == "in-flight":
        state = rolling_state()
    elif case == "infeasible":
        state = state.with_infeasible(InfeasibleConfig(other, "OOM", NOW, "OOMKilled"))
    elif case == "failed-trial":
        state = state.with_trial(Trial(2, other, NOW, NOW, "RolledBack"))
    elif case == "bounds":
        policy = make_policy(bounds=TIGHT)
    assert adopt_unrecorded(state, live, policy, NOW) is None


def test_adoption_respects_the_rollout_rules() -> None:
    rules = RolloutRules(min_interval_s=3600, max_per_day=4)
    state = replace(_committed(GOOD), last_rollout_at=NOW - timedelta(minutes=5))
    assert adopt_unrecorded(state, Knobs(3072, 512, 0.9), make_policy(rollout=rules), NOW) is None


# ------------------------------------------------------------------------- operator helpers


def test_retry_delay_doubles_from_a_short_start_and_never_exceeds_the_interval() -> None:
    delays = [retry_delay(n, 30.0) for n in range(1, 10)]
    assert delays[0] <= 1.0
    assert all(b >= a for a, b in itertools.pairwise(delays))
    assert max(delays) == 30.0
    assert max(retry_delay(n, 0.5) for n in range(1, 50)) <= 0.5


def _rendered(knobs: Knobs) -> dict[str, Any]:
    spec = VLLMDeploymentSpec.model_validate(
        {"model": "meta-llama/Llama-3.1-8B-Instruct", "gpu": {"product": "H100"}}
    )
    owner = render.Owner(name="llama", namespace="ns", uid="u")
    return render.render_deployment(spec, knobs, owner)


def test_live_knobs_are_read_only_from_a_template_we_rendered() -> None:
    deployment = _rendered(GOOD)
    assert deployment_knobs(deployment) == GOOD
    edited = _rendered(GOOD)
    container = edited["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    args[args.index("--max-num-seqs") + 1] = "7"
    assert deployment_knobs(edited) is None
    assert deployment_knobs(None) is None


def test_drift_paths_name_the_fields_that_differ() -> None:
    desired = _rendered(GOOD)
    live = _rendered(Knobs(4096, 512, 0.5))
    paths = render.drift_paths(desired, live)
    assert any(p.startswith("spec.template.spec.containers[0].args") for p in paths), paths
    assert render.drift_paths(desired, desired) == []
