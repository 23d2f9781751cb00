"""Pods fail: never ready, crash-looping, OOM-killed long after a change was committed.

Every failure ends on the last good configuration, with the bad one remembered so the tuner
does not try it again.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tests.support.cluster_api import CR_PATH, NS, POLICY_PATH, Api, ApiServer
from tests.support.fake_fleet import SyntheticSnapshots
from tests.support.faults import (
    START,
    FaultyKubelet,
    cr_with_mode,
    events,
    fast_policy,
    live_knobs,
    oom_kill_later,
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


def _ended(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for t in trials if t["outcome"] != "Pending"]


def _seconds(trial: dict[str, Any]) -> float:
    start = datetime.fromisoformat(trial["startedAt"].replace("Z", "+00:00"))
    end = datetime.fromisoformat(trial["endedAt"].replace("Z", "+00:00"))
    return (end - start).total_seconds()


def _not_start(k: Knobs | None) -> bool:
    return k is not None and k != START


def test_candidate_never_ready_is_rolled_back_after_ready_timeout(
    apiserver: ApiServer, proxy: FaultProxy, api: Api
) -> None:
    api.create(POLICY_PATH, fast_policy(readyTimeout="3s", maxPerDay=2))
    api.create(CR_PATH, cr_with_mode("Auto"))
    with (
        FaultyKubelet(apiserver, NS, stuck=_not_start),
        operator(operator_config(proxy), SyntheticSnapshots()),
    ):
        first = wait_for(lambda: _ended(trials_of(api)), 30, message="the first trial ended")[0]
        assert first["outcome"] == "NotReady", first
        assert _seconds(first) >= 3.0, first  # not before readyTimeout
        wait_for(lambda: live_knobs(api) == START, 20, message="back on the last good knobs")
        state = tuning_of(api)
        assert [(i["kind"], i["knobs"]) for i in state["infeasible"]] == [
            ("NotReady", first["knobs"])
        ]
        # The next trial (the budget allows one) avoids the configuration that hung.
        second = wait_for(lambda: _ended(trials_of(api))[1:], 30, message="the second trial ended")[
            0
        ]
        assert second["knobs"] != first["knobs"]
        wait_for(lambda: live_knobs(api) == START, 20, message="back on the last good knobs")
    assert template_history(proxy)[0] == START


def test_crash_looping_candidate_is_rolled_back_and_remembered(
    apiserver: ApiServer, proxy: FaultProxy, api: Api
) -> None:
    api.create(POLICY_PATH, fast_policy(maxPerDay=1))
    api.create(CR_PATH, cr_with_mode("Auto"))
    with (
        FaultyKubelet(apiserver, NS, crashing=_not_start),
        operator(operator_config(proxy), SyntheticSnapshots()),
    ):
        (trial,) = wait_for(lambda: _ended(trials_of(api)), 30, message="the trial ended")
        assert trial["outcome"] == "Crashed", trial
        assert "CrashLoopBackOff" in trial["reason"]
        wait_for(lambda: live_knobs(api) == START, 20, message="rolled back")
        state = tuning_of(api)
        assert [(i["kind"], i["knobs"]) for i in state["infeasible"]] == [
            ("Crashed", trial["knobs"])
        ]
        wait_for(lambda: events(api, "TuningRolledBack"), 10, message="a rollback event")


def test_oom_killed_long_after_commit_rolls_back_to_the_previous_good_configuration(
    apiserver: ApiServer, proxy: FaultProxy, api: Api
) -> None:
    api.create(POLICY_PATH, fast_policy(maxPerDay=1))
    api.create(CR_PATH, cr_with_mode("Auto"))
    with (
        FaultyKubelet(apiserver, NS),
        operator(operator_config(proxy), SyntheticSnapshots()),
    ):
        (trial,) = wait_for(lambda: _ended(trials_of(api)), 30, message="a committed trial")
        assert trial["outcome"] == "Committed", trial
        committed = Knobs.from_dict(trial["knobs"])
        wait_for(
            lambda: tuning_of(api).get("phase") not in ("Committed", "RollingOut", "Verifying"),
            20,
            message="settled after the commit",
        )
        assert live_knobs(api) == committed
        # Much later, under some traffic peak, the committed configuration runs out of memory.
        oom_kill_later(api, committed)
        wait_for(lambda: live_knobs(api) == START, 20, message="rolled back to the start")
        state = wait_some(
            lambda: t if (t := tuning_of(api)).get("infeasible") else None,
            10,
            "the OOM remembered",
        )
        assert [(i["kind"], i["knobs"]) for i in state["infeasible"]] == [
            ("OOMKilled", committed.to_dict())
        ]
        assert state["lastGood"] == START.to_dict() == state["applied"]
        assert (state.get("stableGpuMemoryUtilization") or 0) <= START.gpu_memory_utilization
        rolled = wait_for(lambda: events(api, "TuningRolledBack"), 10, message="an event")
        assert "OOMKilled" in rolled[-1]["message"]
        # The trial history still says what happened: committed, then failed later.
        assert trials_of(api)[0]["outcome"] == "Committed"
    assert template_history(proxy) == [START, committed, START]
