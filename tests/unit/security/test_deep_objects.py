"""Class 1: one object must never stop the operator for every tenant.

Free-form fields (``placement.affinity``, tolerations, env, volumes, resources ...) used to take
any JSON. A value nested a few thousand levels deep was admitted and then broke the decoding of
kopf's watch stream, which stopped the operator for everyone. Each case puts a deep or oversized
value where a free-form field used to be; admission must refuse it (strict validation: the API
server would prune it, which leaves nothing deep), the operator's models must refuse it, and the
controller must render nothing for that object alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import ValidationError

from tests.support.crd_validation import crd_schema, iter_nodes, validate
from tests.unit.security.hostile_objects import conditions, deployment, reconcile
from vllm_autotuner.api import VLLMDeployment
from vllm_autotuner.api.crds import render_crds

CRD = render_crds()[0]
DEPTH = 600  # deep enough to break Python's default decoder limit in a real watch stack


def chain_map(depth: int) -> dict[str, Any]:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return dict(value)


def chain_list(depth: int) -> list[Any]:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return list(value)


def chain_mixed(depth: int) -> dict[str, Any]:
    value: Any = 1
    for i in range(depth):
        value = {"a": value} if i % 2 else [value]
    return {"a": value}


def wide(width: int) -> dict[str, Any]:
    return {f"k{i}": i for i in range(width)}


@dataclass(frozen=True)
class Deep:
    id: str
    path: str
    value: Callable[[], Any]


SHAPES: dict[str, Callable[[], Any]] = {
    "map": lambda: chain_map(DEPTH),
    "list": lambda: chain_list(DEPTH),
    "mixed": lambda: chain_mixed(DEPTH),
}
# Where the free-form values used to be, and one typed level below where relevant.
PLACES = {
    "affinity": ("spec.placement.affinity", lambda v: {"nodeAffinity": v}),
    "affinity-unknown": ("spec.placement.affinity", lambda v: {"x": v}),
    "affinity-term": (
        "spec.placement.affinity",
        lambda v: {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [v]}},
    ),
    "toleration": ("spec.placement.tolerations", lambda v: [{"key": "k", "x": v}]),
    "env": ("spec.pod.env", lambda v: [{"name": "A", "valueFrom": v}]),
    "env-from": ("spec.pod.envFrom", lambda v: [{"configMapRef": v}]),
    "volume": ("spec.pod.volumes", lambda v: [{"name": "w", "csi": v}]),
    "volume-mount": ("spec.pod.volumeMounts", lambda v: [{"name": "w", "mountPath": "/w", "x": v}]),
    "resources": ("spec.pod.resources", lambda v: {"requests": v}),
}
CASES = [
    Deep(f"{place}-{shape}", path, lambda wrap=wrap, make=make: wrap(make()))
    for place, (path, wrap) in PLACES.items()
    for shape, make in SHAPES.items()
] + [
    Deep("affinity-wide", "spec.placement.affinity", lambda: wide(20_000)),
    Deep("resources-wide", "spec.pod.resources", lambda: {"limits": wide(20_000)}),
    Deep("env-wide", "spec.pod.env", lambda: [{"name": "A", "value": "v", **wide(5_000)}]),
    Deep("volumes-wide", "spec.pod.volumes", lambda: [{"name": "w", **wide(5_000)}]),
    Deep("toleration-wide", "spec.placement.tolerations", lambda: [wide(5_000)]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_deep_or_huge_free_form_value_is_refused_everywhere(case: Deep) -> None:
    obj = deployment((case.path, case.value()))
    assert validate(CRD, obj), "admission accepted it"
    with pytest.raises(ValidationError):
        VLLMDeployment.model_validate(obj)
    kube, _ = reconcile(obj)
    assert kube.applied == []
    degraded = conditions(kube)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")


def _depth(schema: dict[str, Any]) -> int:
    children = [
        *schema.get("properties", {}).values(),
        *([schema["items"]] if isinstance(schema.get("items"), dict) else []),
        *(
            [schema["additionalProperties"]]
            if isinstance(schema.get("additionalProperties"), dict)
            else []
        ),
    ]
    return 1 + max((_depth(c) for c in children), default=0)


def test_no_spec_field_is_free_form() -> None:
    """Every node of the spec has a schema: nothing keeps unknown fields, so the API server
    prunes whatever a hostile object adds, however deep."""
    free = [
        path
        for path, node in iter_nodes(crd_schema(CRD)["properties"]["spec"])
        if node.get("x-kubernetes-preserve-unknown-fields")
    ]
    assert free == []


def test_the_deepest_admissible_spec_is_shallow() -> None:
    """The schema bounds the nesting of any admitted spec (affinity terms are the deepest)."""
    assert _depth(crd_schema(CRD)["properties"]["spec"]) <= 16


UNDECODABLE_LINES = {
    "cut-off": b'{"type":"MODIFIED","object":{"metadata":{"name":"x"',
    "not-json": b"<html>502 Bad Gateway</html>",
    "binary": b"\xff\xfe\x00\x01garbage",
    "empty": b"",
    "deeper-than-any-limit": b"[" * 200_000 + b"]" * 200_000,
}


@pytest.mark.parametrize("line", UNDECODABLE_LINES.values(), ids=list(UNDECODABLE_LINES))
def test_an_undecodable_watch_line_becomes_an_event_kopf_skips(line: bytes) -> None:
    from vllm_autotuner.operator import TolerantJSON, tolerate_undecodable_watch_events

    event = TolerantJSON.loads(line)
    assert event["type"] not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")
    assert event["object"] == {}
    assert TolerantJSON.loads(b'{"type":"ADDED","object":{"a":1}}')["object"] == {"a": 1}
    assert tolerate_undecodable_watch_events()  # kopf's stream decodes through it
