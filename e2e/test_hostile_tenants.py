"""Hostile tenants on the one-machine cluster: the operator stays up and keeps reconciling the
other tenants while hostile objects exist (issue 15).

Before the operator starts, the cluster already holds one object of each kind that used to
hurt someone else: a Deployment with the operator's labels nested 5000 levels deep (deeper
than Python decodes by default; the real API server serves up to 10000), a VLLMDeployment
whose name is taken by a stranger's Service, one in mode Off naming a policy that does not
exist, one with a deep free-form affinity. The real kube-apiserver admits these (the CRD's
schema prunes the affinity); one whose name would make an invalid Service and one that turns
chunked prefill off are refused at admission by the CRD's CEL rules, with a message that
names the field (the operator's own checks of both, for objects that got past admission, are
unit tests of the controller). Then a well-behaved tenant arrives, is deployed and served,
and its next spec change is rolled out, while every hostile object is reported on its own
status and the stranger's Service is left alone.

Run: `.venv/bin/pytest e2e -m e2e -k hostile`.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from tests.support.waiting import wait_for

from e2e.conftest import MakeLoop
from e2e.harness import POLICY_PATH, ClosedLoop, condition, cr_path
from vllm_localcluster.demo import DEMO_DEPLOYMENT, DEMO_POLICY

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(300)]

MANAGED = {"app.kubernetes.io/managed-by": "vllm-autotuner"}
DEPTH = 5000


def nested(depth: int) -> dict[str, Any]:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return dict(value)


@pytest.fixture
def deep_json() -> Iterator[None]:
    """The test's client encodes objects deeper than Python's default recursion limit."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 40_000))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def tenant(name: str, **spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(DEMO_DEPLOYMENT)
    obj["metadata"] = {"name": name}
    obj["spec"]["tuning"] = {"mode": "Off", "policyRef": DEMO_POLICY["metadata"]["name"]}
    obj["spec"].update(spec)
    return obj


def deep_deployment() -> dict[str, Any]:
    template_spec: dict[str, Any] = {"containers": [{"name": "x", "image": "x"}]}
    template_spec["x-deep"] = nested(DEPTH)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "deep", "labels": dict(MANAGED)},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "deep"}},
            "template": {"metadata": {"labels": {"app": "deep"}}, "spec": template_spec},
        },
    }


FOREIGN_SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "taken", "labels": {"owner": "someone-else"}},
    "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 5432}]},
}
HOSTILE: dict[str, tuple[dict[str, Any], str, str]] = {
    # name: (object, condition, reason)
    "taken": (tenant("taken"), "Degraded", "NameConflict"),
    "nopolicy": (
        tenant(
            "nopolicy",
            tuning={"mode": "Off", "policyRef": "gone"},
            knobs={"maxNumBatchedTokens": 1048576, "gpuMemoryUtilization": 0.99},
        ),
        "PolicyResolved",
        "PolicyNotFound",
    ),
}


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    # name: (object, what the admission error names)
    "bad.name": (tenant("bad.name"), "metadata.name"),
    "chunked-off": (
        tenant("chunked-off", engine={"extraArgs": ["--no-enable-chunked-prefill"]}),
        "spec.engine.extraArgs[0]",
    ),
}


def merge(loop: ClosedLoop, path: str, body: dict[str, Any]) -> None:
    r = loop.session.patch(
        loop.url(path),
        json=body,
        headers={"Content-Type": "application/merge-patch+json"},
        timeout=10,
    )
    r.raise_for_status()


def max_num_seqs(loop: ClosedLoop) -> str | None:
    spec = (loop.deployment().get("spec") or {}).get("template", {}).get("spec") or {}
    args = (spec.get("containers") or [{}])[0].get("args") or []
    return args[args.index("--max-num-seqs") + 1] if "--max-num-seqs" in args else None


def test_the_operator_keeps_reconciling_other_tenants_while_hostile_objects_exist(
    deep_json: None, closed_loop: MakeLoop
) -> None:
    loop = closed_loop()
    ns = loop.namespace
    loop.create(POLICY_PATH, DEMO_POLICY)
    loop.create(f"/apis/apps/v1/namespaces/{ns}/deployments", deep_deployment())
    loop.create(f"/api/v1/namespaces/{ns}/services", FOREIGN_SERVICE)
    for obj, _, _ in HOSTILE.values():
        loop.create(cr_path(ns), obj)
    for name, (obj, named) in REFUSED.items():
        refused = loop.session.post(loop.url(cr_path(ns)), json=obj, timeout=10)
        assert refused.status_code == 422, (name, refused.status_code, refused.text)
        assert named in refused.text, refused.text
    deep_affinity = tenant("deep-affinity")
    deep_affinity["spec"]["placement"] = {"affinity": {"x": nested(DEPTH)}}
    loop.create(cr_path(ns), deep_affinity)  # pruned to an empty affinity by the CRD's schema

    loop.start_operator()
    loop.create(cr_path(ns), tenant("good", knobs={"maxNumSeqs": 64}))
    loop.name = "good"

    def serving() -> bool:
        assert loop.operator_alive(), f"the operator exited:\n{loop.log_tail()}"
        return condition(loop.status(), "Ready").get("status") == "True"

    wait_for(serving, timeout=150, interval=1.0, message="the good tenant to be served")

    for name, (_, cond_type, reason) in HOSTILE.items():

        def reported(obj_name: str = name, want: str = reason, kind: str = cond_type) -> bool:
            found = loop.get(f"{cr_path(ns)}/{obj_name}") or {}
            return condition(found.get("status") or {}, kind).get("reason") == want

        wait_for(reported, timeout=30, interval=0.5, message=f"{name}: {cond_type} {reason}")
        path = f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"
        assert loop.get(path) is None, f"{name} was deployed"
    service = loop.get(f"/api/v1/namespaces/{ns}/services/taken") or {}
    assert "ownerReferences" not in service["metadata"]
    assert service["spec"]["selector"] == {"app": "theirs"}
    wait_for(
        lambda: loop.get(f"/apis/apps/v1/namespaces/{ns}/deployments/deep-affinity"),
        timeout=30,
        message="the pruned deep-affinity tenant to be deployed like any other",
    )

    # The good tenant's next change is rolled out while all of the above still exists.
    merge(loop, f"{cr_path(ns)}/good", {"spec": {"knobs": {"maxNumSeqs": 128}}})
    wait_for(
        lambda: max_num_seqs(loop) == "128" or not loop.operator_alive(),
        timeout=60,
        interval=0.5,
        message="the good tenant's new knobs on its Deployment",
    )
    assert loop.operator_alive(), f"the operator exited:\n{loop.log_tail()}"
