"""Class 5: values the CRD used to accept and the API server then refused, unseen by the user.

Every case here would make the rendered Deployment or Service invalid (a 422 from the API
server, retried for ever while the status said nothing). Each must be refused where it can be:
at admission (schema or CEL, checked with the CRD's own rules) and by the operator's models, so
the operator renders nothing and says why in a condition. What admission cannot check, the
operator refuses with a condition; and what still reaches the API server and is refused
becomes a condition and an Event, with back-off instead of a PATCH loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import kubernetes_validate
import pytest
from pydantic import ValidationError

from tests.support.crd_validation import validate
from tests.unit.security.hostile_objects import (
    Clock,
    RecordingKube,
    conditions,
    controller,
    deployment,
    last_status,
    reconcile,
)
from vllm_autotuner.adapters.kube import KubeError
from vllm_autotuner.api import VLLMDeployment
from vllm_autotuner.api.crds import render_crds

CRD = render_crds()[0]
# resource.Quantity's grammar (k8s.io/apimachinery/pkg/api/resource), restated without a sign.
QUANTITY_PATTERN = (
    r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?"
)
Layer = Literal["admission", "operator"]


@dataclass(frozen=True)
class Refused:
    id: str
    changes: tuple[tuple[str, Any], ...]
    layer: Layer = "admission"  # "operator": no CEL can check it; the models must


def _c(id: str, path: str, value: Any, layer: Layer = "admission") -> Refused:
    return Refused(id, ((path, value),), layer)


def _pod(id: str, **pod: Any) -> Refused:
    return Refused(id, (("spec.pod", pod),))


VOL = {"name": "cache", "emptyDir": {}}
CASES: list[Refused] = [
    # ---- names: the CR's name becomes the Service's (a DNS-1035 label) and a label value
    _c("name-dot", "metadata.name", "llama.v1"),
    _c("name-dots", "metadata.name", "a.b.c"),
    _c("name-leading-digit", "metadata.name", "1llama"),
    _c("name-only-digits", "metadata.name", "9"),
    _c("name-64-chars", "metadata.name", "l" * 64),
    _c("name-200-chars-dotted", "metadata.name", ".".join(["abc"] * 50)),
    # ---- env: values are strings, names are C identifiers
    _pod("env-int-value", env=[{"name": "A", "value": 1}]),
    _pod("env-float-value", env=[{"name": "A", "value": 1.5}]),
    _pod("env-bool-value", env=[{"name": "A", "value": True}]),
    _pod("env-list-value", env=[{"name": "A", "value": ["x"]}]),
    _pod("env-name-digit", env=[{"name": "1A", "value": "x"}]),
    _pod("env-name-equals", env=[{"name": "A=B", "value": "x"}]),
    _pod("env-name-space", env=[{"name": "A B", "value": "x"}]),
    _pod("env-name-empty", env=[{"name": "", "value": "x"}]),
    _pod(
        "env-value-and-from",
        env=[
            {"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
        ],
    ),
    _pod(
        "env-two-sources",
        env=[
            {
                "name": "A",
                "valueFrom": {
                    "fieldRef": {"fieldPath": "metadata.name"},
                    "secretKeyRef": {"name": "s", "key": "k"},
                },
            }
        ],
    ),
    _pod("env-from-no-source", envFrom=[{"prefix": "X_"}]),
    _pod("env-from-bad-prefix", envFrom=[{"prefix": "1-", "secretRef": {"name": "s"}}]),
    # ---- labels, annotations and node selectors: valid label syntax only
    _pod("label-key-space", labels={"a b": "x"}),
    _pod("label-key-two-slashes", labels={"a/b/c": "x"}),
    _pod("label-key-name-64", labels={"k" * 64: "x"}),
    _pod("label-key-upper-prefix", labels={"Example.com/x": "y"}),
    _pod("label-key-empty", labels={"": "x"}),
    _pod("label-value-leading-dash", labels={"a": "-x"}),
    _pod("label-value-space", labels={"a": "x y"}),
    _pod("label-value-slash", labels={"a": "x/y"}),
    _pod("annotation-key-space", annotations={"a b": "x"}),
    _pod("annotation-key-colon", annotations={"a:b": "x"}),
    _c("node-selector-key-space", "spec.placement", {"nodeSelector": {"gpu type": "h100"}}),
    _c("node-selector-value-space", "spec.placement", {"nodeSelector": {"gpu": "H100 80GB"}}),
    _c("node-selector-value-64", "spec.placement", {"nodeSelector": {"gpu": "h" * 64}}),
    _c(
        "toleration-operator",
        "spec.placement",
        {"tolerations": [{"key": "a", "operator": "Maybe"}]},
    ),
    _c(
        "toleration-effect",
        "spec.placement",
        {"tolerations": [{"key": "a", "effect": "Sometimes"}]},
    ),
    _c(
        "toleration-exists-with-value",
        "spec.placement",
        {"tolerations": [{"key": "a", "operator": "Exists", "value": "x"}]},
    ),
    _c("gpu-resource-name-space", "spec.gpu", {"count": 1, "resourceName": "nvidia gpu"}),
    _c("gpu-resource-name-bang", "spec.gpu", {"count": 1, "resourceName": "nvidia.com/gpu!"}),
    # ---- volumes and mounts: nothing may collide with the operator's /dev/shm or each other
    _pod("volume-named-dshm", volumes=[{"name": "dshm", "emptyDir": {}}]),
    _pod("volume-duplicate-name", volumes=[VOL, VOL]),
    _pod("volume-name-upper", volumes=[{"name": "Cache", "emptyDir": {}}]),
    _pod("volume-two-sources", volumes=[{"name": "c", "emptyDir": {}, "hostPath": {"path": "/x"}}]),
    _pod("volume-no-source", volumes=[{"name": "c"}]),
    _pod("volume-host-path-relative", volumes=[{"name": "c", "hostPath": {"path": "x"}}]),
    _pod("mount-dev-shm", volumes=[VOL], volumeMounts=[{"name": "cache", "mountPath": "/dev/shm"}]),
    _pod(
        "mount-dev-shm-slash",
        volumes=[VOL],
        volumeMounts=[{"name": "cache", "mountPath": "/dev/shm/"}],
    ),
    _pod("mount-named-dshm", volumeMounts=[{"name": "dshm", "mountPath": "/x"}]),
    _pod("mount-without-volume", volumeMounts=[{"name": "nowhere", "mountPath": "/x"}]),
    _pod(
        "mount-duplicate-path",
        volumes=[VOL, {"name": "other", "emptyDir": {}}],
        volumeMounts=[
            {"name": "cache", "mountPath": "/x"},
            {"name": "other", "mountPath": "/x"},
        ],
    ),
    _pod(
        "mount-sub-path-escape",
        volumes=[VOL],
        volumeMounts=[{"name": "cache", "mountPath": "/x", "subPath": "../etc"}],
    ),
    _pod("mount-relative-path", volumes=[VOL], volumeMounts=[{"name": "cache", "mountPath": "x"}]),
    # ---- resources: a block that used to crash rendering, and quantities that do not parse
    _pod("resources-string", resources="8 cpus"),
    _pod("resources-requests-list", resources={"requests": ["cpu"]}),
    _pod("resources-requests-string", resources={"requests": "cpu=8"}),
    _pod("resources-quantity-words", resources={"requests": {"cpu": "lots"}}),
    _pod("resources-quantity-negative", resources={"requests": {"memory": "-1Gi"}}),
    _pod("resources-quantity-e-notation-unit", resources={"limits": {"memory": "1e-05Gi"}}),
    _pod("resources-quantity-negative-int", resources={"requests": {"cpu": -2}}),
    _pod("resources-key-invalid", resources={"requests": {"cpu!": "1"}}),
    Refused(
        "resources-request-over-limit",
        (("spec.pod", {"resources": {"requests": {"cpu": "8"}, "limits": {"cpu": "4"}}}),),
        "operator",
    ),
    Refused(
        "resources-memory-request-over-limit",
        (("spec.pod", {"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1G"}}}),),
        "operator",
    ),
]


def _obj(case: Refused) -> dict[str, Any]:
    return deployment(*case.changes)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_what_the_api_server_would_refuse_is_refused_first(case: Refused) -> None:
    obj = _obj(case)
    if case.layer == "admission":
        assert validate(CRD, obj), "admission accepted it"
    else:
        assert validate(CRD, obj) == [], "the case is meant for the operator's check"
    if not case.changes[0][0].startswith("metadata."):
        with pytest.raises(ValidationError):
            VLLMDeployment.model_validate(obj)
    kube, outcome = reconcile(obj)
    assert kube.applied == [], "rendered a child the API server would refuse"
    degraded = conditions(kube)["Degraded"]
    assert degraded["status"] == "True"
    assert degraded["reason"] in ("InvalidSpec", "InvalidName")
    assert any(e.reason == degraded["reason"] for e in outcome.events)


TINY_SHM = [1e-05, 1e-09, 0.0001, 0.3, 1 / 3, 7.77]


@pytest.mark.parametrize("gib", TINY_SHM, ids=[f"shm-{g:g}" for g in TINY_SHM])
def test_shm_sizes_render_as_valid_quantities(gib: float) -> None:
    kube, _ = reconcile(deployment(("spec.pod", {"shmSizeGi": gib})))
    (manifest,) = [m for m in kube.applied if m["kind"] == "Deployment"]
    (shm,) = [v for v in manifest["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    size = shm["emptyDir"]["sizeLimit"]
    assert re.fullmatch(QUANTITY_PATTERN, size), size
    kubernetes_validate.validate(manifest, str(kubernetes_validate.latest_version()), strict=True)


# ------------------------------------------------------------ what the API server still refuses

REFUSAL = KubeError(422, 'Deployment.apps "llama" is invalid: spec.template.spec: Invalid value')


def test_a_refused_child_becomes_a_condition_and_an_event() -> None:
    kube = RecordingKube(refuse_apply=REFUSAL)
    _, outcome = reconcile(deployment(), kube=kube)
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "ChildRejected")
    assert "is invalid" in degraded["message"]
    assert [e.type for e in outcome.events if e.reason == "ChildRejected"] == ["Warning"]
    assert last_status(kube)["observedGeneration"] == 1  # status is never left empty


def test_a_refused_child_is_not_sent_again_before_its_back_off() -> None:
    kube = RecordingKube(refuse_apply=REFUSAL)
    ctl = controller(kube)
    obj = deployment()
    reconcile(obj, kube=kube, ctl=ctl)
    attempts = kube.apply_attempts
    for _ in range(5):
        reconcile({**obj, "status": last_status(kube)}, kube=kube, ctl=ctl)
    assert kube.apply_attempts == attempts, "the same refused PATCH was sent again"


def test_a_refused_child_is_retried_after_its_back_off() -> None:
    kube = RecordingKube(refuse_apply=REFUSAL)
    clock = Clock()
    ctl = controller(kube, clock)
    reconcile(deployment(), kube=kube, ctl=ctl)
    attempts = kube.apply_attempts
    clock.now += timedelta(minutes=2)
    reconcile({**deployment(), "status": last_status(kube)}, kube=kube, ctl=ctl)
    assert kube.apply_attempts > attempts


def test_a_changed_spec_is_sent_at_once_after_a_refusal() -> None:
    kube = RecordingKube(refuse_apply=REFUSAL)
    ctl = controller(kube)
    reconcile(deployment(), kube=kube, ctl=ctl)
    attempts = kube.apply_attempts
    changed = deployment(("spec.replicas", 2), ("metadata.generation", 2))
    reconcile({**changed, "status": last_status(kube)}, kube=kube, ctl=ctl)
    assert kube.apply_attempts > attempts


def test_a_bad_request_is_handled_like_a_refusal() -> None:
    kube = RecordingKube(refuse_apply=KubeError(400, "the body of the request was bad"))
    reconcile(deployment(), kube=kube)
    assert conditions(kube)["Degraded"]["reason"] == "ChildRejected"


def test_a_server_error_is_still_retried_by_the_caller() -> None:
    kube = RecordingKube(refuse_apply=KubeError(500, "etcd is down"))
    with pytest.raises(KubeError):
        reconcile(deployment(), kube=kube)


class RefusingStatus(RecordingKube):
    """Refuses every status write that carries more than conditions."""

    async def merge_patch(
        self, path: str, body: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        if set(body["status"]) - {"conditions", "observedGeneration"}:
            raise KubeError(422, "status.tuning: Invalid value")
        return await super().merge_patch(path, body, subresource=subresource)


def test_a_refused_status_write_leaves_a_condition_saying_so() -> None:
    kube = RefusingStatus()
    reconcile(deployment(), kube=kube)
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "StatusRejected")
    assert "status.tuning" in degraded["message"]
