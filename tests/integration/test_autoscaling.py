"""Replica autoscalers beside the real operator, on the real API server (docs/autoscaling.md).

An "autoscaler" here writes replicas exactly as the HPA controller does: a GET and a PUT of
the target's scale subresource (autoscaling/v1 Scale) under its own field manager. The API
server's audit log and the objects' managedFields say who wrote what.
"""

from __future__ import annotations

import copy
from typing import Any

from tests.integration.test_rbac_matches_usage import ROLE, grant_chart_rules
from tests.support.cluster_api import (
    CR,
    CR_PATH,
    DEPLOYMENT_PATH,
    POLICY,
    POLICY_PATH,
    Api,
    ApiServer,
    RequestRecord,
)
from tests.support.helm import chart_rbac_rules
from tests.support.operator_runner import running_operator
from tests.support.waiting import wait_for
from vllm_autotuner.core.autoscaling import HANDOFF_MANAGER
from vllm_localcluster.autoscaler import ScheduledScaler

AUTOSCALER = "test-autoscaler"
SELECTOR = "vllm.autotuner.io/deployment=llama"


def scale(apiserver: ApiServer, path: str, replicas: int) -> None:
    """What the HPA controller does, through the one-machine cluster's autoscaler writer: read
    /scale, write it back with the new count (a 409 is read again and retried)."""
    writer = ScheduledScaler(
        apiserver.url,
        apiserver.token,
        str(apiserver.ca_file),
        f"{path}/scale",
        [replicas],
        1.0,
        field_manager=AUTOSCALER,
    )
    writer.scale_to(replicas)


def replicas_owners(obj: dict[str, Any]) -> set[str]:
    return {
        str(entry["manager"])
        for entry in obj["metadata"].get("managedFields") or []
        if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {})
    }


def sets_replicas(record: RequestRecord) -> bool:
    body = record.body if isinstance(record.body, dict) else {}
    return "replicas" in (body.get("spec") or {})


def operator_replica_writes(apiserver: ApiServer) -> list[RequestRecord]:
    """Requests by the operator that set a Deployment's spec.replicas (or its /scale)."""
    return [
        r
        for r in apiserver.requests_by("vllm-autotuner")
        if r.resource == "deployments"
        and r.verb in ("create", "update", "patch")
        and (r.subresource == "scale" or sets_replicas(r))
    ]


def settled_replicas(api: Api, count: int, rounds: int = 3) -> None:
    """The Deployment asks for `count` pods over several reconciles (1 s apart)."""
    for _ in range(rounds):
        wait_for(
            lambda: (
                (api.get(f"{DEPLOYMENT_PATH}/llama") or {}).get("spec", {}).get("replicas") == count
            ),
            10,
            message=f"Deployment replicas {count}",
        )


def test_an_autoscaler_scales_the_vllmdeployment_through_its_scale_subresource(
    apiserver: ApiServer, api: Api
) -> None:
    api.create(POLICY_PATH, POLICY)
    api.create(CR_PATH, copy.deepcopy(CR))
    path = f"{CR_PATH}/llama"
    with running_operator(apiserver.operator_credentials(), interval_s=1.0):
        wait_for(
            lambda: ((api.get(path) or {}).get("status") or {}).get("selector"),
            20,
            message="status.selector",
        )
        current = api.get(f"{path}/scale")
        assert current is not None
        assert current["spec"]["replicas"] == 1
        assert current["status"]["selector"] == SELECTOR  # what an HPA averages pod metrics on
        scale(apiserver, path, 3)
        settled_replicas(api, 3)
        cr = api.get(path)
        assert cr is not None and cr["spec"]["replicas"] == 3
        assert AUTOSCALER in replicas_owners(cr)
    # The operator wrote the VLLMDeployment's status only; the Deployment's count is its own
    # (it renders it from spec.replicas), so writing it there is no fight.
    writes = [
        r
        for r in apiserver.requests_by("vllm-autotuner")
        if r.resource == "vllmdeployments" and r.verb in ("update", "patch", "create")
    ]
    assert writes and all(r.subresource == "status" for r in writes)


