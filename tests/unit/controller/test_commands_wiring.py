"""The controller honours pause (a rollout it would make becomes a hold, said in status) and
acts on a retry request once, recording it in status.handledRequests."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from tests.support.cluster_api import CR, POLICY
from tests.support.echo_kube import EchoKube, ready_pod
from tests.support.fake_fleet import SyntheticSnapshots
from vllm_autotuner.adapters.kube import KubeClient
from vllm_autotuner.controller import Controller, Outcome
from vllm_autotuner.core.commands import PAUSE_ANNOTATION, REQUEST_ANNOTATIONS
from vllm_autotuner.observer import Observer


class Rig:
    """A CR in mode Auto whose ITL is over the SLO, with a surge pod for rollouts (headroom):
    the tuner wants to roll out at once."""

    def __init__(self) -> None:
        self.kube = EchoKube()
        self.now = datetime.now(UTC)
        source = SyntheticSnapshots(rate=10.0)
        observer = Observer(source, clock=lambda: self.now)
        self.controller = Controller(
            cast(KubeClient, self.kube), clock=lambda: self.now, observer=observer
        )
        self.body = copy.deepcopy(CR)
        self.body["spec"]["tuning"]["mode"] = "Auto"
        self.body["spec"]["rollout"] = {"maxSurge": 1, "maxUnavailable": 0}
        self.body["metadata"].update(
            namespace="default", uid="u-1", resourceVersion="5", generation=1, annotations={}
        )

    async def reconcile(self) -> Outcome:
        self.body["status"] = copy.deepcopy(self.kube.status)
        deployments = [m for m in self.kube.applied if m["kind"] == "Deployment"]
        children: dict[str, Any] = {"Deployment": None, "Service": None}
        pods, sets = [], []
        if deployments:
            children["Deployment"] = deployments[-1]
            pod, replicaset = ready_pod(deployments[-1])
            pods, sets = [pod], [replicaset]
            await self.controller.observer.refresh()
        outcome = await self.controller.reconcile(
            self.body,
            policies={"default": copy.deepcopy(POLICY["spec"])},
            namespace_labels={},
            children=children,
            pods=pods,
            replicasets=sets,
        )
        self.now += timedelta(minutes=10)
        return outcome

    def condition(self, cond_type: str) -> dict[str, Any]:
        (cond,) = [c for c in self.kube.status["conditions"] if c["type"] == cond_type]
        return dict(cond)


def reasons(outcome: Outcome) -> list[str]:
    return [event.reason for event in outcome.events]


async def test_pause_holds_the_rollout_the_tuner_wants_and_resume_lets_it_go() -> None:
    rig = Rig()
    rig.body["metadata"]["annotations"][PAUSE_ANNOTATION] = "true"
    first = await rig.reconcile()
    assert "TuningPaused" in reasons(first) and rig.kube.status["paused"] is True
    await rig.reconcile()  # the observer's first cycle saw no pod yet
    held = await rig.reconcile()  # metrics now: without the pause this is a rollout
    assert "RolloutStarted" not in reasons(held) and "Deployment" not in held.applied
    decision = rig.kube.status["tuning"]["lastDecision"]
    assert decision["action"] == "hold" and "would roll out" in decision["reason"]
    assert rig.condition("Tuning")["reason"] == "Paused"

    del rig.body["metadata"]["annotations"][PAUSE_ANNOTATION]
    resumed = await rig.reconcile()
    assert "TuningResumed" in reasons(resumed) and "RolloutStarted" in reasons(resumed)
    assert "paused" not in rig.kube.status


async def test_retry_is_acted_on_once_and_recorded() -> None:
    rig = Rig()
    await rig.reconcile()
    stamp = "2026-12-02T12:00:00.000000Z"
    rig.body["metadata"]["annotations"][REQUEST_ANNOTATIONS["retry"]] = stamp
    acted = await rig.reconcile()
    assert "RetryRequested" in reasons(acted)
    assert rig.kube.status["handledRequests"] == {"retry": stamp}
    again = await rig.reconcile()
    assert "RetryRequested" not in reasons(again)
