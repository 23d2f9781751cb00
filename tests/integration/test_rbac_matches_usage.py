"""The chart's RBAC is exactly what the operator uses, enforced by the real API server.

The operator runs a full scenario (policy, deploy, tune two replicas through a canary that is
promoted (its Deployment deleted) and committed, a child deleted by hand, the CR deleted, and a
CR that still carries the finalizer an earlier version's kopf timers put on it, which kopf
releases with a patch) as a user bound to a
ClusterRole holding exactly the chart's rules, so kube-apiserver's RBAC refuses anything
else; every request it made is read back from the API server's audit log. A permission it
used that the chart lacks fails the test (a 403 in the log, or a scenario that cannot finish),
and so does one the chart grants that nothing used (except the few listed below, with the
reason).
"""

from __future__ import annotations

import copy

from tests.integration.test_operator_tuning import tuning
from tests.support.cluster_api import (
    CR,
    CR_PATH,
    DEPLOYMENT_PATH,
    NS,
    POLICY_PATH,
    Api,
    ApiServer,
    RequestRecord,
)
from tests.support.fake_fleet import FakeKubelet, SyntheticSnapshots
from tests.support.faults import fast_policy
from tests.support.helm import Rule, chart_rbac_rules
from tests.support.operator_runner import running_operator
from tests.support.waiting import wait_for
from vllm_autotuner import GROUP

ROLE = "vllm-autotuner-chart-rules"

# Granted but not exercised here, each for a reason this scenario cannot show.
NOT_EXERCISED: dict[Rule, str] = {
    ("vllm.autotuner.io", "vllmdeployments/finalizers", "update"): (
        "needed for blockOwnerDeletion only where OwnerReferencesPermissionEnforcement runs"
    ),
    ("apps", "deployments", "get"): (
        "reads managedFields when autoscaling.target becomes Deployment; "
        "tests/integration/test_autoscaling.py runs that switch under the chart's rules"
    ),
    ("vllm.autotuner.io", "vllmdeployments", "get"): (
        "a child's event reads its owner only with --peering; standalone, the handler hands "
        "the owner's key to the periodic loop, which reads it from kopf's index"
    ),
}


def used_rules(records: list[RequestRecord]) -> set[Rule]:
    used: set[Rule] = set()
    for r in records:
        if r.resource is None:
            continue
        resource = r.resource + (f"/{r.subresource}" if r.subresource else "")
        used.add((r.group or "", resource, r.verb))
        if r.verb == "patch" and r.status_code == 201:
            used.add((r.group or "", resource, "create"))  # an apply that creates needs create
    return used


def grant_chart_rules(api: Api, rules: set[Rule]) -> None:
    """A ClusterRole with exactly the chart's rules (one rule per permission)."""
    body = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": ROLE},
        "rules": [
            {"apiGroups": [group], "resources": [resource], "verbs": [verb]}
            for group, resource, verb in sorted(rules)
        ],
    }
    path = "/apis/rbac.authorization.k8s.io/v1/clusterroles"
    api.session.delete(f"{api.url}{path}/{ROLE}", timeout=10)
    api.create(path, body)


def test_chart_rbac_equals_what_the_operator_uses(apiserver: ApiServer, api: Api) -> None:
    granted = chart_rbac_rules()
    grant_chart_rules(api, granted)
    apiserver.control_plane.bind_operator(ROLE)
    try:
        scenario(apiserver, api)
    finally:
        apiserver.control_plane.bind_operator("cluster-admin")
    records = apiserver.requests_by("vllm-autotuner")
    assert records, "the audit log shows no request by the operator"
    refused = sorted({(r.verb, r.resource, r.subresource) for r in records if r.status_code == 403})
    assert not refused, f"RBAC refused the operator: {refused}"
    used = used_rules(records)
    missing = used - granted
    unused = granted - used - set(NOT_EXERCISED)
    assert not missing, f"the operator used permissions the chart does not grant: {sorted(missing)}"
    assert not unused, f"the chart grants permissions nothing used: {sorted(unused)}"


def scenario(apiserver: ApiServer, api: Api) -> None:
    api.create(POLICY_PATH, fast_policy())
    cr = copy.deepcopy(CR)
    cr["spec"]["tuning"] = {"mode": "Auto"}
    cr["spec"]["replicas"] = 2  # the candidate runs as a canary Deployment, deleted once judged
    api.create(CR_PATH, cr)
    upgraded = copy.deepcopy(CR)
    upgraded["metadata"] = {
        **upgraded["metadata"],
        "name": "upgraded",
        "finalizers": [f"{GROUP}/finalizer"],
    }
    api.create(CR_PATH, upgraded)
    with (
        FakeKubelet(apiserver, NS),
        running_operator(
            apiserver.operator_credentials(), interval_s=0.5, snapshot_source=SyntheticSnapshots()
        ),
    ):
        wait_for(
            lambda: [t for t in tuning(api).get("trials", []) if t["outcome"] == "Committed"],
            30,
            message="a committed trial",
        )
        api.delete(f"{DEPLOYMENT_PATH}/llama")
        wait_for(lambda: api.get(f"{DEPLOYMENT_PATH}/llama"), 20, message="child re-created")
        api.delete(f"{CR_PATH}/llama")
        wait_for(lambda: api.get(f"{CR_PATH}/llama") is None, 20, message="CR deleted")
        wait_for(
            lambda: not (api.get(f"{CR_PATH}/upgraded") or {})["metadata"].get("finalizers"),
            20,
            message="the earlier version's finalizer released",
        )