def test_an_autoscaler_on_the_deployment_owns_its_replicas(apiserver: ApiServer, api: Api) -> None:
    """autoscaling.target Deployment: the Deployment starts at spec.replicas (set once by the
    handoff manager), then the autoscaler's count stands through the operator's applies."""
    api.create(POLICY_PATH, POLICY)
    cr = copy.deepcopy(CR)
    cr["spec"].update(replicas=2, autoscaling={"target": "Deployment"})
    api.create(CR_PATH, cr)
    path = f"{DEPLOYMENT_PATH}/llama"
    with running_operator(apiserver.operator_credentials(), interval_s=1.0):
        created = wait_for(lambda: api.get(path), 20, message="Deployment")
        settled_replicas(api, 2)
        assert replicas_owners(api.get(path) or created) == {HANDOFF_MANAGER}
        apiserver.mark()
        scale(apiserver, path, 4)
        # A template change makes the operator apply the Deployment again.
        api.merge(f"{CR_PATH}/llama", {"spec": {"pod": {"labels": {"team": "b"}}}})
        wait_for(
            lambda: (
                (api.get(path) or {})
                .get("spec", {})
                .get("template", {})
                .get("metadata", {})
                .get("labels", {})
                .get("team")
                == "b"
            ),
            20,
            message="the operator's apply of the new template",
        )
        settled_replicas(api, 4)
        live = api.get(path)
        assert live is not None and replicas_owners(live) == {AUTOSCALER}
        status = wait_for(
            lambda: ((api.get(f"{CR_PATH}/llama") or {}).get("status") or {}).get("scaling"),
            10,
            message="status.scaling",
        )
        assert status["owner"] == "Deployment"
    assert operator_replica_writes(apiserver) == []
    applies = [
        r
        for r in apiserver.requests_by("vllm-autotuner")
        if r.resource == "deployments" and r.verb == "patch" and r.name == "llama"
    ]
    assert applies, "the operator applied the Deployment after the autoscaler's write"


def test_switching_to_an_autoscaler_on_the_deployment_keeps_the_count(
    apiserver: ApiServer, api: Api
) -> None:
    """The operator owned spec.replicas (3); after the switch its applies leave the field out,
    which would reset the count to 1 had it not handed the field over first. The operator runs
    with exactly the chart's RBAC rules."""
    api.create(POLICY_PATH, POLICY)
    cr = copy.deepcopy(CR)
    cr["spec"]["replicas"] = 3
    api.create(CR_PATH, cr)
    path = f"{DEPLOYMENT_PATH}/llama"
    grant_chart_rules(api, chart_rbac_rules())
    apiserver.control_plane.bind_operator(ROLE)
    try:
        switch_and_scale(apiserver, api, path)
    finally:
        apiserver.control_plane.bind_operator("cluster-admin")
    refused = [r for r in apiserver.requests_by("vllm-autotuner") if r.status_code == 403]
    assert refused == []
    assert operator_replica_writes(apiserver) == []


def switch_and_scale(apiserver: ApiServer, api: Api, path: str) -> None:
    with running_operator(apiserver.operator_credentials(), interval_s=1.0):
        wait_for(lambda: api.get(path), 20, message="Deployment")
        settled_replicas(api, 3)
        assert "vllm-autotuner" in replicas_owners(api.get(path) or {})
        api.merge(
            f"{CR_PATH}/llama",
            {"spec": {"autoscaling": {"target": "Deployment"}, "pod": {"labels": {"t": "x"}}}},
        )
        wait_for(
            lambda: (
                (api.get(path) or {})
                .get("spec", {})
                .get("template", {})
                .get("metadata", {})
                .get("labels", {})
                .get("t")
                == "x"
            ),
            20,
            message="the operator's apply after the switch",
        )
        settled_replicas(api, 3)
        assert replicas_owners(api.get(path) or {}) == {HANDOFF_MANAGER}
        apiserver.mark()
        scale(apiserver, path, 5)
        settled_replicas(api, 5)
        assert replicas_owners(api.get(path) or {}) == {AUTOSCALER}
