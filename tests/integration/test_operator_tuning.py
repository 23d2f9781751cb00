"""The operator's tuning loop against the API emulator, a fake kubelet and synthetic metrics."""

from __future__ import annotations

import copy
from typing import Any

from tests.support.cluster_api import (
    CR,
    CR_PATH,
    DEPLOYMENT_PATH,
    NS,
    POLICY_PATH,
    Api,
    ApiServer,
    args_of,
)
from tests.support.fake_fleet import FakeKubelet, SyntheticSnapshots
from tests.support.faults import fast_policy
from tests.support.operator_runner import running_operator
from tests.support.waiting import wait_for
from vllm_autotuner.core.tuning_types import Knobs

START = Knobs(max_num_batched_tokens=8192, max_num_seqs=256, gpu_memory_utilization=0.92)


def knobs_of(deployment: dict[str, Any] | None) -> Knobs | None:
    if deployment is None:
        return None
    args = args_of(deployment)
    return Knobs(
        int(args[args.index("--max-num-batched-tokens") + 1]),
        int(args[args.index("--max-num-seqs") + 1]),
        float(args[args.index("--gpu-memory-utilization") + 1]),
    )


def tuning(api: Api) -> dict[str, Any]:
    obj = api.get(f"{CR_PATH}/llama") or {}
    return dict((obj.get("status") or {}).get("tuning") or {})


def create_cr(api: Api, mode: str) -> None:
    cr = copy.deepcopy(CR)
    cr["spec"]["tuning"] = {"mode": mode}
    cr["spec"]["rollout"] = {"maxSurge": 1}  # a spare GPU: a rollout never waits for headroom
    api.create(CR_PATH, cr)


def test_recommend_publishes_a_recommendation_and_never_touches_the_deployment(
    apiserver: ApiServer, api: Api
) -> None:
    api.create(POLICY_PATH, fast_policy())
    create_cr(api, "Recommend")
    metrics = SyntheticSnapshots()
    with (
        FakeKubelet(apiserver, NS),
        running_operator(apiserver.operator_credentials(), interval_s=0.5, snapshot_source=metrics),
    ):
        rec = wait_for(lambda: tuning(api).get("recommendation"), 30, message="recommendation")
        deployment = api.get(f"{DEPLOYMENT_PATH}/llama")
        assert knobs_of(deployment) == START
        assert deployment is not None and deployment["metadata"]["generation"] == 1
        recommended = Knobs.from_dict(rec["knobs"])
        assert recommended != START
        # ITL is over the SLO at the start: the tuner must ask for a smaller token budget.
        assert recommended.max_num_batched_tokens < START.max_num_batched_tokens
        assert tuning(api).get("trials", []) == []


def test_auto_rolls_out_verifies_and_commits(apiserver: ApiServer, api: Api) -> None:
    api.create(POLICY_PATH, fast_policy())
    create_cr(api, "Auto")
    metrics = SyntheticSnapshots()
    with (
        FakeKubelet(apiserver, NS),
        running_operator(apiserver.operator_credentials(), interval_s=0.5, snapshot_source=metrics),
    ):
        changed = wait_for(
            lambda: (k := knobs_of(api.get(f"{DEPLOYMENT_PATH}/llama"))) != START and k,
            30,
            message="new knobs on the Deployment",
        )
        assert changed.max_num_batched_tokens < START.max_num_batched_tokens
        committed = wait_for(
            lambda: [t for t in tuning(api).get("trials", []) if t["outcome"] == "Committed"],
            30,
            message="a committed trial",
        )
        assert Knobs.from_dict(committed[0]["knobs"]) == changed
        state = tuning(api)
        assert Knobs.from_dict(state["lastGood"]) != START


def test_crashing_candidate_is_rolled_back_and_remembered(apiserver: ApiServer, api: Api) -> None:
    api.create(POLICY_PATH, fast_policy())
    create_cr(api, "Auto")
    metrics = SyntheticSnapshots()
    bad = lambda k: k is not None and k != START  # noqa: E731 - every candidate crashes
    with (
        FakeKubelet(apiserver, NS, is_bad=bad),
        running_operator(apiserver.operator_credentials(), interval_s=0.5, snapshot_source=metrics),
    ):
        wait_for(lambda: tuning(api).get("infeasible"), 40, message="an infeasible entry")
        wait_for(
            lambda: knobs_of(api.get(f"{DEPLOYMENT_PATH}/llama")) == START,
            20,
            message="rolled back to the starting knobs",
        )
        state = tuning(api)
        outcomes = {t["outcome"] for t in state["trials"]}
        assert outcomes & {"OOMKilled", "Crashed", "RolledBack"}, state["trials"]
        bad_knobs = [Knobs.from_dict(i["knobs"]) for i in state["infeasible"]]
        assert all(k != START for k in bad_knobs)


def test_restart_during_a_rollout_resumes_without_a_second_rollout(
    apiserver: ApiServer, api: Api
) -> None:
    api.create(POLICY_PATH, fast_policy(verifyWindow="6s"))
    create_cr(api, "Auto")
    metrics = SyntheticSnapshots()
    with FakeKubelet(apiserver, NS) as kubelet:
        with running_operator(
            apiserver.operator_credentials(), interval_s=0.5, snapshot_source=metrics
        ):
            wait_for(
                lambda: tuning(api).get("phase") in ("RollingOut", "Verifying"),
                30,
                message="a trial in flight",
            )
        trial_ids = [t["id"] for t in tuning(api)["trials"]]
        assert trial_ids == [1]
        with running_operator(
            apiserver.operator_credentials(), interval_s=0.5, snapshot_source=metrics
        ):
            wait_for(
                lambda: [t for t in tuning(api)["trials"] if t["outcome"] != "Pending"],
                40,
                message="the trial finished after the restart",
            )
            state = tuning(api)
        assert state["trials"][0]["id"] == 1
        assert state["trials"][0]["outcome"] == "Committed"
        # Two revisions: the start and the one candidate (a second rollout would add one more
        # before the first trial ended).
        assert len(kubelet.revisions_seen) >= 2
        first_candidate = Knobs.from_dict(state["trials"][0]["knobs"])
        assert first_candidate != START
