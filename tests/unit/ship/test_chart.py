"""The Helm chart, rendered by the real Helm engine and checked against Kubernetes' schemas.

Every values set in charts/vllm-autotuner/ci/ is a realistic installation (namespaced, peering
HA, Prometheus Operator, authenticated Prometheus, a default policy). Each rendered object is
validated strictly (unknown fields rejected) against the OpenAPI schema of every Kubernetes
version from 1.29 (the chart's kubeVersion floor) to the newest one kubernetes-validate bundles.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support import helm as chart
from vllm_autotuner.api.policy import VLLMTuningPolicySpec

OWN_GROUPS = ("vllm.autotuner.io/", "kopf.dev/", "monitoring.coreos.com/")
HARD_UID = 65532
VALUES_SETS = chart.ci_values()


VERSIONS = chart.bundled_versions()


@cache
def rendered(set_name: str, with_monitoring: bool = True) -> tuple[dict[str, Any], ...]:
    api_versions = (chart.MONITORING_API,) if with_monitoring else ()
    return tuple(chart.render_objects(VALUES_SETS[set_name], api_versions=api_versions))


def by_kind(set_name: str, kind: str) -> list[dict[str, Any]]:
    return chart.find(rendered(set_name), kind)


def operator_deployment(set_name: str) -> dict[str, Any]:
    (deployment,) = by_kind(set_name, "Deployment")
    return deployment


def operator_container(set_name: str) -> dict[str, Any]:
    containers: list[dict[str, Any]] = operator_deployment(set_name)["spec"]["template"]["spec"][
        "containers"
    ]
    (container,) = containers
    return container


def test_values_sets_cover_the_realistic_installations() -> None:
    assert {
        "default",
        "namespaced",
        "peering",
        "monitoring",
        "secure-prometheus",
        "default-policy",
    } <= set(VALUES_SETS)
    assert VERSIONS[0] == "1.29" and len(VERSIONS) >= 5


@pytest.mark.parametrize("set_name", sorted(VALUES_SETS))
def test_lint_strict_is_clean(set_name: str) -> None:
    report = helm_python.lint(
        chart.CHART_DIR, VALUES_SETS[set_name], strict=True, kube_version="v1.29.0"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == []


@cache
def schema_error(obj_json: str, version: str) -> str | None:
    """Validation is slow (schemas are read per call); sets share many identical objects."""
    try:
        kubernetes_validate.validate(json.loads(obj_json), version, strict=True)
    except kubernetes_validate.ValidationError as error:
        return str(error).splitlines()[0]
    return None


@pytest.mark.parametrize("set_name", sorted(VALUES_SETS))
def test_every_builtin_object_validates_on_every_supported_kubernetes(set_name: str) -> None:
    objects = [o for o in rendered(set_name) if not o["apiVersion"].startswith(OWN_GROUPS)]
    assert objects
    for obj in objects:
        for version in VERSIONS:
            error = schema_error(json.dumps(obj, sort_keys=True), version)
            assert error is None, f"{obj['kind']} {obj['metadata']['name']} on {version}: {error}"


@pytest.mark.parametrize("set_name", sorted(VALUES_SETS))
def test_rendering_is_deterministic(set_name: str) -> None:
    """Argo CD re-renders on every refresh; random output would be permanently OutOfSync."""
    values = VALUES_SETS[set_name]
    first = chart.render(values, api_versions=[chart.MONITORING_API])
    second = chart.render(json.loads(json.dumps(values)), api_versions=[chart.MONITORING_API])
    assert first == second


@pytest.mark.parametrize("set_name", sorted(VALUES_SETS))
def test_rbac_is_exactly_the_least_privilege_set(set_name: str) -> None:
    values = VALUES_SETS[set_name]
    assert chart.rbac_by_scope(rendered(set_name)) == {
        scope: set(rules) for scope, rules in chart.expected_rbac_by_scope(values).items()
    }
    for role in by_kind(set_name, "ClusterRole") + by_kind(set_name, "Role"):
        flat = chart.rules_of(role)
        assert not any("*" in part for rule in flat for part in rule), role["metadata"]["name"]


@pytest.mark.parametrize("set_name", sorted(VALUES_SETS))
def test_every_binding_grants_its_role_to_the_operator_service_account(set_name: str) -> None:
    objects = rendered(set_name)
    (account,) = chart.find(objects, "ServiceAccount")
    bindings = chart.find(objects, "ClusterRoleBinding") + chart.find(objects, "RoleBinding")
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        for o in chart.find(objects, "ClusterRole") + chart.find(objects, "Role")
    }
    assert len(bindings) == len(roles)
    for binding in bindings:
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        assert (ref["kind"], namespace, ref["name"]) in roles
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": account["metadata"]["name"],
                "namespace": chart.NAMESPACE,
            }
        ]
    pod = operator_deployment(set_name)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_rbac_helpers_see_the_permissions_the_chart_grants() -> None:
    assert chart.chart_rbac_rules() == set(chart.expected_rbac_rules())
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in chart.chart_rbac_rules(
        VALUES_SETS["peering"]
    )
    assert ("kopf.dev", "clusterkopfpeerings", "patch") not in chart.chart_rbac_rules()


@pytest.mark.parametrize("set_name", sorted(VALUES_SETS))
def test_operator_pod_is_hardened(set_name: str) -> None:
    pod = operator_deployment(set_name)["spec"]["template"]["spec"]
    container = operator_container(set_name)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == HARD_UID
    assert pod["securityContext"]["runAsGroup"] == HARD_UID
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is True
    assert pod["terminationGracePeriodSeconds"] >= 10
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    # A read-only root needs a writable /tmp for Python's tempfile.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]


@pytest.mark.parametrize("set_name", sorted(VALUES_SETS))
def test_liveness_probe_hits_the_port_the_operator_serves_healthz_on(set_name: str) -> None:
    container = operator_container(set_name)
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--liveness-port={ports[probe['port']]}" in container["args"]
    assert f"--metrics-port={ports['metrics']}" in container["args"]
    assert "readinessProbe" not in container


def flag(container: dict[str, Any], name: str) -> list[str]:
    prefix = f"--{name}="
    return [a.removeprefix(prefix) for a in container["args"] if a.startswith(prefix)]


def test_default_install_watches_all_namespaces_standalone_with_recreate() -> None:
    container = operator_container("default")
    assert "--all-namespaces" in container["args"]
    assert flag(container, "namespace") == [] and flag(container, "peering") == []
    deployment = operator_deployment("default")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert by_kind("default", "PodDisruptionBudget") == []
    assert [o for o in rendered("default") if o["apiVersion"].startswith("kopf.dev/")] == []
    assert by_kind("default", "Role") == []


def test_namespaced_install_passes_one_flag_per_namespace() -> None:
    container = operator_container("namespaced")
    namespaces = VALUES_SETS["namespaced"]["watchNamespaces"]
    assert flag(container, "namespace") == namespaces
    assert "--all-namespaces" not in container["args"]
    role_namespaces = {r["metadata"]["namespace"] for r in by_kind("namespaced", "Role")}
    assert role_namespaces == {*namespaces, chart.NAMESPACE}


def kopf_crds(objects: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    crds = chart.find(objects, "CustomResourceDefinition")
    return [crd for crd in crds if crd["spec"]["group"] == "kopf.dev"]


def test_peering_runs_a_warm_standby() -> None:
    container = operator_container("peering")
    deployment = operator_deployment("peering")
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    (peering_name,) = flag(container, "peering")
    (peering,) = by_kind("peering", "ClusterKopfPeering")
    assert peering["metadata"]["name"] == peering_name
    (crd,) = kopf_crds(rendered("peering"))
    assert crd["spec"]["names"]["kind"] == "ClusterKopfPeering"
    assert crd["spec"]["scope"] == "Cluster"
    (pdb,) = by_kind("peering", "PodDisruptionBudget")
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    # Each replica needs a distinct identity for a distinct priority (equal ones freeze kopf).
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_peering_objects_match_their_crd_schema() -> None:
    objects = chart.render_objects({"peering": {"enabled": True}, "watchNamespaces": ["a", "b"]})
    (crd,) = kopf_crds(objects)
    assert crd["spec"]["names"]["kind"] == "KopfPeering"
    peerings = chart.find(objects, "KopfPeering")
    assert {p["metadata"]["namespace"] for p in peerings} == {"a", "b"}
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for peering in peerings:
        jsonschema.validate(peering, schema)


def test_more_than_one_replica_without_peering_is_refused() -> None:
    with pytest.raises(helm_python.HelmRenderError, match="peering"):
        chart.render({"replicaCount": 2})


@pytest.mark.parametrize(
    "values",
    [
        {"imagePullPolicy": "Always"},
        {"image": {"tag": "latest"}},
        {"prometheus": {"url": "prometheus:9090"}},
        {"operator": {"logFormat": "xml"}},
        {"metrics": {"serviceMonitor": {"enabeld": True}}},
        {"watchNamespaces": ["Team_A"]},
    ],
    ids=["unknown-top-level", "latest", "url-scheme", "log-format", "typo", "bad-namespace"],
)
def test_values_schema_rejects_mistakes(values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        chart.render(values)


def test_values_schema_describes_every_default_key() -> None:
    """With additionalProperties false, a default key missing from the schema breaks installs."""
    schema = json.loads((chart.CHART_DIR / "values.schema.json").read_text())
    defaults = yaml.safe_load((chart.CHART_DIR / "values.yaml").read_text())
    assert schema["additionalProperties"] is False
    jsonschema.validate(defaults, schema)

    def undocumented(node: dict[str, Any], values: dict[str, Any], path: str) -> list[str]:
        missing = []
        for key, value in values.items():
            sub = node.get("properties", {}).get(key)
            if sub is None:
                missing.append(path + key)
            elif isinstance(value, dict) and sub.get("properties"):
                missing += undocumented(sub, value, f"{path}{key}.")
        return missing

    assert undocumented(schema, defaults, "") == []


def test_monitoring_objects_need_the_prometheus_operator_api() -> None:
    without = rendered("monitoring", with_monitoring=False)
    assert chart.find(without, "ServiceMonitor") == chart.find(without, "PodMonitor") == []
    assert by_kind("default", "ServiceMonitor") == by_kind("default", "PodMonitor") == []


def test_service_monitor_scrapes_the_operator_metrics_service() -> None:
    (monitor,) = by_kind("monitoring", "ServiceMonitor")
    (service,) = by_kind("monitoring", "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # `namespace` is the VLLMDeployment's (autoscaling)
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [chart.NAMESPACE]}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The Service must reach the operator pods and their metrics port.
    pod_labels = operator_deployment("monitoring")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    target = service["spec"]["ports"][0]["targetPort"]
    assert target in {p["name"] for p in operator_container("monitoring")["ports"]}


def test_pod_monitor_selects_the_vllm_pods_the_operator_manages() -> None:
    (monitor,) = by_kind("monitoring", "PodMonitor")
    assert monitor["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/managed-by": "vllm-autotuner"}
    }
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    scoped = chart.render_objects(
        {"vllmPodMonitor": {"enabled": True}, "watchNamespaces": ["x"]},
        api_versions=[chart.MONITORING_API],
    )
    (monitor,) = chart.find(scoped, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["x"]}


def test_bearer_token_and_ca_are_mounted_where_the_flags_point() -> None:
    container = operator_container("secure-prometheus")
    pod = operator_deployment("secure-prometheus")["spec"]["template"]["spec"]
    values = VALUES_SETS["secure-prometheus"]["prometheus"]
    assert flag(container, "prometheus-url") == [values["url"]]
    assert flag(container, "prometheus-timeout") == [values["timeout"]]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for flag_name, source, name_key, ref_key, key in (
        ("prometheus-bearer-token-file", "secret", "secretName", "secretName", "secretKey"),
        ("prometheus-ca-file", "configMap", "configMapName", "name", "configMapKey"),
    ):
        (path,) = flag(container, flag_name)
        mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        assert mount["readOnly"] is True
        volume = volumes[mount["name"]][source]
        section = values["bearerToken"] if source == "secret" else values["ca"]
        assert volume[ref_key] == section[name_key]
        assert path == f"{mount['mountPath']}/{section[key]}"
        assert volume["items"] == [{"key": section[key], "path": section[key]}]
    digest = VALUES_SETS["secure-prometheus"]["image"]["digest"]
    assert container["image"].endswith("@" + digest)


def test_default_install_has_no_token_or_ca() -> None:
    container = operator_container("default")
    assert flag(container, "prometheus-bearer-token-file") == []
    assert flag(container, "prometheus-ca-file") == []
    assert container["image"].endswith(":" + chart_app_version())


def chart_app_version() -> str:
    metadata = yaml.safe_load((chart.CHART_DIR / "Chart.yaml").read_text())
    return str(metadata["appVersion"])


def test_default_policy_is_a_valid_policy_installed_after_its_crd() -> None:
    (policy,) = by_kind("default-policy", "VLLMTuningPolicy")
    assert policy["metadata"]["name"] == VALUES_SETS["default-policy"]["defaultPolicy"]["name"]
    assert "namespace" not in policy["metadata"]  # cluster-scoped
    hooks = policy["metadata"]["annotations"]["helm.sh/hook"].split(",")
    assert set(hooks) == {"post-install", "post-upgrade"}
    VLLMTuningPolicySpec.model_validate(policy["spec"])
    assert by_kind("default", "VLLMTuningPolicy") == []


@pytest.mark.parametrize("set_name", sorted(VALUES_SETS))
def test_every_object_carries_the_standard_labels(set_name: str) -> None:
    for obj in rendered(set_name):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "vllm-autotuner"
        assert labels["app.kubernetes.io/instance"] == chart.RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"].startswith("vllm-autotuner-")
        assert labels["app.kubernetes.io/version"] == chart_app_version()


def test_notes_tell_how_to_verify_the_installation() -> None:
    notes = chart.render()["vllm-autotuner/templates/NOTES.txt"]
    deployment = operator_deployment("default")["metadata"]["name"]
    for command in (
        "kubectl get crd vllmdeployments.vllm.autotuner.io",
        f"kubectl -n {chart.NAMESPACE} rollout status deploy/{deployment}",
        "kubectl get vllmd -A",
        "resource.customizations.health.vllm.autotuner.io_VLLMDeployment",
    ):
        assert command in notes


@pytest.mark.parametrize("set_name", sorted(VALUES_SETS))
def test_operator_cli_accepts_the_arguments_the_chart_passes(set_name: str) -> None:
    """The image's ENTRYPOINT is `vllm-autotuner run`; the chart's args follow it."""
    from vllm_autotuner.cli import build_parser

    container = operator_container(set_name)
    args = build_parser().parse_args(["run", *container["args"]])
    values = chart.deep_merge(
        yaml.safe_load((chart.CHART_DIR / "values.yaml").read_text()), VALUES_SETS[set_name]
    )
    assert args.namespace == list(values["watchNamespaces"])
    assert args.all_namespaces is (not values["watchNamespaces"])
    assert args.prometheus_url == values["prometheus"]["url"]
    assert args.log_format == values["operator"]["logFormat"]
    assert args.verbose is values["operator"]["verbose"]
    assert (args.peering is not None) is values["peering"]["enabled"]


def _duration_patterns() -> dict[str, str]:
    """Every duration the values schema checks with a pattern, by its path in the values."""
    schema = json.loads((chart.CHART_DIR / "values.schema.json").read_text())
    found: dict[str, str] = {}

    def walk(node: dict[str, Any], path: str) -> None:
        for key, sub in node.get("properties", {}).items():
            if "(ms|s|m|h)" in sub.get("pattern", ""):
                found[path + key] = sub["pattern"]
            walk(sub, f"{path}{key}.")

    walk(schema, "")
    return found


def test_the_flags_the_chart_passes_durations_to_are_checked_by_the_schema() -> None:
    patterns = _duration_patterns()
    assert {"prometheus.timeout", "operator.reconcileInterval"} <= patterns.keys()


@pytest.mark.parametrize("text", ["1m30s", "1h", "250ms", "2.5m", "0.5s"])
def test_a_duration_the_schema_accepts_reaches_the_operator(text: str) -> None:
    """`reconcileInterval: 1m30s` passes the schema and the CLI parses what the chart passes."""
    from vllm_autotuner.api.durations import duration_seconds
    from vllm_autotuner.cli import build_parser

    values = {"operator": {"reconcileInterval": text}, "prometheus": {"timeout": text}}
    objects = chart.render_objects(values)
    (container,) = chart.find(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(["run", *container["args"]])
    assert args.reconcile_interval == args.prometheus_timeout == duration_seconds(text) > 0


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_every_string_a_duration_pattern_accepts_the_cli_parses(data: st.DataObject) -> None:
    from vllm_autotuner.cli import parse_duration

    for pattern in sorted(set(_duration_patterns().values())):
        text = data.draw(st.from_regex(pattern, fullmatch=True))
        assert parse_duration(text) >= 0


@pytest.mark.parametrize("text", ["30", "1d", "1m 30s", "-5s"])
def test_the_schema_and_the_cli_refuse_the_same_strings(text: str) -> None:
    import argparse

    from vllm_autotuner.cli import parse_duration

    with pytest.raises(helm_python.HelmValuesError):
        chart.render({"operator": {"reconcileInterval": text}})
    with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
        parse_duration(text)
