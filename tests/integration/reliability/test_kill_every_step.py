"""The operator dies at every step of the rollout state machine, then a new one takes over.

A kill is modelled at the API: from the moment the stored status shows the phase under test,
every write of the old operator fails (`freeze_when`), so nothing it does afterwards reaches
the cluster — exactly what a SIGKILL at that instant leaves behind — then it is stopped and a
fresh operator (empty memory, new indexes) starts. The variants "status" freeze only the
status patches: the process died after writing the Deployment and before recording it.

After the restart: the trial that was pending keeps its id and finishes; no trial id is
reused; the Deployment never went from one candidate to another without passing through a
good configuration (two rollouts at once); every candidate it ran is a recorded trial; and in
the end status.tuning.applied is what the Deployment runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support.cluster_api import CR_PATH, NS, POLICY_PATH, Api, ApiServer
from tests.support.fake_fleet import FakeKubelet, SyntheticSnapshots
from tests.support.faults import (
    START,
    cr_with_mode,
    fast_policy,
    freeze_when,
    live_knobs,
    operator,
    operator_config,
    operator_write,
    phase_is,
    status_patch,
    template_history,
    trials_of,
    tuning_of,
)
from tests.support.waiting import wait_for
from vllm_autotuner.core.tuning_types import Knobs
from vllm_localcluster.faults import FaultProxy, RequestRecord

# A start the synthetic fleet is happy with (SLO met, no gain worth a rollout): Observing.
CONTENT = Knobs(max_num_batched_tokens=2752, max_num_seqs=256, gpu_memory_utilization=0.89)
# Moves of at most 2048 batched tokens: the first (8192 -> 6272) does not fix the ITL, so after
# it a next candidate is wanted. An unbounded move reaches the predicted best (1856) at once.
SMALL_STEPS = {"maxNumBatchedTokens": {"maxStep": 2048}}
# Tightened right after the first commit (1856 batched tokens), so the next write is a second
# rollout: the move into the new bounds (the tuner alone sees nothing left worth a restart).
TIGHTER = {"maxNumBatchedTokens": {"min": 256, "max": 1024}}


@dataclass(frozen=True)
class Step:
    phase: str
    start: Knobs = START
    rollout: dict[str, Any] = field(default_factory=dict)
    bad_candidates: bool = False
    writes: Callable[[RequestRecord], bool] = operator_write
    bounds: dict[str, Any] = field(default_factory=dict)
    # The policy's bounds from the moment the phase under test is seen.
    bounds_then: dict[str, Any] = field(default_factory=dict)


STEPS = {
    "Observing": Step("Observing", start=CONTENT),
    # One rollout a day: after the first trial the next candidate waits (phase Candidate).
    "Candidate": Step("Candidate", rollout={"maxPerDay": 1}, bounds=SMALL_STEPS),
    "RollingOut": Step("RollingOut", rollout={"verifyWindow": "3s"}),
    "Verifying": Step("Verifying", rollout={"verifyWindow": "3s"}),
    # Killed right after the first commit: the second rollout is the next write.
    "Committed": Step("Committed", rollout={"maxPerDay": 2}, bounds_then=TIGHTER),
    "RolledBack": Step("RolledBack", rollout={"maxPerDay": 1}, bad_candidates=True),
    # Died after writing the Deployment, before recording it in status.
    "RollingOut-status": Step("RollingOut", rollout={"verifyWindow": "3s"}, writes=status_patch),
    "Committed-status": Step(
        "Committed", rollout={"maxPerDay": 2}, writes=status_patch, bounds_then=TIGHTER
    ),
}


def policy_for(step: Step) -> dict[str, Any]:
    policy = fast_policy(**step.rollout)
    if step.bounds:
        policy["spec"]["bounds"] = step.bounds
    return policy


def _spec_knobs(k: Knobs) -> dict[str, Any]:
    return {"knobs": k.to_dict()}


def _good_configs(start: Knobs, trials: list[dict[str, Any]]) -> list[Knobs]:
    return [start, *(Knobs.from_dict(t["knobs"]) for t in trials if t["outcome"] == "Committed")]


def check_history(proxy: FaultProxy, api: Api, start: Knobs) -> list[dict[str, Any]]:
    """The invariants every restart must keep; returns the trials for further checks."""
    trials = trials_of(api)
    ids = [t["id"] for t in trials]
    assert ids == sorted(set(ids)), f"trial ids reused or out of order: {ids}"
    assert sum(t["outcome"] == "Pending" for t in trials) <= 1, trials
    candidates = {Knobs.from_dict(t["knobs"]) for t in trials}
    good = _good_configs(start, trials)
    history = template_history(proxy)
    assert history[0] == start, history
    for before, after in itertools.pairwise(history):
        if after in candidates and after not in good[:1]:
            # A rollout starts from a configuration that was good at the time, never from
            # another candidate still on trial.
            assert before in good, f"two rollouts at once: {before} -> {after} in {history}"
    unrecorded = [k for k in history if k not in candidates and k not in good]
    assert not unrecorded, f"the Deployment ran knobs no trial records: {unrecorded}"
    # Each trial moves the pods once, and once more when it is rolled back; a restart that
    # reverted an unrecorded rollout and redid it would restart every GPU pod twice more.
    moves = sum(1 + (t["outcome"] not in ("Committed", "Pending")) for t in trials)
    assert len(history) - 1 <= moves, f"needless restarts: {history} for {trials}"
    return trials


@pytest.mark.parametrize("name", list(STEPS))
def test_killed_in_every_phase_resumes_without_losing_or_doubling_a_rollout(
    apiserver: ApiServer, proxy: FaultProxy, api: Api, name: str
) -> None:
    step = STEPS[name]
    api.create(POLICY_PATH, policy_for(step))
    api.create(CR_PATH, cr_with_mode("Auto", **_spec_knobs(step.start)))
    metrics = SyntheticSnapshots()
    bad: Callable[[Knobs | None], bool] = (
        (lambda k: k is not None and k != step.start) if step.bad_candidates else (lambda _: False)
    )
    config = operator_config(proxy, interval_s=0.5)
    with FakeKubelet(apiserver, NS, is_bad=bad):
        killed = freeze_when(proxy, phase_is(api, step.phase), step.writes)
        with operator(config, metrics):
            wait_for(phase_is(api, step.phase), 40, message=f"phase {step.phase}")
            if step.bounds_then:
                api.merge(f"{POLICY_PATH}/default", {"spec": {"bounds": step.bounds_then}})
            # Observing, and Candidate waiting for the budget, have nothing more to write: a
            # repeated conclusion keeps its timestamps (no status write per reconcile).
            if step.phase not in ("Observing", "Candidate"):
                wait_for(lambda: killed.hits >= 1, 20, message="the operator's next write")
        at_kill = tuning_of(api)
        assert at_kill["phase"] == step.phase
        pending = [t for t in at_kill.get("trials", []) if t["outcome"] == "Pending"]
        proxy.clear_faults()

        with operator(config, metrics):
            cycles = len(metrics.calls)
            if pending:
                (trial,) = pending
                finished = wait_for(
                    lambda: [
                        t
                        for t in trials_of(api)
                        if t["id"] == trial["id"] and t["outcome"] != "Pending"
                    ],
                    40,
                    message=f"trial {trial['id']} finished after the restart",
                )
                assert finished[0]["knobs"] == trial["knobs"], "the pending trial changed knobs"
                assert finished[0]["outcome"] == "Committed", finished
            elif name.startswith("Committed"):
                # The rollout the old operator was about to start (or had started unrecorded)
                # happens once, as trial 2.
                wait_for(
                    lambda: any(t["id"] == 2 and t["outcome"] != "Pending" for t in trials_of(api)),
                    40,
                    message="trial 2 finished after the restart",
                )
            else:
                wait_for(lambda: len(metrics.calls) >= cycles + 4, 20, message="a few cycles")
            # Let the new operator settle: applied and live agree.
            wait_for(
                lambda: (
                    (k := live_knobs(api)) is not None
                    and tuning_of(api).get("applied") == k.to_dict()
                    and tuning_of(api).get("phase") not in ("RollingOut",)
                ),
                20,
                message="status and Deployment agree",
            )
            trials = check_history(proxy, api, step.start)

    before_ids = [t["id"] for t in at_kill.get("trials", [])]
    after_ids = [t["id"] for t in trials]
    assert after_ids[: len(before_ids)] == before_ids, "a recorded trial was lost"
    if step.phase in ("Observing", "Candidate"):
        assert after_ids == before_ids, "a rollout started that the policy did not allow"
    if step.phase == "RolledBack":
        state = tuning_of(api)
        assert state["infeasible"], "the bad configuration was forgotten"
        assert live_knobs(api) == step.start
        assert {t["outcome"] for t in trials} <= {"OOMKilled", "Crashed", "RolledBack"}
