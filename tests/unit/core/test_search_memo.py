"""decide() reuses its last search while there is no new evidence, and only then.

A counting model tells whether a decision searched: a search makes ~100 predictions (339
with the second search at a fit that bound the gain), a decision that reuses the memo makes
the applied knobs' own prediction and, when another fit binds, those of the remembered
candidates under every fit (15 on this file's healthy window).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from tests.unit.core.shared_model import SharedModel
from tests.unit.core.test_decide import (
    CTX,
    KNOBS,
    NOW,
    make_policy,
    make_snapshot,
    ready_pods,
    violating_snapshot,
)
from vllm_autotuner.core.decide import Decision, decide
from vllm_autotuner.core.perf_model import Calibration, Prediction, Workload
from vllm_autotuner.core.search_memo import DRIFT, SearchMemo
from vllm_autotuner.core.snapshot import Observation, Snapshot
from vllm_autotuner.core.tuning_types import (
    InfeasibleConfig,
    Knobs,
    RolloutRules,
    TuningPolicy,
    TuningState,
)


class CountingModel(SharedModel):
    """Counts the predictions decide() asks for (the real model's answers, shared)."""

    def __init__(self) -> None:
        super().__init__("H100")
        self.predictions = 0

    def predict(
        self, knobs: Knobs, workload: Workload, calibration: Calibration, capacity: bool = True
    ) -> Prediction:
        self.predictions += 1
        return super().predict(knobs, workload, calibration, capacity)


STATE = replace(TuningState.initial(KNOBS), phase="Observing")


def run(
    state: TuningState,
    snap: Snapshot,
    policy: TuningPolicy,
    later_s: float = 0.0,
    memo: SearchMemo | None = None,
) -> tuple[Decision, int]:
    model = CountingModel()
    obs = Observation(snap, ready_pods(state.applied))
    d = decide(state, obs, policy, CTX, NOW + timedelta(seconds=later_s), model, KNOBS, memo)
    return d, model.predictions


def searched(n: int) -> bool:
    return n > 60


def test_a_decision_without_new_evidence_reuses_the_search_and_says_the_same() -> None:
    policy = make_policy("Recommend")
    first, n1 = run(STATE, make_snapshot(), policy)
    assert searched(n1) and first.search_memo is not None
    again, n2 = run(
        STATE, make_snapshot(time=NOW + timedelta(seconds=30)), policy, 30, first.search_memo
    )
    assert not searched(n2)
    assert again.reason == first.reason and again.action == first.action
    assert again.search_memo is first.search_memo


@pytest.mark.parametrize(
    ("what", "state", "snap", "policy_kw", "later_s"),
    [
        ("other applied knobs", replace(STATE, applied=Knobs(4096, 512, 0.92)), None, {}, 30),
        (
            "a newly known-infeasible configuration",
            replace(
                STATE,
                infeasible=(InfeasibleConfig(Knobs(2048, 256, 0.95), "OOM", NOW, "OOMKilled"),),
            ),
            None,
            {},
            30,
        ),
        ("the SLO became violated", STATE, violating_snapshot(), {}, 30),
        (
            "the load moved by more than DRIFT",
            STATE,
            make_snapshot(rate=4.0 * (1 + 2 * DRIFT)),
            {},
            30,
        ),
        ("longer prompts", STATE, make_snapshot(prompt=(1500.0, 3000.0)), {}, 30),
        ("a new policy", STATE, None, {"min_gain_pct": 1.0}, 30),
        ("the memo is one evaluation window old", STATE, None, {}, 300),
    ],
)
def test_new_evidence_runs_the_search_again(
    what: str,
    state: TuningState,
    snap: Snapshot | None,
    policy_kw: dict[str, float],
    later_s: float,
) -> None:
    policy = make_policy("Recommend")
    first, _ = run(STATE, make_snapshot(), policy)
    snap = snap or make_snapshot()
    snap = replace(snap, knobs=state.applied, time=NOW + timedelta(seconds=later_s))
    again, n = run(state, snap, make_policy("Recommend", **policy_kw), later_s, first.search_memo)
    assert searched(n), what
    assert again.search_memo is not first.search_memo, what


def test_small_drift_inside_the_window_keeps_the_memo() -> None:
    """Load within DRIFT and the same fitted engine: the search stands; fitted parameters
    that moved by more than DRIFT: it does not. Checked on the memo's own rule: through
    decide() each window is fitted anew, and this synthetic window (no ITL histogram) cannot
    tell compute from bandwidth, so fits of windows 0-8 % apart in load land anywhere along
    a flat valley (compute 0.87-1.06); whether 5 % apart stayed within DRIFT was chance."""
    policy = make_policy("Recommend")
    first, _ = run(STATE, make_snapshot(), policy)
    memo = first.search_memo
    assert memo is not None
    later = NOW + timedelta(seconds=290)
    rate = memo.workload.request_rate * (1 + DRIFT / 2)
    drifted = replace(memo.workload, request_rate=rate)
    window_s = policy.evaluation_window_s
    assert memo.answers(memo.inputs, drifted, memo.calibration, later, window_s)
    moved = replace(memo.calibration, compute=memo.calibration.compute * (1 + 2 * DRIFT))
    assert not memo.answers(memo.inputs, drifted, moved, later, window_s)


def test_a_remembered_proposal_rolls_out_when_the_cooldown_ends_without_a_new_search() -> None:
    rules = RolloutRules(min_interval_s=120, max_per_day=4)
    policy = make_policy("Auto", rollout=rules, min_gain_pct=0.0)
    state = replace(STATE, last_rollout_at=NOW - timedelta(seconds=60))
    snap = violating_snapshot()
    held, n1 = run(state, snap, policy)
    assert held.action == "hold" and "rollout waits" in held.reason and searched(n1)
    assert held.search_memo is not None and held.search_memo.result.best is not None
    later = replace(snap, time=NOW + timedelta(seconds=90))
    rolled, n2 = run(held.new_state, later, policy, 90, held.search_memo)
    assert rolled.action == "rollout" and not searched(n2)
    assert rolled.knobs_to_apply == held.search_memo.result.best


def test_an_illegal_remembered_proposal_is_never_reused() -> None:
    """The memo is checked against the hard constraints again (belt and braces)."""
    policy = make_policy("Recommend")
    first, _ = run(STATE, make_snapshot(), policy)
    assert first.search_memo is not None
    outside = Knobs(65536, 1024, 0.92)  # beyond bounds and maxStep
    memo = first.search_memo
    forged = replace(memo, result=replace(memo.result, best=outside, worth_rollout=True))
    again, n = run(STATE, make_snapshot(), policy, 30, forged)
    assert searched(n)
    assert (
        again.new_state.recommendation is None
        or not again.new_state.recommendation.knobs.same_as(outside)
    )


def test_a_repeated_recommendation_keeps_the_time_it_was_first_made() -> None:
    """Otherwise every reconcile rewrites status.tuning.recommendation.time (an idle write)."""
    policy = make_policy("Recommend")
    first, _ = run(STATE, violating_snapshot(), policy)
    rec = first.new_state.recommendation
    assert first.action == "recommend" and rec is not None and rec.time == NOW
    later = violating_snapshot(time=NOW + timedelta(seconds=30))
    again, _ = run(first.new_state, later, policy, 30, first.search_memo)
    assert again.new_state.recommendation is not None
    assert again.new_state.recommendation.time == NOW
    assert (
        again.new_state.to_dict()["recommendation"] == first.new_state.to_dict()["recommendation"]
    )
    # A different recommendation is new, with its own time.
    other = replace(first.new_state, recommendation=replace(rec, knobs=Knobs(1024, 64, 0.9)))
    fresh, _ = run(other, later, policy, 30, first.search_memo)
    assert fresh.new_state.recommendation is not None
    assert fresh.new_state.recommendation.time == NOW + timedelta(seconds=30)
