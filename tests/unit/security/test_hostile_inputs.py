"""Every hostile object in the corpus is stopped where the corpus says, with a clear message,
and nothing of it reaches a pod except as one verbatim argv entry."""

from __future__ import annotations

import asyncio
import copy
from typing import Any, cast

import pytest
from pydantic import BaseModel, ValidationError

from tests.support.crd_validation import validate
from tests.unit.security.corpus import CORPUS, DELETE, DEPLOYMENT, POLICY, Hostile
from vllm_autotuner.adapters.kube import KubeClient
from vllm_autotuner.api import VLLMDeployment, VLLMTuningPolicy
from vllm_autotuner.api.crds import render_crds
from vllm_autotuner.controller import Controller, policy_status_patch, utcnow

MODELS: dict[str, type[BaseModel]] = {
    "VLLMDeployment": VLLMDeployment,
    "VLLMTuningPolicy": VLLMTuningPolicy,
}
CRDS = {crd["spec"]["names"]["kind"]: crd for crd in render_crds()}
ADMISSION = [h for h in CORPUS if h.layer in ("schema", "cel")]
REFUSED = [h for h in CORPUS if h.layer != "inert" and not h.lax]
LAX = [h for h in CORPUS if h.lax]
INERT = [h for h in CORPUS if h.layer == "inert"]


def _marks(items: list[Hostile]) -> list[Any]:
    return [
        pytest.param(
            h,
            id=h.id,
            marks=[pytest.mark.xfail(reason=h.hole, strict=True)] if h.hole else [],
        )
        for h in items
    ]


def hostile_object(h: Hostile) -> dict[str, Any]:
    obj = copy.deepcopy(h.base)
    for path, value in h.changes:
        *parents, leaf = path.split(".")
        node = obj
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return obj


class RecordingKube:
    """Stands in for KubeClient: records what the controller would write."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []
        self.patches: list[dict[str, Any]] = []

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(copy.deepcopy(manifest))
        return manifest

    async def get(self, path: str) -> dict[str, Any] | None:
        return None  # no object of that name exists yet

    async def merge_patch(
        self, path: str, body: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        self.patches.append(copy.deepcopy(body))
        return body


def reconcile(deployment: dict[str, Any], policy_spec: dict[str, Any]) -> RecordingKube:
    kube = RecordingKube()
    controller = Controller(cast(KubeClient, kube))
    asyncio.run(
        controller.reconcile(
            deployment,
            policies={"default": policy_spec},
            namespace_labels={},
            children={"Deployment": None, "Service": None},
        )
    )
    return kube


def conditions(kube: RecordingKube) -> dict[str, dict[str, Any]]:
    assert kube.patches, "the operator wrote no status"
    return {c["type"]: c for c in kube.patches[-1]["status"].get("conditions", [])}


# ------------------------------------------------------------------ the corpus itself


def test_corpus_covers_every_layer_and_kind() -> None:
    layers = {h.layer for h in CORPUS}
    assert layers == {"schema", "cel", "pydantic", "condition", "inert"}
    assert {h.kind for h in CORPUS} == {"VLLMDeployment", "VLLMTuningPolicy"}
    assert len({h.id for h in CORPUS}) == len(CORPUS) >= 60


def test_base_objects_are_valid() -> None:
    for base in (DEPLOYMENT, POLICY):
        assert validate(CRDS[base["kind"]], base) == []
        MODELS[base["kind"]].model_validate(base)
    kube = reconcile(DEPLOYMENT, POLICY["spec"])
    assert [m["kind"] for m in kube.applied] == ["Deployment", "Service"]


# ------------------------------------------------------------------ admission


@pytest.mark.parametrize("h", _marks(ADMISSION))
def test_admission_rejects_with_a_clear_message(h: Hostile) -> None:
    messages = [v.message for v in validate(CRDS[h.kind], hostile_object(h))]
    assert any(h.fragment in m for m in messages), messages
    assert not any(m.startswith("CEL evaluation error") for m in messages), messages


@pytest.mark.parametrize("h", _marks(REFUSED))
def test_models_reject(h: Hostile) -> None:
    """The operator's own models refuse what admission refuses (and what JSON cannot carry)."""
    with pytest.raises(ValidationError) as caught:
        MODELS[h.kind].model_validate(hostile_object(h))
    if h.layer in ("cel", "pydantic", "condition"):
        assert h.fragment in str(caught.value)


# ------------------------------------------------------------------ the operator, past admission


@pytest.mark.parametrize("h", _marks([h for h in REFUSED if h.kind == "VLLMDeployment"]))
def test_operator_refuses_a_hostile_deployment_with_a_condition(h: Hostile) -> None:
    """As if admission had been bypassed (a stale CRD, a direct etcd write): no child is
    rendered and Degraded says why."""
    kube = reconcile(hostile_object(h), POLICY["spec"])
    assert kube.applied == []
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "spec is invalid" in degraded["message"]


@pytest.mark.parametrize("h", _marks([h for h in REFUSED if h.kind == "VLLMTuningPolicy"]))
def test_operator_refuses_a_hostile_policy_with_conditions(h: Hostile) -> None:
    policy = hostile_object(h)
    valid = {c["type"]: c for c in policy_status_patch(policy, utcnow()).get("conditions", [])}[
        "Valid"
    ]
    assert valid["status"] == "False"
    field = h.changes[0][0].split(".")[1]  # the message names the offending field
    assert field in valid["message"]
    kube = reconcile(DEPLOYMENT, policy["spec"])
    assert kube.applied == []
    assert conditions(kube)["PolicyResolved"]["reason"] == "PolicyInvalid"


@pytest.mark.parametrize("h", _marks(LAX))
def test_lax_values_become_the_number_they_spell(h: Hostile) -> None:
    """Admission refuses "3" for an integer; the operator's models are lax and read it as 3,
    which is what the author meant and harmless. The rendered Deployment says so."""
    obj = hostile_object(h)
    path, raw = h.changes[0]
    value = raw if not isinstance(raw, dict) else next(iter(raw.values()))
    kube = reconcile(obj, POLICY["spec"])
    deployment = next(m for m in kube.applied if m["kind"] == "Deployment")
    if path == "spec.replicas":
        assert deployment["spec"]["replicas"] == int(value)
    else:
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--gpu-memory-utilization") + 1] == str(float(value))


# ------------------------------------------------------------------ what is admitted is inert


@pytest.mark.parametrize("h", _marks(INERT))
def test_admitted_values_reach_the_pod_verbatim_and_without_a_shell(h: Hostile) -> None:
    obj = hostile_object(h)
    assert validate(CRDS[h.kind], obj) == []
    kube = reconcile(obj, POLICY["spec"])
    deployment = next(m for m in kube.applied if m["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    # exec form: the kubelet runs vllm directly, so no shell ever parses an argument
    assert container["command"] == ["vllm", "serve"]
    args: list[str] = container["args"]
    spec = obj["spec"]
    for value in [spec["model"], *spec.get("engine", {}).get("extraArgs", [])]:
        assert args.count(value) == 1
    assert not any(ch in arg for arg in args for ch in "\x00\r\n")
    # the tuned knobs appear exactly once each, as the operator rendered them
    for flag in ("--max-num-batched-tokens", "--max-num-seqs", "--gpu-memory-utilization"):
        assert sum(a == flag or a.startswith(flag + "=") for a in args) == 1
