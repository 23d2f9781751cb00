"""Class 10: least privilege, the rest of the way.

- The vLLM pods get no API token unless the spec asks (vLLM never calls the Kubernetes API).
- The chart offers a NetworkPolicy for the operator pods and a namespaced mode, together the
  documented setup for multi-tenant clusters (ci/multi-tenant-values.yaml, docs/security.md).
The image items of this class (no build tools, base pinned by digest) are tests/unit/ship's.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.support import helm as chart
from tests.unit.security.hostile_objects import deployment, reconcile

NO_TOKEN_UNLESS_ASKED = [
    ("default", {}),
    ("own-service-account", {"serviceAccountName": "vllm"}),
    ("explicitly-off", {"automountServiceAccountToken": False}),
    ("with-env-and-volumes", {"env": [{"name": "A", "value": "1"}], "shmSizeGi": 8}),
]


def _pod_spec(pod: dict[str, Any]) -> dict[str, Any]:
    kube, _ = reconcile(deployment(("spec.pod", pod)))
    manifest = next(m for m in kube.applied if m["kind"] == "Deployment")
    spec: dict[str, Any] = manifest["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize(
    "pod", [p for _, p in NO_TOKEN_UNLESS_ASKED], ids=[i for i, _ in NO_TOKEN_UNLESS_ASKED]
)
def test_vllm_pods_get_no_api_token_unless_asked(pod: dict[str, Any]) -> None:
    assert _pod_spec(pod)["automountServiceAccountToken"] is False


def test_a_spec_may_ask_for_the_token() -> None:
    spec = _pod_spec({"automountServiceAccountToken": True, "serviceAccountName": "reader"})
    assert spec["automountServiceAccountToken"] is True


MULTI_TENANT = chart.ci_values()["multi-tenant"]


def _network_policy(values: dict[str, Any]) -> dict[str, Any]:
    (policy,) = chart.find(chart.render_objects(values), "NetworkPolicy")
    return policy


def test_the_multi_tenant_setup_renders_a_valid_network_policy() -> None:
    policy = _network_policy(MULTI_TENANT)
    kubernetes_validate.validate(policy, str(kubernetes_validate.latest_version()), strict=True)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]


def test_the_operator_may_reach_only_the_api_server_prometheus_and_dns() -> None:
    egress = _network_policy(MULTI_TENANT)["spec"]["egress"]
    assert [[p["port"] for p in rule["ports"]] for rule in egress] == [[6443], [9090], [53, 53]]
    assert egress[0]["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    assert all(rule.get("to") for rule in egress), "an egress rule open to every destination"


def test_only_the_metrics_port_takes_connections() -> None:
    (ingress,) = _network_policy(MULTI_TENANT)["spec"]["ingress"]
    assert [p["port"] for p in ingress["ports"]] == [9090]
    assert ingress["from"]


def test_the_multi_tenant_setup_grants_nothing_cluster_wide_on_workloads() -> None:
    cluster = chart.rbac_by_scope(chart.render_objects(MULTI_TENANT))["cluster"]
    assert not [rule for rule in cluster if rule[1] in ("deployments", "services", "pods")]


def test_a_network_policy_without_the_api_servers_address_is_refused_clearly() -> None:
    with pytest.raises(Exception, match=r"networkPolicy\.apiServer\.cidrs is required"):
        chart.render_objects({"networkPolicy": {"enabled": True}})


def test_no_network_policy_unless_enabled() -> None:
    assert chart.find(chart.render_objects({}), "NetworkPolicy") == []
