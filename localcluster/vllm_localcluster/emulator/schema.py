"""Resource types: built-ins from kmock's bundled discovery data and CRDs read from manifests.

The API server serves a custom resource only once its CRD exists, and the CRD decides the
URL (group, plural), the scope, the `/status` subresource, and which fields survive a write
(structural pruning and schema defaults). Operators depend on all of these, so they are taken
from the CRD instead of being guessed.
"""

from __future__ import annotations

import copy
import gzip
import importlib.resources
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Verbs a CRD-backed resource serves (what kube-apiserver lists in discovery for CRs).
CR_VERBS = frozenset(
    {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
)


@dataclass
class ResourceType:
    """One served group/version/plural."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    list_kind: str = ""
    verbs: frozenset[str] = CR_VERBS
    shortnames: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: frozenset[str] = frozenset()
    custom: bool = False  # served from a CRD (merge patch only, returns objects on delete)
    schema: Mapping[str, Any] | None = None  # openAPIV3Schema of this version
    # The /scale subresource: (specReplicasPath, statusReplicasPath, labelSelectorPath).
    scale_paths: tuple[str, str, str] = (".spec.replicas", ".status.replicas", "")

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> tuple[str, str]:
        """Objects are stored per group and plural, whatever version they are read with."""
        return (self.group, self.plural)

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    def describe(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


@dataclass
class CRDVersions:
    """What one CRD registers."""

    name: str
    types: list[ResourceType] = field(default_factory=list)


def builtin_types() -> list[ResourceType]:
    """Built-in resources from the K3s discovery snapshot that kmock bundles."""
    data = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
    docs: list[dict[str, Any]] = json.loads(gzip.decompress(data))
    result: list[ResourceType] = []
    for doc in docs:
        group_version: str = doc["groupVersion"]
        group, _, version = group_version.rpartition("/")
        subresources: dict[str, set[str]] = {}
        for entry in doc.get("resources", []):
            name: str = entry.get("name", "")
            if "/" in name:
                parent, sub = name.split("/", 1)
                subresources.setdefault(parent, set()).add(sub)
        for entry in doc.get("resources", []):
            name = entry.get("name", "")
            if "/" in name:
                continue
            kind = entry.get("kind") or name.capitalize()
            result.append(
                ResourceType(
                    group=group,
                    version=version,
                    plural=name,
                    kind=kind,
                    namespaced=bool(entry.get("namespaced")),
                    singular=entry.get("singularName") or kind.lower(),
                    list_kind=f"{kind}List",
                    verbs=frozenset(entry.get("verbs", [])),
                    shortnames=tuple(entry.get("shortNames", [])),
                    categories=tuple(entry.get("categories", [])),
                    subresources=frozenset(subresources.get(name, set())),
                )
            )
    return result


def crd_types(crd: Mapping[str, Any]) -> CRDVersions:
    """Read an apiextensions.k8s.io/v1 CustomResourceDefinition into served resource types."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec.get("group")
    plural = names.get("plural")
    kind = names.get("kind")
    if not group or not plural or not kind:
        raise ValueError("a CRD needs spec.group, spec.names.plural and spec.names.kind")
    name = (crd.get("metadata") or {}).get("name") or f"{plural}.{group}"
    if name != f"{plural}.{group}":
        raise ValueError(f"a CRD must be named {plural}.{group}, not {name}")
    namespaced = spec.get("scope", "Namespaced") == "Namespaced"
    result = CRDVersions(name=name)
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        subresources = frozenset((version.get("subresources") or {}).keys())
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        scale = (version.get("subresources") or {}).get("scale") or {}
        scale_paths = (
            scale.get("specReplicasPath", ".spec.replicas"),
            scale.get("statusReplicasPath", ".status.replicas"),
            scale.get("labelSelectorPath", ""),
        )
        result.types.append(
            ResourceType(
                group=group,
                version=version["name"],
                plural=plural,
                kind=kind,
                namespaced=namespaced,
                singular=names.get("singular") or kind.lower(),
                list_kind=names.get("listKind") or f"{kind}List",
                shortnames=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                subresources=subresources,
                custom=True,
                schema=schema,
                scale_paths=scale_paths,
            )
        )
    if not result.types:
        raise ValueError(f"CRD {name} serves no version")
    return result


def prune_and_default(obj: dict[str, Any], schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """Drop fields the structural schema does not declare and fill in schema defaults.

    This is what kube-apiserver does to every custom-resource write; an operator that writes a
    status field missing from its CRD loses it silently on a real cluster, and here too.
    `apiVersion`, `kind` and `metadata` at the root are never pruned.
    """
    if not schema:
        return obj
    result = _walk(obj, schema, root=True)
    return result if isinstance(result, dict) else obj


def _walk(value: Any, schema: Mapping[str, Any], root: bool = False) -> Any:
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields") and not schema.get("properties"):
            return value
        properties: Mapping[str, Any] = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        result: dict[str, Any] = {}
        for key, item in value.items():
            if root and key in ("apiVersion", "kind", "metadata"):
                result[key] = item
            elif key in properties:
                result[key] = _walk(item, properties[key])
            elif isinstance(additional, Mapping):
                result[key] = _walk(item, additional)
            elif additional is True or preserve:
                result[key] = item
        for key, prop in properties.items():
            if key not in result and isinstance(prop, Mapping) and "default" in prop:
                result[key] = _walk(copy.deepcopy(prop["default"]), prop)
        return result
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            return [_walk(item, items) for item in value]
        return value
    return value
