"""The Kubernetes API emulator behaves like kube-apiserver where kopf, kubectl, the kubernetes
client and the operator depend on it. Expected values come from the Kubernetes API
conventions, not from the emulator's code."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.connector
import kopf.testing
import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from tests.support.kube import KubeHandle, kube, kube_api, running_emulator  # noqa: F401
from tests.support.waiting import wait_for

GROUP, VERSION = "example.dev", "v1"
WIDGETS = f"/apis/{GROUP}/{VERSION}/namespaces/default/widgets"

WIDGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {
            "plural": "widgets",
            "singular": "widget",
            "kind": "Widget",
            "shortNames": ["wd"],
            "categories": ["examples"],
        },
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "image": {"type": "string"},
                                    "replicas": {"type": "integer", "default": 1},
                                },
                            },
                            "status": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            },
                        },
                    }
                },
            }
        ],
    },
}


def widget(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"image": "img:1", **spec},
    }


def deployment(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {"name": "vllm", "image": "vllm:1", "args": ["--a"]},
                        {"name": "sidecar", "image": "side:1"},
                    ]
                },
            },
        },
    }


@pytest.fixture
def widgets(kube: KubeHandle) -> KubeHandle:  # noqa: F811
    kube.emulator.register_crd(WIDGET_CRD)
    return kube


# ----------------------------------------------------------------------------- create/read


def test_create_returns_201_with_server_set_metadata(kube: KubeHandle) -> None:  # noqa: F811
    before = kube.emulator.store.resource_version
    status, obj = kube.http(
        "POST",
        "/api/v1/namespaces/default/configmaps",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"k": "v"}},
    )
    assert status == 201
    meta = obj["metadata"]
    assert meta["namespace"] == "default"
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert int(meta["resourceVersion"]) > before
    status, again = kube.http("GET", "/api/v1/namespaces/default/configmaps/cm")
    assert status == 200 and again["metadata"]["uid"] == meta["uid"]


def test_resource_versions_increase_across_resources(kube: KubeHandle) -> None:  # noqa: F811
    versions = []
    for i, path in enumerate(
        ["/api/v1/namespaces/default/configmaps", "/api/v1/namespaces/default/secrets"] * 2
    ):
        kind = "ConfigMap" if "configmaps" in path else "Secret"
        status, obj = kube.http("POST", path, {"kind": kind, "metadata": {"name": f"o{i}"}})
        assert status == 201
        versions.append(int(obj["metadata"]["resourceVersion"]))
    assert versions == sorted(versions) and len(set(versions)) == len(versions)


def test_conflicts_and_not_found_are_status_bodies(kube: KubeHandle) -> None:  # noqa: F811
    body = {"kind": "ConfigMap", "metadata": {"name": "dup"}}
    assert kube.http("POST", "/api/v1/namespaces/default/configmaps", body)[0] == 201
    status, error = kube.http("POST", "/api/v1/namespaces/default/configmaps", body)
    assert status == 409
    assert error["kind"] == "Status" and error["reason"] == "AlreadyExists"
    assert error["details"]["name"] == "dup"
    status, error = kube.http("GET", "/api/v1/namespaces/default/configmaps/missing")
    assert status == 404 and error["reason"] == "NotFound" and error["code"] == 404


def test_body_that_mismatches_the_url_is_rejected(kube: KubeHandle) -> None:  # noqa: F811
    path = "/api/v1/namespaces/default/configmaps"
    wrong_ns = {"kind": "ConfigMap", "metadata": {"name": "a", "namespace": "other"}}
    wrong_kind = {"kind": "Secret", "metadata": {"name": "b"}}
    wrong_version = {"apiVersion": "apps/v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
    for body in (wrong_ns, wrong_kind, wrong_version):
        status, error = kube.http("POST", path, body)
        assert status == 400, body  # kube-apiserver answers BadRequest for these
        assert error["kind"] == "Status"
    assert kube.http("POST", path, {"kind": "ConfigMap", "metadata": {}})[0] == 422


def test_generate_name_gets_a_random_suffix(kube: KubeHandle) -> None:  # noqa: F811
    names = set()
    for _ in range(3):
        status, obj = kube.http(
            "POST",
            "/api/v1/namespaces/default/events",
            {"kind": "Event", "metadata": {"generateName": "ev-"}, "involvedObject": {"name": "x"}},
        )
        assert status == 201
        names.add(obj["metadata"]["name"])
    assert len(names) == 3 and all(n.startswith("ev-") and len(n) == 8 for n in names)


def test_kubernetes_client_create_and_stale_update(kube_api: Any) -> None:  # noqa: F811
    core: Any = kubernetes.client.CoreV1Api(kube_api)
    created = core.create_namespaced_config_map(
        "default", {"metadata": {"name": "cm"}, "data": {"a": "1"}}
    )
    assert created.metadata.uid and created.metadata.resource_version
    stale = copy.deepcopy(created)
    created.data = {"a": "2"}
    updated = core.replace_namespaced_config_map("cm", "default", created)
    assert int(updated.metadata.resource_version) > int(stale.metadata.resource_version)
    stale.data = {"a": "3"}
    with pytest.raises(ApiException) as error:
        core.replace_namespaced_config_map("cm", "default", stale)
    assert error.value.status == 409
    assert json.loads(error.value.body or "{}")["reason"] == "Conflict"
    # A stale resourceVersion in a patch body is a precondition too.
    with pytest.raises(ApiException) as error:
        core.patch_namespaced_config_map(
            "cm", "default", {"metadata": {"resourceVersion": stale.metadata.resource_version}}
        )
    assert error.value.status == 409


def test_custom_objects_api_gets_201_and_a_body(widgets: KubeHandle) -> None:
    client = widgets.api_client()
    custom: Any = kubernetes.client.CustomObjectsApi(client)
    obj = custom.create_namespaced_custom_object(GROUP, VERSION, "default", "widgets", widget("w"))
    assert obj is not None and obj["metadata"]["generation"] == 1
    assert obj["spec"]["replicas"] == 1  # the CRD schema default


# ----------------------------------------------------------------------------- patching


def test_strategic_merge_patch_merges_containers_by_name(kube_api: Any) -> None:  # noqa: F811
    apps: Any = kubernetes.client.AppsV1Api(kube_api)
    apps.create_namespaced_deployment("default", deployment("llm"))
    patched = apps.patch_namespaced_deployment(
        "llm",
        "default",
        {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": ["--b"]}]}}}},
    )
    containers = {c.name: c for c in patched.spec.template.spec.containers}
    assert set(containers) == {"vllm", "sidecar"}
    assert containers["vllm"].image == "vllm:1" and containers["vllm"].args == ["--b"]
    assert patched.metadata.generation == 2


def test_strategic_merge_patch_directives(kube: KubeHandle) -> None:  # noqa: F811
    path = "/apis/apps/v1/namespaces/default/deployments"
    kube.http("POST", path, deployment("d"))
    status, obj = kube.http(
        "PATCH",
        f"{path}/d",
        {"spec": {"template": {"spec": {"containers": [{"name": "sidecar", "$patch": "delete"}]}}}},
        content_type="application/strategic-merge-patch+json",
    )
    assert status == 200
    assert [c["name"] for c in obj["spec"]["template"]["spec"]["containers"]] == ["vllm"]


def test_strategic_merge_patch_is_unsupported_for_custom_resources(
    widgets: KubeHandle,
) -> None:
    widgets.http("POST", WIDGETS, widget("w"))
    status, error = widgets.http(
        "PATCH",
        f"{WIDGETS}/w",
        {"spec": {"image": "x"}},
        content_type="application/strategic-merge-patch+json",
    )
    assert status == 415 and error["reason"] == "UnsupportedMediaType"


def test_json_patch_failed_test_is_422(kube: KubeHandle) -> None:  # noqa: F811
    path = "/api/v1/namespaces/default/configmaps"
    _, obj = kube.http("POST", path, {"kind": "ConfigMap", "metadata": {"name": "cm"}})
    ops: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "999999"},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x"]},
    ]
    status, error = kube.http(
        "PATCH", f"{path}/cm", ops, content_type="application/json-patch+json"
    )
    assert status == 422 and error["kind"] == "Status"
    ops[0]["value"] = obj["metadata"]["resourceVersion"]
    status, patched = kube.http(
        "PATCH", f"{path}/cm", ops, content_type="application/json-patch+json"
    )
    assert status == 200 and patched["metadata"]["finalizers"] == ["x"]


def test_merge_patch_null_deletes(kube: KubeHandle) -> None:  # noqa: F811
    path = "/api/v1/namespaces/default/configmaps"
    kube.http(
        "POST",
        path,
        {"kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"a": "1", "b": "2"}},
    )
    status, obj = kube.http(
        "PATCH", f"{path}/cm", {"data": {"a": None}}, content_type="application/merge-patch+json"
    )
    assert status == 200 and obj["data"] == {"b": "2"}


def test_server_side_apply_creates_then_merges_and_prunes(kube: KubeHandle) -> None:  # noqa: F811
    path = "/apis/apps/v1/namespaces/default/deployments/llm"
    applied = deployment("llm", tier="web")
    applied["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "2"},
    ]
    manifest = yaml.safe_dump(applied)
    status, error = kube.http("PATCH", path, manifest, content_type="application/apply-patch+yaml")
    assert status == 422 and "fieldManager" in error["message"]  # required for apply
    params = {"fieldManager": "vllm-autotuner"}
    status, created = kube.http(
        "PATCH", path, manifest, params=params, content_type="application/apply-patch+yaml"
    )
    assert status == 201
    assert created["metadata"]["managedFields"][0]["manager"] == "vllm-autotuner"
    assert created["metadata"]["managedFields"][0]["operation"] == "Apply"
    # Another writer scales it; the next apply must keep that and the unrelated container.
    kube.http(
        "PATCH",
        path,
        {"spec": {"replicas": 3}},
        content_type="application/merge-patch+json",
        params={"fieldManager": "hpa"},
    )
    second = copy.deepcopy(applied)
    del second["spec"]["replicas"]
    vllm = second["spec"]["template"]["spec"]["containers"][0]
    vllm["env"] = [{"name": "A", "value": "9"}]  # B dropped by the same manager
    second["spec"]["template"]["spec"]["containers"] = [vllm]
    status, obj = kube.http(
        "PATCH",
        path,
        yaml.safe_dump(second),
        params=params,
        content_type="application/apply-patch+yaml",
    )
    assert status == 200
    containers = {c["name"]: c for c in obj["spec"]["template"]["spec"]["containers"]}
    assert containers["vllm"]["env"] == [{"name": "A", "value": "9"}]
    assert obj["spec"]["replicas"] == 3
    managers = {(m["manager"], m["operation"]) for m in obj["metadata"]["managedFields"]}
    assert {("vllm-autotuner", "Apply"), ("hpa", "Update")} <= managers


def test_apply_with_json_body_from_the_client(widgets: KubeHandle) -> None:
    status, obj = widgets.http(
        "PATCH",
        f"{WIDGETS}/w",
        json.dumps(widget("w")),
        content_type="application/apply-patch+yaml",
        params={"fieldManager": "me"},
    )
    assert status == 201 and obj["spec"]["image"] == "img:1"


# ----------------------------------------------------------------------------- status, generation


def test_status_subresource_isolation_and_generation(widgets: KubeHandle) -> None:
    _, obj = widgets.http("POST", WIDGETS, {**widget("w"), "status": {"phase": "Fake"}})
    assert "status" not in obj  # status is ignored on create
    merge = "application/merge-patch+json"
    _, obj = widgets.http(
        "PATCH", f"{WIDGETS}/w", {"status": {"phase": "Nope"}}, content_type=merge
    )
    assert "status" not in obj and obj["metadata"]["generation"] == 1
    _, obj = widgets.http(
        "PATCH",
        f"{WIDGETS}/w/status",
        {"spec": {"image": "evil"}, "status": {"phase": "Ready"}},
        content_type=merge,
    )
    assert obj["status"] == {"phase": "Ready"} and obj["spec"]["image"] == "img:1"
    assert obj["metadata"]["generation"] == 1
    _, obj = widgets.http(
        "PATCH", f"{WIDGETS}/w", {"metadata": {"labels": {"a": "b"}}}, content_type=merge
    )
    assert obj["metadata"]["generation"] == 1
    _, obj = widgets.http("PATCH", f"{WIDGETS}/w", {"spec": {"image": "img:2"}}, content_type=merge)
    assert obj["metadata"]["generation"] == 2 and obj["status"] == {"phase": "Ready"}


def test_noop_write_keeps_the_resource_version(widgets: KubeHandle) -> None:
    _, obj = widgets.http("POST", WIDGETS, widget("w"))
    _, same = widgets.http(
        "PATCH",
        f"{WIDGETS}/w",
        {"spec": {"image": "img:1"}},
        content_type="application/merge-patch+json",
    )
    assert same["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_unknown_fields_are_pruned_for_custom_resources(widgets: KubeHandle) -> None:
    _, obj = widgets.http("POST", WIDGETS, widget("w", bogus=1))
    assert obj["spec"] == {"image": "img:1", "replicas": 1}


def test_put_on_a_custom_resource_requires_a_resource_version(widgets: KubeHandle) -> None:
    _, obj = widgets.http("POST", WIDGETS, widget("w"))
    body = {**obj, "metadata": {"name": "w"}}
    assert widgets.http("PUT", f"{WIDGETS}/w", body)[0] == 422
    body["metadata"]["resourceVersion"] = obj["metadata"]["resourceVersion"]
    body["spec"] = {"image": "img:3"}
    status, updated = widgets.http("PUT", f"{WIDGETS}/w", body)
    assert status == 200 and updated["metadata"]["generation"] == 2


# ----------------------------------------------------------------------------- selectors


def test_label_and_field_selectors(kube: KubeHandle) -> None:  # noqa: F811
    path = "/api/v1/namespaces/default/configmaps"
    labels = {
        "a": {"tier": "web", "env": "prod"},
        "b": {"tier": "db", "env": "prod"},
        "c": {"tier": "web"},
        "d": {},
    }
    for name, lab in labels.items():
        kube.http("POST", path, {"kind": "ConfigMap", "metadata": {"name": name, "labels": lab}})

    def names(selector: str, field: str = "") -> set[str]:
        params = {"labelSelector": selector} if selector else {}
        if field:
            params["fieldSelector"] = field
        status, result = kube.http("GET", path, params=params)
        assert status == 200, result
        return {item["metadata"]["name"] for item in result["items"]}

    assert names("tier=web") == {"a", "c"}
    assert names("tier==web,env=prod") == {"a"}
    assert names("tier!=web") == {"b", "d"}
    assert names("tier in (web,db),env") == {"a", "b"}
    assert names("tier notin (web)") == {"b", "d"}
    assert names("!env") == {"c", "d"}
    assert names("", "metadata.name=b") == {"b"}
    assert names("", "metadata.name!=b") == {"a", "c", "d"}
    assert names("", "metadata.namespace=other") == set()
    assert kube.http("GET", path, params={"labelSelector": "tier in (web"})[0] == 400


def test_list_kind_rv_and_cluster_wide_list(widgets: KubeHandle) -> None:
    for ns in ("default", "team"):
        widgets.http("POST", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/widgets", widget("w"))
    status, result = widgets.http("GET", f"/apis/{GROUP}/{VERSION}/widgets")
    assert status == 200 and result["kind"] == "WidgetList"
    assert int(result["metadata"]["resourceVersion"]) >= max(
        int(i["metadata"]["resourceVersion"]) for i in result["items"]
    )
    assert {i["metadata"]["namespace"] for i in result["items"]} == {"default", "team"}


def test_list_pagination(kube: KubeHandle) -> None:  # noqa: F811
    path = "/api/v1/namespaces/default/configmaps"
    for i in range(5):
        kube.http("POST", path, {"kind": "ConfigMap", "metadata": {"name": f"c{i}"}})
    seen: list[str] = []
    params = {"limit": "2"}
    while True:
        _, page = kube.http("GET", path, params=params)
        seen += [i["metadata"]["name"] for i in page["items"]]
        if not page["metadata"].get("continue"):
            break
        params = {"limit": "2", "continue": page["metadata"]["continue"]}
    assert sorted(seen) == [f"c{i}" for i in range(5)] and len(seen) == 5


def test_events_by_involved_object(kube: KubeHandle) -> None:  # noqa: F811
    path = "/api/v1/namespaces/default/events"
    for target in ("x", "y", "x"):
        kube.http(
            "POST",
            path,
            {
                "kind": "Event",
                "metadata": {"generateName": "e-"},
                "involvedObject": {"name": target, "uid": f"uid-{target}"},
            },
        )
    _, result = kube.http("GET", path, params={"fieldSelector": "involvedObject.name=x"})
    assert len(result["items"]) == 2
    _, result = kube.http("GET", path, params={"fieldSelector": "involvedObject.uid=uid-y"})
    assert len(result["items"]) == 1


# ----------------------------------------------------------------------------- watch


def test_watch_resumes_after_a_resource_version_without_replays(
    widgets: KubeHandle,
) -> None:
    widgets.http("POST", WIDGETS, widget("old"))
    _, listing = widgets.http("GET", WIDGETS)
    rv = listing["metadata"]["resourceVersion"]
    widgets.http("POST", WIDGETS, widget("new"))
    widgets.http(
        "PATCH",
        f"{WIDGETS}/old",
        {"spec": {"image": "img:2"}},
        content_type="application/merge-patch+json",
    )
    widgets.http("DELETE", f"{WIDGETS}/new")
    events = widgets.watch(WIDGETS, {"resourceVersion": rv, "timeoutSeconds": "0.3"})
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "new"),
        ("MODIFIED", "old"),
        ("DELETED", "new"),
    ]


def test_watch_without_resource_version_starts_with_current_state(
    widgets: KubeHandle,
) -> None:
    widgets.http("POST", WIDGETS, widget("a"))
    widgets.http("POST", WIDGETS, widget("b"))
    events = widgets.watch(WIDGETS, {"timeoutSeconds": "0.2"})
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "a"),
        ("ADDED", "b"),
    ]


def test_watch_with_an_expired_resource_version_gets_410(widgets: KubeHandle) -> None:
    _, obj = widgets.http("POST", WIDGETS, widget("a"))
    widgets.http("POST", WIDGETS, widget("b"))
    widgets.emulator.compact()
    events = widgets.watch(
        WIDGETS, {"resourceVersion": obj["metadata"]["resourceVersion"], "timeoutSeconds": "5"}
    )
    assert len(events) == 1 and events[0]["type"] == "ERROR"
    assert events[0]["object"]["code"] == 410


def test_watch_bookmarks_and_selector_transitions(tmp_path: Path) -> None:
    with running_emulator(tmp_path, bookmark_interval=0.05) as handle:
        path = "/api/v1/namespaces/default/configmaps"
        _, listing = handle.http("GET", path)
        handle.http(
            "POST", path, {"kind": "ConfigMap", "metadata": {"name": "x", "labels": {"on": "yes"}}}
        )
        handle.http(
            "PATCH",
            f"{path}/x",
            {"metadata": {"labels": {"on": "no"}}},
            content_type="application/merge-patch+json",
        )
        events = handle.watch(
            path,
            {
                "resourceVersion": listing["metadata"]["resourceVersion"],
                "labelSelector": "on=yes",
                "allowWatchBookmarks": "true",
                "timeoutSeconds": "0.4",
            },
        )
    types = [e["type"] for e in events]
    assert types[:2] == ["ADDED", "DELETED"]  # leaving the selector reads as a deletion
    assert "BOOKMARK" in types[2:]
    bookmark = next(e for e in events if e["type"] == "BOOKMARK")
    assert int(bookmark["object"]["metadata"]["resourceVersion"]) >= int(
        events[1]["object"]["metadata"]["resourceVersion"]
    )


def test_live_watch_receives_later_events(widgets: KubeHandle) -> None:
    _, listing = widgets.http("GET", WIDGETS)
    query = urllib.parse.urlencode(
        {"watch": "true", "resourceVersion": listing["metadata"]["resourceVersion"]}
    )
    # Headers arrive as soon as the watch is registered, so the create below is seen live.
    with urllib.request.urlopen(f"{widgets.url}{WIDGETS}?{query}", timeout=10) as stream:
        widgets.http("POST", WIDGETS, widget("live"))
        event = json.loads(stream.readline())
    assert event["type"] == "ADDED" and event["object"]["metadata"]["name"] == "live"


# ----------------------------------------------------------------------------- deletion


def test_finalizers_hold_deletion_until_removed(widgets: KubeHandle) -> None:
    body = widget("w")
    body["metadata"]["finalizers"] = ["example.dev/hold"]
    widgets.http("POST", WIDGETS, body)
    status, obj = widgets.http("DELETE", f"{WIDGETS}/w")
    assert status == 200 and obj["metadata"]["deletionTimestamp"]
    assert widgets.emulator.get_object("widgets.example.dev", "default", "w") is not None
    status, error = widgets.http(
        "PATCH",
        f"{WIDGETS}/w",
        {"metadata": {"finalizers": ["example.dev/hold", "new"]}},
        content_type="application/merge-patch+json",
    )
    assert status == 422 and "finalizers" in error["message"]  # none added while deleting
    status, _ = widgets.http(
        "PATCH",
        f"{WIDGETS}/w",
        {"metadata": {"finalizers": None}},
        content_type="application/merge-patch+json",
    )
    assert status == 200
    assert widgets.emulator.get_object("widgets.example.dev", "default", "w") is None


def _owned_deployment(handle: KubeHandle, owner: dict[str, Any], name: str) -> None:
    body = deployment(name)
    body["metadata"]["ownerReferences"] = [
        {
            "apiVersion": owner["apiVersion"],
            "kind": owner["kind"],
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    status, _ = handle.http("POST", "/apis/apps/v1/namespaces/default/deployments", body)
    assert status == 201


def test_garbage_collection_of_owned_children(widgets: KubeHandle) -> None:
    _, owner = widgets.http("POST", WIDGETS, widget("w"))
    _owned_deployment(widgets, owner, "child")
    _, other = widgets.http("POST", WIDGETS, widget("keep"))
    _owned_deployment(widgets, other, "kept-child")
    client = widgets.api_client()
    kubernetes.client.CustomObjectsApi(client).delete_namespaced_custom_object(
        GROUP, VERSION, "default", "widgets", "w"
    )
    assert widgets.emulator.get_object("apps/v1/deployments", "default", "child") is None
    assert widgets.emulator.get_object("apps/v1/deployments", "default", "kept-child")
    history = widgets.emulator.object_history("apps/v1/deployments", "default", "child")
    assert len(history) >= 1


def test_foreground_and_orphan_propagation(widgets: KubeHandle) -> None:
    _, owner = widgets.http("POST", WIDGETS, widget("fg"))
    _owned_deployment(widgets, owner, "fg-child")
    _, owner2 = widgets.http("POST", WIDGETS, widget("or"))
    _owned_deployment(widgets, owner2, "or-child")
    widgets.http("DELETE", f"{WIDGETS}/fg", {"propagationPolicy": "Foreground"})
    assert widgets.emulator.get_object("apps/v1/deployments", "default", "fg-child") is None
    assert widgets.emulator.get_object("widgets.example.dev", "default", "fg") is None
    widgets.http("DELETE", f"{WIDGETS}/or", params={"propagationPolicy": "Orphan"})
    orphan = widgets.emulator.get_object("apps/v1/deployments", "default", "or-child")
    assert orphan is not None and not orphan["metadata"].get("ownerReferences")


def test_delete_emits_deleted_events_for_dependents(widgets: KubeHandle) -> None:
    _, owner = widgets.http("POST", WIDGETS, widget("w"))
    _owned_deployment(widgets, owner, "child")
    _, listing = widgets.http("GET", "/apis/apps/v1/namespaces/default/deployments")
    widgets.http("DELETE", f"{WIDGETS}/w")
    events = widgets.watch(
        "/apis/apps/v1/namespaces/default/deployments",
        {"resourceVersion": listing["metadata"]["resourceVersion"], "timeoutSeconds": "0.2"},
    )
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("DELETED", "child")]


# ----------------------------------------------------------------------------- namespaces, CRDs


def test_namespaces_are_served_and_can_be_required(tmp_path: Path) -> None:
    with running_emulator(tmp_path, auto_create_namespaces=False) as handle:
        core: Any = kubernetes.client.CoreV1Api(handle.api_client())
        names = {ns.metadata.name for ns in core.list_namespace().items}
        assert {"default", "kube-system"} <= names
        with pytest.raises(ApiException) as error:
            core.create_namespaced_config_map("nowhere", {"metadata": {"name": "x"}})
        assert error.value.status == 404
        core.create_namespace({"metadata": {"name": "team"}})
        assert core.read_namespace("team").status.phase == "Active"
        core.create_namespaced_config_map("team", {"metadata": {"name": "x"}})
        core.delete_namespace("team")
        wait_for(
            lambda: handle.emulator.get_object("v1/namespaces", None, "team") is None,
            timeout=5,
            message="the namespace to go",
        )
        assert handle.emulator.get_object("v1/configmaps", "team", "x") is None


def test_crd_created_through_the_api_is_discoverable(kube: KubeHandle) -> None:  # noqa: F811
    status, crd = kube.http(
        "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", WIDGET_CRD
    )
    assert status == 201
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    status, group = kube.http("GET", f"/apis/{GROUP}")
    assert status == 200 and group["preferredVersion"]["version"] == VERSION
    _, resources = kube.http("GET", f"/apis/{GROUP}/{VERSION}")
    names = {r["name"] for r in resources["resources"]}
    assert names == {"widgets", "widgets/status"}
    assert kube.http("POST", WIDGETS, widget("w"))[0] == 201
    kube.http("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.{GROUP}")
    assert kube.http("GET", f"/apis/{GROUP}/{VERSION}")[0] == 404


def test_project_crds_register_when_present(kube: KubeHandle) -> None:  # noqa: F811
    from tests.support.kube import project_crds

    crds = project_crds()
    if crds is None:
        pytest.skip("crds/ is not generated yet")
    docs = [
        d
        for f in sorted(crds.glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if isinstance(d, dict) and d.get("kind") == "CustomResourceDefinition"
    ]
    for doc in docs:
        group = doc["spec"]["group"]
        for version in doc["spec"]["versions"]:
            _, listing = kube.http("GET", f"/apis/{group}/{version['name']}")
            assert doc["spec"]["names"]["plural"] in {r["name"] for r in listing["resources"]}


def test_discovery_lists_builtins(kube: KubeHandle) -> None:  # noqa: F811
    assert kube.http("GET", "/readyz") == (200, "ok")
    assert kube.http("GET", "/openapi/v2")[0] == 404  # kubectl needs --validate=false
    _, groups = kube.http("GET", "/apis")
    names = {g["name"] for g in groups["groups"]}
    assert {"apps", "apiextensions.k8s.io", "coordination.k8s.io"} <= names
    _, apps = kube.http("GET", "/apis/apps/v1")
    deployments = {r["name"]: r for r in apps["resources"]}
    assert deployments["deployments"]["kind"] == "Deployment"
    assert "deployments/status" in deployments


# ----------------------------------------------------------------------------- request log, faults


def test_request_log_records_verbs_and_managers(widgets: KubeHandle) -> None:
    widgets.emulator.clear_requests()
    widgets.http("POST", WIDGETS, widget("w"))
    widgets.http(
        "PATCH",
        f"{WIDGETS}/w/status",
        {"status": {"phase": "x"}},
        content_type="application/merge-patch+json",
        params={"fieldManager": "op"},
    )
    widgets.http("GET", WIDGETS)
    widgets.http("DELETE", WIDGETS)
    verbs = [(r.verb, r.resource, r.subresource, r.status_code) for r in widgets.emulator.requests]
    assert verbs == [
        ("create", "widgets", None, 201),
        ("patch", "widgets", "status", 200),
        ("list", "widgets", None, 200),
        ("deletecollection", "widgets", None, 200),
    ]
    patch = widgets.emulator.requests_matching(verb="patch")[0]
    assert patch.field_manager == "op" and patch.content_type == "application/merge-patch+json"
    assert ("patch", GROUP, "widgets/status") in widgets.emulator.verbs_used()


def test_fault_injection_fails_and_delays(kube: KubeHandle) -> None:  # noqa: F811
    path = "/api/v1/namespaces/default/configmaps"
    kube.emulator.inject({"verb": "create", "resource": "configmaps"}, status=503, times=1)
    status, error = kube.http("POST", path, {"kind": "ConfigMap", "metadata": {"name": "a"}})
    assert status == 503 and error["reason"] == "ServiceUnavailable"
    assert kube.http("POST", path, {"kind": "ConfigMap", "metadata": {"name": "a"}})[0] == 201
    kube.emulator.inject(lambda r: r.verb == "get", status=None, times=1, delay=0.3)
    started = time.monotonic()
    assert kube.http("GET", f"{path}/a")[0] == 200
    assert time.monotonic() - started >= 0.3


# ----------------------------------------------------------------------------- servers


async def test_async_context_manager_and_no_global_dns_patch() -> None:
    resolver = aiohttp.connector.TCPConnector._resolve_host
    async with EmulatorServer() as server:
        assert aiohttp.connector.TCPConnector._resolve_host is resolver
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{server.url}/api/v1/namespaces/default") as response,
        ):
            assert response.status == 200
            assert (await response.json())["kind"] == "Namespace"
    assert aiohttp.connector.TCPConnector._resolve_host is resolver


def test_standalone_server_writes_a_kubeconfig_and_stops_on_sigterm(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc.yaml"
    crds = tmp_path / "crds"
    crds.mkdir()
    (crds / "widgets.yaml").write_text(yaml.safe_dump(WIDGET_CRD))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_localcluster.emulator",
            "--port",
            "0",
            "--kubeconfig",
            str(kubeconfig),
            "--crds",
            str(crds),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        config = yaml.safe_load(kubeconfig.read_text())
        assert config["clusters"][0]["cluster"]["server"] == url
        client = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig)
        )
        core: Any = kubernetes.client.CoreV1Api(client)
        names = {n.metadata.name for n in core.list_namespace().items}
        assert "default" in names
        # The CRD given with --crds is served.
        custom: Any = kubernetes.client.CustomObjectsApi(client)
        assert (
            custom.list_namespaced_custom_object(GROUP, VERSION, "default", "widgets")["items"]
            == []
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# ----------------------------------------------------------------------------- real clients


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_get_apply_delete(kube: KubeHandle, tmp_path: Path) -> None:  # noqa: F811
    def kubectl(*args: str) -> str:
        result = subprocess.run(
            ["kubectl", "--kubeconfig", str(kube.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "KUBECACHEDIR": str(tmp_path / "cache"), "HOME": str(tmp_path)},
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "kube-system" in kubectl("get", "namespaces", "-o", "name")
    manifest = tmp_path / "d.yaml"
    manifest.write_text(yaml.safe_dump(deployment("web")))
    kubectl("apply", "--server-side", "--validate=false", "-f", str(manifest))
    obj = json.loads(kubectl("get", "deployment", "web", "-o", "json", "--show-managed-fields"))
    assert obj["spec"]["template"]["spec"]["containers"][0]["image"] == "vllm:1"
    assert any(m["manager"] == "kubectl" for m in obj["metadata"]["managedFields"])
    kubectl("scale", "deployment", "web", "--replicas=3")
    scaled = kube.emulator.get_object("apps/v1/deployments", "default", "web")
    assert scaled is not None and scaled["spec"]["replicas"] == 3
    assert scaled["metadata"]["generation"] == obj["metadata"]["generation"] + 1
    kubectl("delete", "deployment", "web")
    assert kube.emulator.get_object("apps/v1/deployments", "default", "web") is None


def test_kopf_operator_handles_create_status_and_finalizer(
    widgets: KubeHandle,
    tmp_path: Path,
) -> None:
    module = tmp_path / "widget_operator.py"
    module.write_text(
        textwrap.dedent(f"""
        import kopf

        @kopf.on.login()
        def login(**_):
            return kopf.ConnectionInfo(server={widgets.url!r}, insecure=True,
                                       default_namespace="default")

        @kopf.on.startup()
        def configure(settings, **_):
            settings.watching.server_timeout = 10

        @kopf.on.create("{GROUP}", "{VERSION}", "widgets")
        def created(body, patch, **_):
            patch.status["phase"] = "Created"
            kopf.info(body, reason="Created", message="widget handled")

        @kopf.on.delete("{GROUP}", "{VERSION}", "widgets")
        def deleted(**_):
            pass
    """)
    )
    lookup = widgets.emulator.get_object
    with kopf.testing.KopfRunner(
        ["run", "--standalone", "--namespace", "default", str(module)], timeout=30
    ) as runner:
        widgets.http("POST", WIDGETS, widget("w"))
        obj: Any = wait_for(
            lambda: (
                (o := lookup("widgets.example.dev", "default", "w"))
                and (o.get("status") or {}).get("phase") == "Created"
                and o
            ),
            timeout=15,
            message="kopf to set status.phase",
        )
        assert obj["metadata"].get("finalizers")
        wait_for(
            lambda: widgets.emulator.list_objects(
                "v1/events", "default", field_selector="involvedObject.name=w"
            ),
            timeout=15,
            message="kopf to post a core/v1 Event about the widget",
        )
        widgets.http("DELETE", f"{WIDGETS}/w")
        wait_for(
            lambda: lookup("widgets.example.dev", "default", "w") is None,
            timeout=15,
            message="kopf to release its finalizer",
        )
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None
    status_patches = widgets.emulator.requests_matching(
        verb="patch", resource="widgets", subresource="status"
    )
    assert status_patches and all(r.status_code == 200 for r in status_patches)


def test_kopf_relists_after_410_gone(widgets: KubeHandle, tmp_path: Path) -> None:
    module = tmp_path / "relist_operator.py"
    module.write_text(
        textwrap.dedent(f"""
        import kopf

        @kopf.on.login()
        def login(**_):
            return kopf.ConnectionInfo(server={widgets.url!r}, insecure=True,
                                       default_namespace="default")

        @kopf.on.startup()
        def configure(settings, **_):
            settings.watching.server_timeout = 0.3

        @kopf.on.create("{GROUP}", "{VERSION}", "widgets")
        def created(patch, **_):
            patch.status["phase"] = "Created"
    """)
    )
    emulator = widgets.emulator

    def phase(name: str) -> Any:
        obj = emulator.get_object("widgets.example.dev", "default", name)
        return obj and (obj.get("status") or {}).get("phase")

    with kopf.testing.KopfRunner(
        ["run", "--standalone", "--namespace", "default", str(module)], timeout=30
    ) as runner:
        widgets.http("POST", WIDGETS, widget("before"))
        wait_for(lambda: phase("before") == "Created", timeout=15, message="first handling")
        # Something else changes after kopf's last widget event, then history is compacted:
        # kopf's next watch resumes from a version older than the retained window.
        widgets.http("POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"name": "x"}})
        compacted_at = time.time()
        emulator.compact()
        wait_for(
            lambda: emulator.requests_matching(
                lambda r: r.time > compacted_at and r.verb == "list", resource="widgets"
            ),
            timeout=15,
            message="kopf to relist after its watch got 410 Gone",
        )
        widgets.http("POST", WIDGETS, widget("after"))
        wait_for(lambda: phase("after") == "Created", timeout=15, message="handling after relist")
    assert runner.exit_code == 0, runner.output
    handled = emulator.requests_matching(verb="patch", resource="widgets", subresource="status")
    assert {r.name for r in handled} == {"before", "after"}


async def test_kubernetes_aio_client_in_the_same_loop(tmp_path: Path) -> None:
    import kubernetes.aio

    async with EmulatorServer() as server:
        server.emulator.register_crd(WIDGET_CRD)
        config_file = server.write_kubeconfig(tmp_path / "kubeconfig")
        configuration = kubernetes.aio.client.Configuration()
        await kubernetes.aio.config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=str(config_file), client_configuration=configuration
        )
        async with kubernetes.aio.client.ApiClient(configuration) as api:
            custom: Any = kubernetes.aio.client.CustomObjectsApi(api)
            obj = await custom.create_namespaced_custom_object(
                GROUP, VERSION, "default", "widgets", widget("w")
            )
            assert obj["metadata"]["uid"]
            listed = await custom.list_namespaced_custom_object(
                GROUP, VERSION, "default", "widgets"
            )
            assert [i["metadata"]["name"] for i in listed["items"]] == ["w"]


def test_sync_client_watch_stream(kube_api: Any) -> None:  # noqa: F811
    core: Any = kubernetes.client.CoreV1Api(kube_api)
    core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
    listing = core.list_namespaced_config_map("default")
    core.create_namespaced_config_map("default", {"metadata": {"name": "b"}})
    core.delete_namespaced_config_map("a", "default")
    watch: Any = kubernetes.watch.Watch()  # type: ignore[no-untyped-call]
    events = [
        (e["type"], e["object"].metadata.name)
        for e in watch.stream(
            core.list_namespaced_config_map,
            "default",
            resource_version=listing.metadata.resource_version,
            timeout_seconds=1,
        )
    ]
    assert events == [("ADDED", "b"), ("DELETED", "a")]


def test_scale_subresource_through_the_client(kube_api: Any) -> None:  # noqa: F811
    apps: Any = kubernetes.client.AppsV1Api(kube_api)
    apps.create_namespaced_deployment("default", deployment("s"))
    scale = apps.read_namespaced_deployment_scale("s", "default")
    assert scale.spec.replicas == 1 and scale.status.selector == "app=s"
    apps.patch_namespaced_deployment_scale("s", "default", {"spec": {"replicas": 5}})
    assert apps.read_namespaced_deployment("s", "default").spec.replicas == 5


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("a=1", {"a": "1"}, True),
        ("a=1", {"a": "2"}, False),
        ("a!=1", {}, True),  # absent labels satisfy != and notin
        ("a notin (1,2)", {}, True),
        ("a in (1, 2)", {"a": "2"}, True),
        ("a in (1,2)", {}, False),
        ("a,!b", {"a": "x"}, True),
        ("a,!b", {"a": "x", "b": ""}, False),
        ("example.dev/tier=web", {"example.dev/tier": "web"}, True),
    ],
)
def test_label_selector_semantics(selector: str, labels: dict[str, str], expected: bool) -> None:
    from vllm_localcluster.emulator.selectors import Selector

    obj = {"metadata": {"labels": labels}}
    assert Selector.parse(selector, None).matches(obj) is expected


def test_strategic_merge_of_ports_env_and_finalizers() -> None:
    from vllm_localcluster.emulator.patching import strategic_merge_patch

    live: dict[str, Any] = {
        "metadata": {"finalizers": ["a"]},
        "spec": {
            "ports": [{"port": 80, "name": "http"}, {"port": 443, "name": "https"}],
            "env": [{"name": "X", "value": "1"}],
            "tolerations": [{"key": "gpu"}],
        },
    }
    patch = {
        "metadata": {"finalizers": ["b"]},
        "spec": {
            "ports": [{"port": 80, "targetPort": 8000}],
            "env": [{"name": "Y", "value": "2"}],
            "tolerations": [{"key": "other"}],
        },
    }
    merged = strategic_merge_patch(live, patch)
    assert merged["metadata"]["finalizers"] == ["a", "b"]
    assert merged["spec"]["ports"] == [
        {"port": 80, "name": "http", "targetPort": 8000},
        {"port": 443, "name": "https"},
    ]
    assert [e["name"] for e in merged["spec"]["env"]] == ["X", "Y"]
    assert merged["spec"]["tolerations"] == [{"key": "other"}]  # no merge key: replaced
    assert live["spec"]["env"] == [{"name": "X", "value": "1"}]  # the input is not mutated


def test_builtin_defaults_are_filled_in(kube: KubeHandle) -> None:  # noqa: F811
    _, dep = kube.http("POST", "/apis/apps/v1/namespaces/default/deployments", deployment("d"))
    spec = dep["spec"]
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"},
    }
    assert spec["revisionHistoryLimit"] == 10 and spec["progressDeadlineSeconds"] == 600
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Always" and pod["dnsPolicy"] == "ClusterFirst"
    assert pod["containers"][0]["imagePullPolicy"] == "IfNotPresent"  # tagged, not :latest
    assert pod["containers"][0]["terminationMessagePath"] == "/dev/termination-log"
    service = {
        "kind": "Service",
        "metadata": {"name": "s"},
        "spec": {"selector": {"app": "d"}, "ports": [{"port": 80}]},
    }
    _, svc = kube.http("POST", "/api/v1/namespaces/default/services", service)
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [{"port": 80, "protocol": "TCP", "targetPort": 80}]
    cluster_ip = svc["spec"]["clusterIP"]
    assert cluster_ip and svc["spec"]["clusterIPs"] == [cluster_ip]
    # An apply that leaves the allocated IP out keeps it.
    applied = {"apiVersion": "v1", **service}
    _, svc = kube.http(
        "PATCH",
        "/api/v1/namespaces/default/services/s",
        json.dumps(applied),
        content_type="application/apply-patch+yaml",
        params={"fieldManager": "me"},
    )
    assert svc["spec"]["clusterIP"] == cluster_ip


def test_child_of_a_missing_owner_is_garbage_collected(kube: KubeHandle) -> None:  # noqa: F811
    body = deployment("orphaned")
    body["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "ghost", "uid": "no-such-uid"}
    ]
    status, _ = kube.http("POST", "/apis/apps/v1/namespaces/default/deployments", body)
    assert status == 201
    assert kube.emulator.get_object("apps/v1/deployments", "default", "orphaned") is None


def test_garbage_collection_cascades_through_generations(widgets: KubeHandle) -> None:
    _, owner = widgets.http("POST", WIDGETS, widget("w"))
    parent = owner
    chain = [("apps/v1", "ReplicaSet", "replicasets"), ("v1", "Pod", "pods")]
    _owned_deployment(widgets, parent, "gen1")
    parent = widgets.emulator.get_object("apps/v1/deployments", "default", "gen1") or {}
    for api_version, kind, plural in chain:
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        ref = {
            "apiVersion": parent["apiVersion"],
            "kind": parent["kind"],
            "name": parent["metadata"]["name"],
            "uid": parent["metadata"]["uid"],
        }
        body = {"kind": kind, "metadata": {"name": f"{plural}-x", "ownerReferences": [ref]}}
        status, parent = widgets.http("POST", f"{prefix}/namespaces/default/{plural}", body)
        assert status == 201
    widgets.http("DELETE", f"{WIDGETS}/w")
    for resource, name in [
        ("apps/v1/deployments", "gen1"),
        ("apps/v1/replicasets", "replicasets-x"),
        ("v1/pods", "pods-x"),
    ]:
        assert widgets.emulator.get_object(resource, "default", name) is None, resource
