"""The platform team deletes or tightens the policy while a rollout runs.

Deleted: the operator holds (changes nothing, says why) and the trial resumes once a policy is
back. Tightened: a candidate the policy no longer allows is abandoned (not blamed), and tuning
continues inside the new bounds only.
"""

from __future__ import annotations

from typing import Any

from tests.support.cluster_api import CR_PATH, NS, POLICY_PATH, Api, ApiServer
from tests.support.fake_fleet import FakeKubelet, SyntheticSnapshots
from tests.support.faults import (
    START,
    cond_when,
    cr_with_mode,
    fast_policy,
    live_knobs,
    operator,
    operator_config,
    template_history,
    trials_of,
    tuning_of,
    wait_some,
)
from tests.support.waiting import wait_for
from vllm_autotuner.core.tuning_types import Knobs
from vllm_localcluster.faults import FaultProxy


def _pending(api: Api) -> list[dict[str, Any]]:
    return [t for t in trials_of(api) if t["outcome"] == "Pending"]


def test_policy_deleted_mid_rollout_holds_then_resumes_the_same_trial(
    apiserver: ApiServer, proxy: FaultProxy, api: Api
) -> None:
    api.create(POLICY_PATH, fast_policy(verifyWindow="3s"))
    api.create(CR_PATH, cr_with_mode("Auto"))
    metrics = SyntheticSnapshots()
    with FakeKubelet(apiserver, NS), operator(operator_config(proxy), metrics):
        wait_for(lambda: tuning_of(api).get("phase") == "Verifying", 30, message="Verifying")
        (trial,) = _pending(api)
        candidate = live_knobs(api)
        assert candidate is not None and candidate.to_dict() == trial["knobs"]
        api.delete(f"{POLICY_PATH}/default")
        gone = wait_some(cond_when(api, "PolicyResolved", "False"), 10, "PolicyResolved=False")
        assert gone["reason"] == "PolicyNotFound"
        # Hold for longer than the verify window: nothing moves, nothing is judged.
        cycles = len(metrics.calls)
        wait_for(lambda: len(metrics.calls) >= cycles + 8, 20, message="cycles without a policy")
        assert live_knobs(api) == candidate
        assert _pending(api) == [trial]
        assert template_history(proxy) == [START, candidate]

        api.create(POLICY_PATH, fast_policy(verifyWindow="3s"))
        finished = wait_for(
            lambda: [
                t for t in trials_of(api) if t["id"] == trial["id"] and t["outcome"] != "Pending"
            ],
            30,
            message="the same trial finished once the policy was back",
        )
        assert finished[0]["outcome"] == "Committed"
        assert finished[0]["knobs"] == trial["knobs"]


def _bounded(min_mnbt: int, max_mnbt: int, **rollout: Any) -> dict[str, Any]:
    policy = fast_policy(**rollout)
    policy["spec"]["bounds"] = {"maxNumBatchedTokens": {"min": min_mnbt, "max": max_mnbt}}
    return policy


def test_policy_tightened_mid_rollout_abandons_the_candidate_then_tunes_inside(
    apiserver: ApiServer, proxy: FaultProxy, api: Api
) -> None:
    api.create(POLICY_PATH, fast_policy(verifyWindow="4s", maxPerDay=2))
    api.create(CR_PATH, cr_with_mode("Auto"))
    metrics = SyntheticSnapshots()
    with FakeKubelet(apiserver, NS), operator(operator_config(proxy), metrics):
        wait_for(lambda: tuning_of(api).get("phase") == "Verifying", 30, message="Verifying")
        (trial,) = _pending(api)
        candidate = Knobs.from_dict(trial["knobs"])
        assert candidate.max_num_batched_tokens < 6000 <= START.max_num_batched_tokens
        tightened = _bounded(6000, 16384, verifyWindow="4s", maxPerDay=2)
        api.merge(f"{POLICY_PATH}/default", {"spec": tightened["spec"]})
        ended = wait_for(
            lambda: [
                t for t in trials_of(api) if t["id"] == trial["id"] and t["outcome"] != "Pending"
            ],
            20,
            message="the candidate abandoned",
        )
        assert ended[0]["outcome"] == "RolledBack", ended
        assert "policy" in ended[0]["reason"]
        wait_for(lambda: live_knobs(api) == START, 20, message="back on the last good knobs")
        # Not the candidate's fault: it is not remembered as infeasible.
        assert not tuning_of(api).get("infeasible")
        # Whatever the tuner does next stays inside the new bounds.
        cycles = len(metrics.calls)
        wait_for(lambda: len(metrics.calls) >= cycles + 6, 20, message="cycles under new bounds")
        later = [Knobs.from_dict(t["knobs"]) for t in trials_of(api)[1:]]
        assert all(6000 <= k.max_num_batched_tokens <= 16384 for k in later), later
    history = template_history(proxy)
    after = history[history.index(candidate) + 1 :]
    assert all(k.max_num_batched_tokens >= 6000 for k in after), history


def test_policy_tightened_below_the_running_knobs_moves_them_inside(
    apiserver: ApiServer, proxy: FaultProxy, api: Api
) -> None:
    api.create(POLICY_PATH, fast_policy(maxPerDay=3))
    # A start the synthetic fleet is content with: the tuner alone would not move.
    content = Knobs(max_num_batched_tokens=2752, max_num_seqs=256, gpu_memory_utilization=0.89)
    api.create(CR_PATH, cr_with_mode("Auto", knobs=content.to_dict()))
    metrics = SyntheticSnapshots()
    with FakeKubelet(apiserver, NS), operator(operator_config(proxy), metrics):
        wait_for(lambda: tuning_of(api).get("phase") == "Observing", 30, message="Observing")
        assert trials_of(api) == []
        ceiling = 2048
        tight = _bounded(256, ceiling, maxPerDay=3)
        api.merge(f"{POLICY_PATH}/default", {"spec": tight["spec"]})

        def inside() -> Knobs | None:
            k = live_knobs(api)
            return k if k is not None and k.max_num_batched_tokens <= ceiling else None

        moved = wait_some(inside, 30, "the Deployment moved inside the new bounds")
        # The Deployment is written before status: wait for the trial to be recorded too.
        (trial,) = wait_for(lambda: trials_of(api), 15, message="the move recorded as a trial")
        assert trial["knobs"] == moved.to_dict(), "the move is a recorded trial"
        wait_for(
            lambda: [t for t in trials_of(api) if t["outcome"] == "Committed"],
            30,
            message="the move verified and committed",
        )
    assert template_history(proxy) == [content, moved]
