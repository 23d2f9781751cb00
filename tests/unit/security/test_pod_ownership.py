"""Class 7: pods are counted by ownership, never by their labels.

Any pod carrying the child labels used to count as the deployment's own: its crash-loop
degraded the deployment, and its metrics fed the tuner. Now a pod counts only when a
ReplicaSet of the Deployment this VLLMDeployment controls controls it. Each case adds one pod
that carries every label of the deployment but is not so owned, in two states: crash-looping
(it must not degrade the deployment) and ready (it must not be observed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.unit.security.corpus import POLICY
from tests.unit.security.hostile_objects import (
    RecordingKube,
    conditions,
    controller,
    deployment,
    reconcile,
)
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.core.snapshot import Snapshot
from vllm_autotuner.observer import Observer

CR_UID = "uid-1"
DEPLOYMENT_UID = "d-1"


def _ref(kind: str, uid: str, api: str = "apps/v1", controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": api, "kind": kind, "name": "x", "uid": uid, "controller": controller}


def _rs(uid: str, deployment_uid: str) -> dict[str, Any]:
    return {"metadata": {"uid": uid, "ownerReferences": [_ref("Deployment", deployment_uid)]}}


REPLICASETS = [_rs("rs-1", DEPLOYMENT_UID), _rs("rs-other", "d-other")]
HOSTILE_OWNERS: dict[str, list[dict[str, Any]]] = {
    "labels-only": [],
    "unknown-replicaset": [_ref("ReplicaSet", "rs-unknown")],
    "another-deployments-replicaset": [_ref("ReplicaSet", "rs-other")],
    "job-with-our-rs-uid": [_ref("Job", "rs-1", api="batch/v1")],
    "our-rs-uid-other-api": [_ref("ReplicaSet", "rs-1", api="extensions/v1beta1")],
    "our-rs-not-controller": [_ref("ReplicaSet", "rs-1", controller=False)],
    "our-deployment-directly": [_ref("Deployment", DEPLOYMENT_UID)],
    "statefulset": [_ref("StatefulSet", "ss-1")],
}


def _pod(
    template: Mapping[str, Any],
    name: str,
    owners: list[dict[str, Any]],
    *,
    crash: bool,
    ready_for: timedelta = timedelta(hours=1),
) -> dict[str, Any]:
    ready_at = (datetime.now(tz=UTC) - ready_for).strftime("%Y-%m-%dT%H:%M:%SZ")
    status: dict[str, Any] = {"name": "vllm", "ready": not crash, "restartCount": 0}
    if crash:
        status.update(restartCount=5, state={"waiting": {"reason": "CrashLoopBackOff"}})
    return {
        "metadata": {
            "name": name,
            "namespace": "team-a",
            "labels": dict(template["metadata"]["labels"]),
            "annotations": dict(template["metadata"]["annotations"]),
            "ownerReferences": owners,
        },
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False" if crash else "True",
                    "lastTransitionTime": ready_at,
                }
            ],
            "containerStatuses": [status],
        },
    }


class CapturingSource:
    def __init__(self) -> None:
        self.targets: list[SnapshotTarget] = []

    async def snapshots(self, targets: Any, now: datetime) -> dict[tuple[str, str], Snapshot]:
        self.targets.extend(targets)
        return {}


def _our_deployment() -> dict[str, Any]:
    kube, _ = reconcile(deployment())
    applied = next(m for m in kube.applied if m["kind"] == "Deployment")
    return {**applied, "metadata": {**applied["metadata"], "uid": DEPLOYMENT_UID}}


def _run(pods: list[dict[str, Any]]) -> tuple[RecordingKube, list[SnapshotTarget]]:
    live = _our_deployment()
    kube = RecordingKube()
    source = CapturingSource()
    ctl = controller(kube)
    ctl.observer = Observer(source, clock=ctl.clock)
    service = {
        "metadata": {
            "ownerReferences": [_ref("VLLMDeployment", CR_UID, "vllm.autotuner.io/v1alpha1")]
        }
    }

    async def go() -> None:
        await ctl.reconcile(
            deployment(),
            policies={"default": dict(POLICY["spec"])},
            namespace_labels={},
            children={"Deployment": live, "Service": service},
            pods=pods,
            replicasets=REPLICASETS,
        )
        await ctl.observer.refresh()

    asyncio.run(go())
    return kube, source.targets


@pytest.mark.parametrize("owners", HOSTILE_OWNERS.values(), ids=list(HOSTILE_OWNERS))
def test_a_crash_looping_pod_we_do_not_own_does_not_degrade_the_deployment(
    owners: list[dict[str, Any]],
) -> None:
    template = _our_deployment()["spec"]["template"]
    mine = _pod(template, "llama-mine", [_ref("ReplicaSet", "rs-1")], crash=False)
    stranger = _pod(template, "llama-stranger", owners, crash=True)
    kube, _ = _run([mine, stranger])
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("False", "AsExpected"), degraded


@pytest.mark.parametrize("owners", HOSTILE_OWNERS.values(), ids=list(HOSTILE_OWNERS))
def test_a_ready_pod_we_do_not_own_never_feeds_the_tuner(owners: list[dict[str, Any]]) -> None:
    template = _our_deployment()["spec"]["template"]
    mine = _pod(template, "llama-mine", [_ref("ReplicaSet", "rs-1")], crash=False)
    stranger = _pod(template, "llama-stranger", owners, crash=False)
    _, targets = _run([mine, stranger])
    assert targets, "the controller asked for no observation"
    assert targets[-1].pods == ("llama-mine",)


def test_the_pods_age_is_our_own_pods_not_a_strangers() -> None:
    """The observation carries when our newest ready pod became ready (a young window's
    correction rests on it, core/censoring.py); a fresher pod we do not own moves nothing."""
    template = _our_deployment()["spec"]["template"]
    mine = _pod(template, "llama-mine", [_ref("ReplicaSet", "rs-1")], crash=False)
    stranger = _pod(template, "llama-stranger", [], crash=False, ready_for=timedelta(seconds=5))
    _, targets = _run([mine, stranger])
    assert targets and targets[-1].pods_since is not None
    age = datetime.now(tz=UTC) - targets[-1].pods_since
    assert timedelta(minutes=59) < age < timedelta(minutes=61), age


def test_our_own_crash_looping_pod_still_degrades_the_deployment() -> None:
    template = _our_deployment()["spec"]["template"]
    mine = _pod(template, "llama-mine", [_ref("ReplicaSet", "rs-1")], crash=True)
    kube, _ = _run([mine])
    assert conditions(kube)["Degraded"]["reason"] == "CrashLoopBackOff"
