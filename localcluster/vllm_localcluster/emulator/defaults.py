"""Defaults kube-apiserver fills into built-in objects on every write.

A controller that renders a Deployment and compares it with the live one sees these fields on
a real cluster (and loops forever if it treats them as drift), so the emulator adds the common
ones. Values from k8s.io/kubernetes pkg/apis/core/v1/defaults.go and pkg/apis/apps/v1/
defaults.go (SetDefaults_Deployment, SetDefaults_PodSpec, SetDefaults_Container, probes,
Service); admission-plugin fields (serviceAccountName, tolerations, priority) are not added.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import Any

_ip_counter = itertools.count()  # next() on a C iterator is atomic across threads


def _next_cluster_ip() -> str:
    i = next(_ip_counter)
    return f"10.43.{i // 250 % 250}.{i % 250 + 2}"


def _setdefault(obj: dict[str, Any], key: str, value: Any) -> None:
    if obj.get(key) is None:
        obj[key] = value


def _probe(probe: Any) -> None:
    if not isinstance(probe, dict):
        return
    for key, value in (
        ("timeoutSeconds", 1),
        ("periodSeconds", 10),
        ("successThreshold", 1),
        ("failureThreshold", 3),
    ):
        _setdefault(probe, key, value)
    if isinstance(probe.get("httpGet"), dict):
        _setdefault(probe["httpGet"], "scheme", "HTTP")


def _container(container: Any) -> None:
    if not isinstance(container, dict):
        return
    image = str(container.get("image") or "")
    last = image.rsplit("/", 1)[-1]
    untagged = ":" not in last and "@" not in last
    pull = "Always" if untagged or last.endswith(":latest") else "IfNotPresent"
    _setdefault(container, "imagePullPolicy", pull)
    _setdefault(container, "terminationMessagePath", "/dev/termination-log")
    _setdefault(container, "terminationMessagePolicy", "File")
    _setdefault(container, "resources", {})
    for port in container.get("ports") or []:
        if isinstance(port, dict):
            _setdefault(port, "protocol", "TCP")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        _probe(container.get(probe))


def _pod_spec(spec: Any) -> None:
    if not isinstance(spec, dict):
        return
    _setdefault(spec, "restartPolicy", "Always")
    _setdefault(spec, "terminationGracePeriodSeconds", 30)
    _setdefault(spec, "dnsPolicy", "ClusterFirst")
    _setdefault(spec, "securityContext", {})
    _setdefault(spec, "schedulerName", "default-scheduler")
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            _container(container)
    for volume in spec.get("volumes") or []:
        if isinstance(volume, dict):
            for source in ("configMap", "secret"):
                if isinstance(volume.get(source), dict):
                    _setdefault(volume[source], "defaultMode", 420)


def _workload(obj: dict[str, Any], deployment: bool) -> None:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    _setdefault(spec, "replicas", 1)
    if deployment:
        _setdefault(spec, "revisionHistoryLimit", 10)
        _setdefault(spec, "progressDeadlineSeconds", 600)
        strategy = spec.setdefault("strategy", {})
        if isinstance(strategy, dict):
            _setdefault(strategy, "type", "RollingUpdate")
            if strategy["type"] == "RollingUpdate":
                rolling = strategy.setdefault("rollingUpdate", {})
                _setdefault(rolling, "maxUnavailable", "25%")
                _setdefault(rolling, "maxSurge", "25%")
    template = spec.get("template")
    if isinstance(template, dict):
        _pod_spec(template.get("spec"))


def _service(obj: dict[str, Any], existing: Mapping[str, Any] | None) -> None:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    _setdefault(spec, "type", "ClusterIP")
    _setdefault(spec, "sessionAffinity", "None")
    _setdefault(spec, "internalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or []:
        if isinstance(port, dict):
            _setdefault(port, "protocol", "TCP")
            _setdefault(port, "targetPort", port.get("port"))
    if spec.get("clusterIP") != "None" and spec.get("type") != "ExternalName":
        old_spec = (existing or {}).get("spec") or {}
        # The cluster IP is allocated once and kept when an update leaves it out.
        ip = spec.get("clusterIP") or old_spec.get("clusterIP") or _next_cluster_ip()
        spec["clusterIP"] = ip
        spec["clusterIPs"] = spec.get("clusterIPs") or [ip]
        _setdefault(spec, "ipFamilies", ["IPv4"])
        _setdefault(spec, "ipFamilyPolicy", "SingleStack")
    obj.setdefault("status", {"loadBalancer": {}})


def apply_builtin_defaults(
    group_resource: tuple[str, str], obj: dict[str, Any], existing: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Return a defaulted copy of a built-in object (unknown resources are returned as is)."""
    if group_resource not in _DEFAULTED:
        return obj
    result = copy.deepcopy(obj)
    if group_resource == ("apps", "deployments"):
        _workload(result, deployment=True)
    elif group_resource in (("apps", "replicasets"), ("apps", "statefulsets")):
        _workload(result, deployment=False)
    elif group_resource == ("", "pods"):
        _pod_spec(result.get("spec"))
    elif group_resource == ("", "services"):
        _service(result, existing)
    return result


_DEFAULTED = frozenset(
    {
        ("apps", "deployments"),
        ("apps", "replicasets"),
        ("apps", "statefulsets"),
        ("", "pods"),
        ("", "services"),
    }
)
