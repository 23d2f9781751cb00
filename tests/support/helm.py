"""Render the operator's Helm chart with the real Helm engine, and the RBAC it must grant.

The expected RBAC lives here as data, written from what the operator does (not read from the
templates), so that a chart change that widens or loses a permission fails a test, and so that
integration tests can compare it with the requests the operator really makes against the API
emulator (`chart_rbac_rules` vs the emulator's request log).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import yaml
from helm_python import _native

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "vllm-autotuner"
CI_VALUES_DIR = CHART_DIR / "ci"
RELEASE = "vllm-autotuner"
NAMESPACE = "vllm-system"
MONITORING_API = "monitoring.coreos.com/v1"

# (apiGroup, resource, verb); "" is the core group.
Rule = tuple[str, str, str]


def _rules(group: str, resource: str, verbs: str) -> frozenset[Rule]:
    return frozenset((group, resource, verb) for verb in verbs.split(","))


GROUP = "vllm.autotuner.io"

# Cluster-scoped objects, read in every mode: policies, CRD scanning by kopf, namespaces for
# policy namespaceSelectors.
CLUSTER_RULES: frozenset[Rule] = (
    _rules(GROUP, "vllmtuningpolicies", "list,watch")
    | _rules(GROUP, "vllmtuningpolicies/status", "patch")
    | _rules("apiextensions.k8s.io", "customresourcedefinitions", "list,watch")
    | _rules("", "namespaces", "list,watch")
)

# Events: kopf posts the operator's Events as core/v1 Events.
EVENT_RULES: frozenset[Rule] = _rules("", "events", "create")

# Namespaced objects: granted cluster-wide or per watched namespace.
NAMESPACED_RULES: frozenset[Rule] = (
    _rules(GROUP, "vllmdeployments", "get,list,watch,patch")
    | _rules(GROUP, "vllmdeployments/status", "patch")
    | _rules(GROUP, "vllmdeployments/finalizers", "update")
    | _rules("apps", "deployments", "get,list,watch,create,patch")
    | _rules("", "services", "get,list,watch,create,patch")
    | _rules("", "pods", "list,watch")
    | _rules("apps", "replicasets", "list,watch")
    | EVENT_RULES
)

CLUSTER_PEERING_RULES: frozenset[Rule] = _rules(
    "kopf.dev", "clusterkopfpeerings", "get,list,watch,patch"
)
NAMESPACED_PEERING_RULES: frozenset[Rule] = _rules(
    "kopf.dev", "kopfpeerings", "get,list,watch,patch"
)


def bundled_versions(floor: tuple[int, int] = (1, 29)) -> list[str]:
    """Kubernetes versions whose strict schemas kubernetes-validate ships, from the floor up.

    Versions below 1.25 crash kubernetes-validate (IndexError), and the chart needs 1.29+.
    """
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    found = set()
    for entry in root.iterdir():
        match = re.fullmatch(r"v(\d+)\.(\d+)\.\d+-local-strict", entry.name)
        if match:
            found.add((int(match[1]), int(match[2])))
    return [f"{major}.{minor}" for major, minor in sorted(found) if (major, minor) >= floor]


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Merge values the way Helm layers `-f` files: maps recursively, everything else replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def ci_values() -> dict[str, dict[str, Any]]:
    """The realistic values sets in charts/vllm-autotuner/ci/ (what `ct lint` also renders)."""
    sets: dict[str, dict[str, Any]] = {}
    for path in sorted(CI_VALUES_DIR.glob("*-values.yaml")):
        loaded = yaml.safe_load(path.read_text()) or {}
        sets[path.name.removesuffix("-values.yaml")] = loaded
    return sets


def render(
    values: Mapping[str, Any] | None = None,
    *,
    api_versions: Sequence[str] = (),
    kube_version: str | None = None,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
) -> dict[str, str]:
    """Render like `helm template --api-versions ... --kube-version ...`.

    helm-python-sdk 0.2.2 exposes capabilities only through the native call's options (the
    `Chart.render` wrapper drops them), so that call is used when they matter.
    """
    with helm_python.Chart.load(CHART_DIR) as chart:
        if not api_versions and kube_version is None:
            return chart.render(dict(values or {}), name=name, namespace=namespace, is_install=True)
        opts: dict[str, Any] = {"name": name, "namespace": namespace, "is_install": True}
        if api_versions:
            opts["api_versions"] = list(api_versions)
        if kube_version is not None:
            opts["kube_version"] = kube_version
        payload = _native.call_string(
            "helm_render", chart._raw(), json.dumps(dict(values or {})), json.dumps(opts)
        )
        manifests: dict[str, str] = json.loads(payload)
        return manifests


def parse_manifests(manifests: Mapping[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render, in a stable order (NOTES.txt is not an object)."""
    objects: list[dict[str, Any]] = []
    for path in sorted(manifests):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(manifests[path]):
            if doc:
                objects.append(doc)
    return objects


def render_objects(values: Mapping[str, Any] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    return parse_manifests(render(values, **kwargs))


def find(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj.get("kind") == kind]


def rules_of(role: Mapping[str, Any]) -> set[Rule]:
    """Flatten a (Cluster)Role into (group, resource, verb) triples."""
    flat: set[Rule] = set()
    for rule in role.get("rules") or []:
        for group in rule.get("apiGroups") or []:
            for resource in rule.get("resources") or []:
                for verb in rule.get("verbs") or []:
                    flat.add((group, resource, verb))
    return flat


def rbac_by_scope(objects: Iterable[dict[str, Any]]) -> dict[str, set[Rule]]:
    """Rules per scope: "cluster" for ClusterRoles, the namespace for Roles."""
    scopes: dict[str, set[Rule]] = {}
    for obj in objects:
        if obj.get("kind") == "ClusterRole":
            scopes.setdefault("cluster", set()).update(rules_of(obj))
        elif obj.get("kind") == "Role":
            scopes.setdefault(obj["metadata"]["namespace"], set()).update(rules_of(obj))
    return scopes


def expected_rbac_by_scope(
    values: Mapping[str, Any] | None = None, *, release_namespace: str = NAMESPACE
) -> dict[str, frozenset[Rule]]:
    """The least-privilege permissions the operator needs with these values, per scope."""
    values = values or {}
    peering = bool(values.get("peering", {}).get("enabled", False))
    namespaces: list[str] = list(values.get("watchNamespaces") or [])
    if not namespaces:
        cluster = CLUSTER_RULES | NAMESPACED_RULES
        if peering:
            cluster |= CLUSTER_PEERING_RULES
        return {"cluster": cluster}
    scopes: dict[str, frozenset[Rule]] = {"cluster": CLUSTER_RULES}
    for ns in namespaces:
        scopes[ns] = NAMESPACED_RULES | (NAMESPACED_PEERING_RULES if peering else frozenset())
    if release_namespace not in namespaces:
        # Events about cluster-scoped policies go to the operator's own namespace.
        scopes[release_namespace] = EVENT_RULES
    return scopes


def expected_rbac_rules(values: Mapping[str, Any] | None = None) -> frozenset[Rule]:
    """All permissions the operator needs with these values, whatever the scope."""
    return frozenset().union(*expected_rbac_by_scope(values).values())


def chart_rbac_rules(values: Mapping[str, Any] | None = None) -> set[Rule]:
    """All permissions the rendered chart grants with these values, whatever the scope."""
    return set().union(*rbac_by_scope(render_objects(values)).values())
