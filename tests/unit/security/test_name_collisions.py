"""Class 2: a name collision never takes over someone else's object.

A VLLMDeployment named like an existing Service or Deployment the operator did not create used
to get that object server-side-applied with force and an owner reference added (so deleting
the VLLMDeployment let the garbage collector delete the stranger's object). Now a child counts
as ours only by its controller reference to this VLLMDeployment's uid; anything else under the
name is left untouched, nothing is deployed, and a NameConflict condition and Event say why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.unit.security.hostile_objects import RecordingKube, conditions, deployment, reconcile

UID = "uid-1"  # the corpus deployment's uid
GROUP_VERSION = "vllm.autotuner.io/v1alpha1"
PATHS = {
    "Deployment": "/apis/apps/v1/namespaces/team-a/deployments/llama",
    "Service": "/api/v1/namespaces/team-a/services/llama",
}
MANAGED = {"app.kubernetes.io/managed-by": "vllm-autotuner"}
OURS = {**MANAGED, "vllm.autotuner.io/deployment": "llama"}


def _ref(**ref: Any) -> dict[str, Any]:
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "VLLMDeployment",
        "name": "llama",
        "uid": UID,
        "controller": True,
        **ref,
    }


@dataclass(frozen=True)
class Foreign:
    id: str
    labels: dict[str, str]
    owners: list[dict[str, Any]]


FOREIGN = [
    Foreign("plain", {}, []),
    Foreign("our-managed-by-label", MANAGED, []),
    Foreign("our-child-labels", OURS, []),
    Foreign("orphan-of-a-deleted-namesake", OURS, [_ref(uid="uid-of-a-deleted-one")]),
    Foreign(
        "another-controller",
        {},
        [
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "name": "x",
                "uid": "u9",
                "controller": True,
            }
        ],
    ),
    Foreign("our-uid-not-controller", OURS, [_ref(controller=False)]),
    Foreign("our-uid-other-group", OURS, [_ref(apiVersion="evil.example/v1")]),
    Foreign("our-uid-other-kind", OURS, [_ref(kind="Deployment")]),
]
CASES = [(f, kind) for f in FOREIGN for kind in ("Deployment", "Service")]


def _foreign(f: Foreign, kind: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "llama", "namespace": "team-a", "labels": dict(f.labels)}
    if f.owners:
        meta["ownerReferences"] = f.owners
    api = "apps/v1" if kind == "Deployment" else "v1"
    return {"apiVersion": api, "kind": kind, "metadata": meta, "spec": {"replicas": 3}}


@pytest.mark.parametrize(("f", "kind"), CASES, ids=[f"{f.id}-{k.lower()}" for f, k in CASES])
def test_a_foreign_object_under_the_childs_name_is_left_untouched(f: Foreign, kind: str) -> None:
    obj = _foreign(f, kind)
    kube = RecordingKube(objects={PATHS[kind]: obj})
    # An object with our labels is in the operator's index; others are found by a GET.
    children = {"Deployment": None, "Service": None}
    if f.labels:
        children[kind] = obj
    _, outcome = reconcile(deployment(), kube=kube, children=children)
    assert kube.applied == [], "a foreign object was applied to (or a sibling deployed)"
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "NameConflict")
    assert f"a {kind} named llama already exists" in degraded["message"]
    assert [e.type for e in outcome.events if e.reason == "NameConflict"] == ["Warning"]


def test_the_conflict_is_announced_once_not_every_reconcile() -> None:
    kube = RecordingKube(objects={PATHS["Service"]: _foreign(FOREIGN[0], "Service")})
    reconcile(deployment(), kube=kube)
    status = {}
    for patch in kube.patches:
        status.update(patch["status"])
    _, again = reconcile({**deployment(), "status": status}, kube=kube)
    assert not [e for e in again.events if e.reason == "NameConflict"]
    assert kube.applied == []


def test_once_the_name_is_free_the_children_are_created() -> None:
    kube = RecordingKube()
    reconcile(deployment(), kube=kube)
    assert [m["kind"] for m in kube.applied] == ["Deployment", "Service"]
    assert sorted(kube.gets) == sorted(PATHS.values())  # looked before creating


def test_children_this_deployment_controls_are_updated_as_usual() -> None:
    kube = RecordingKube()
    reconcile(deployment(), kube=kube)
    mine = {m["kind"]: m for m in kube.applied}
    stale = {**mine["Deployment"], "spec": {**mine["Deployment"]["spec"], "replicas": 7}}
    again = RecordingKube()
    reconcile(deployment(), kube=again, children={"Deployment": stale, "Service": mine["Service"]})
    assert [m["kind"] for m in again.applied] == ["Deployment"]
    assert conditions(again)["Degraded"]["reason"] != "NameConflict"
