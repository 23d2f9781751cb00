"""The emulated cluster state: objects, resourceVersions, the watch-event log, garbage collection.

Everything the API server guarantees to controllers lives here, independent of HTTP: one
increasing resourceVersion for every change (optimistic concurrency and watch resumption both
rest on it), a bounded event window (older resumptions get 410 Gone, so relisting is exercised),
status-subresource isolation and `generation`, finalizers, and ownerReference garbage
collection (children of a deleted VLLMDeployment must disappear as on a real cluster).

All methods are synchronous and guarded by one re-entrant lock, so tests may read objects from
their own thread while the server's event loop serves requests. Stored dicts are never mutated
after they are stored; readers get deep copies.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import copy
import datetime
import json
import random
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_localcluster.emulator import errors, patching
from vllm_localcluster.emulator.defaults import apply_builtin_defaults
from vllm_localcluster.emulator.errors import ApiError
from vllm_localcluster.emulator.schema import (
    CRDVersions,
    ResourceType,
    builtin_types,
    crd_types,
    prune_and_default,
)
from vllm_localcluster.emulator.selectors import Selector

GroupResource = tuple[str, str]
ObjectKey = tuple[str, str]  # (namespace or "", name)

# Characters of generated name suffixes (k8s.io/apimachinery/pkg/util/rand: no vowels, no 0/1/3).
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
FOREGROUND = "foregroundDeletion"
ORPHAN = "orphan"
SEEDED_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


def now_rfc3339() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class StoredEvent:
    """One committed change; `old` is the state before it (None for creations)."""

    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    group_resource: GroupResource
    namespace: str
    name: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass(eq=False)
class Subscription:
    """A live watch: committed events are handed to its event loop in commit order."""

    group_resource: GroupResource
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StoredEvent | None] = field(default_factory=asyncio.Queue)


@dataclass(frozen=True)
class ListResult:
    items: list[dict[str, Any]]
    resource_version: str
    continue_token: str
    remaining: int | None


def _strip(obj: Mapping[str, Any], *, keep_status: bool) -> dict[str, Any]:
    """The part of an object whose change bumps metadata.generation."""
    skipped = {"metadata", "apiVersion", "kind"} | (set() if keep_status else {"status"})
    return {k: v for k, v in obj.items() if k not in skipped}


def _without_managed_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {**obj, "metadata": meta}


class ObjectStore:
    """In-memory objects of every served resource, with API-server semantics."""

    def __init__(
        self,
        *,
        auto_create_namespaces: bool = True,
        event_window: int = 10_000,
        history_limit: int = 50,
        prune_unknown_fields: bool = True,
        builtin_defaults: bool = True,
    ) -> None:
        self.builtin_defaults = builtin_defaults
        self.auto_create_namespaces = auto_create_namespaces
        self.event_window = event_window
        self.history_limit = history_limit
        self.prune_unknown_fields = prune_unknown_fields
        self._lock = threading.RLock()
        self._rv = 0
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._objects: dict[GroupResource, dict[ObjectKey, dict[str, Any]]] = (
            collections.defaultdict(dict)
        )
        self._uids: dict[str, tuple[GroupResource, ObjectKey]] = {}
        self._events: collections.deque[StoredEvent] = collections.deque()
        self._compacted_rv = 0
        self._subscriptions: list[Subscription] = []
        self._history: dict[tuple[GroupResource, str, str], list[dict[str, Any]]] = {}
        self._applied: dict[tuple[GroupResource, str, str, str, str], dict[str, Any]] = {}
        self._gc_needed = False
        self._collecting = False
        for rt in builtin_types():
            self._types[(rt.group, rt.version, rt.plural)] = rt
        namespaces = self.find_type("", "v1", "namespaces")
        for name in SEEDED_NAMESPACES:
            self.create(namespaces, None, {"metadata": {"name": name}})

    # ----------------------------------------------------------------- resource types

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    def types(self) -> list[ResourceType]:
        with self._lock:
            return list(self._types.values())

    def find_type(self, group: str, version: str, plural: str) -> ResourceType:
        with self._lock:
            rt = self._types.get((group, version, plural))
        if rt is None:
            gv = f"{group}/{version}" if group else version
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({gv} {plural})"
            )
        return rt

    def resolve(self, resource: str | ResourceType) -> ResourceType:
        """Find a type by "group/version/plural", "v1/pods", "plural.group" or a unique plural."""
        if isinstance(resource, ResourceType):
            return resource
        with self._lock:
            candidates = list(self._types.values())
        parts = resource.split("/")
        if len(parts) == 3:
            return self.find_type(*parts)
        if len(parts) == 2:
            return self.find_type("", parts[0], parts[1])
        plural, _, group = resource.partition(".")
        matches = [
            rt
            for rt in candidates
            if (rt.plural == plural or rt.kind == plural) and (not group or rt.group == group)
        ]
        if group == "" and any(rt.group == "" for rt in matches):
            matches = [rt for rt in matches if rt.group == ""]
        if not matches:
            raise KeyError(f"unknown resource {resource!r}")
        return matches[0]

    def register_type(self, rt: ResourceType) -> None:
        with self._lock:
            self._types[(rt.group, rt.version, rt.plural)] = rt

    def register_crd(self, crd: Mapping[str, Any]) -> CRDVersions:
        """Serve a CRD's resources and store the CRD object itself (as `kubectl apply` would)."""
        crds = self.find_type("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        parsed = crd_types(crd)
        with self._lock:
            body = copy.deepcopy(dict(crd))
            body.setdefault("apiVersion", crds.api_version)
            body.setdefault("kind", crds.kind)
            body.setdefault("metadata", {})["name"] = parsed.name
            existing = self._objects[crds.group_resource].get(("", parsed.name))
            if existing is None:
                self.create(crds, None, body)
            else:
                body["metadata"].pop("resourceVersion", None)
                self.update(crds, None, parsed.name, body)
        return parsed

    def _apply_crd(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Register the CRD's versions and report it Established, as the apiextensions server."""
        parsed = crd_types(obj)
        for rt in parsed.types:
            self.register_type(rt)
        names = (obj.get("spec") or {}).get("names") or {}
        now = now_rfc3339()
        status = {
            "acceptedNames": copy.deepcopy(names),
            "storedVersions": [v["name"] for v in obj["spec"]["versions"] if v.get("storage")],
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "reason": "NoConflicts",
                    "message": "no conflicts found",
                    "lastTransitionTime": now,
                },
                {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                    "lastTransitionTime": now,
                },
            ],
        }
        old_status = obj.get("status") or {}
        if _strip(old_status, keep_status=True) == _strip(status, keep_status=True):
            return dict(obj)
        if old_status.get("conditions"):
            status["conditions"] = old_status["conditions"]
        return {**obj, "status": status}

    def _drop_crd(self, obj: Mapping[str, Any]) -> None:
        try:
            parsed = crd_types(obj)
        except ValueError:
            return
        for rt in parsed.types:
            for key, item in list(self._objects[rt.group_resource].items()):
                self._remove(rt, key, item)
            self._types.pop((rt.group, rt.version, rt.plural), None)

    # ----------------------------------------------------------------- reading

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        with self._lock:
            obj = self._objects[rt.group_resource].get(self._key(rt, namespace, name))
            if obj is None:
                raise errors.not_found(rt, name)
            return self._present(rt, obj)

    def peek(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any] | None:
        with self._lock:
            obj = self._objects[rt.group_resource].get(self._key(rt, namespace, name))
            return None if obj is None else self._present(rt, obj)

    def list_objects(
        self,
        rt: ResourceType,
        namespace: str | None,
        selector: Selector | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> ListResult:
        selector = selector or Selector()
        with self._lock:
            start: tuple[str, str] | None = None
            list_rv = str(self._rv)
            if continue_token:
                try:
                    token = json.loads(base64.urlsafe_b64decode(continue_token.encode()))
                    start = (token["ns"], token["name"])
                    list_rv = token["rv"]
                except (ValueError, KeyError, TypeError, binascii.Error) as exc:
                    raise errors.bad_request(f"invalid continue token: {exc}") from exc
            items = [
                obj
                for key, obj in sorted(self._objects[rt.group_resource].items())
                if (namespace is None or key[0] == namespace)
                and (start is None or key > start)
                and selector.matches(obj)
            ]
            remaining: int | None = None
            token_out = ""
            if limit and len(items) > limit:
                last = items[limit - 1]["metadata"]
                remaining = len(items) - limit
                items = items[:limit]
                token_out = base64.urlsafe_b64encode(
                    json.dumps(
                        {"ns": last.get("namespace", ""), "name": last["name"], "rv": list_rv}
                    ).encode()
                ).decode()
            return ListResult(
                [self._present(rt, obj) for obj in items], list_rv, token_out, remaining
            )

    def history(self, rt: ResourceType, namespace: str | None, name: str) -> list[dict[str, Any]]:
        with self._lock:
            key = (rt.group_resource, (namespace or "") if rt.namespaced else "", name)
            return [self._present(rt, obj) for obj in self._history.get(key, [])]

    def _present(self, rt: ResourceType, obj: Mapping[str, Any]) -> dict[str, Any]:
        result = copy.deepcopy(dict(obj))
        result["apiVersion"] = rt.api_version
        return result

    def _key(self, rt: ResourceType, namespace: str | None, name: str) -> ObjectKey:
        return ((namespace or "") if rt.namespaced else "", name)

    # ----------------------------------------------------------------- committing

    def _commit(
        self,
        rt: ResourceType,
        type_: str,
        key: ObjectKey,
        obj: dict[str, Any],
        old: dict[str, Any] | None,
    ) -> dict[str, Any]:
        self._rv += 1
        meta = dict(obj.get("metadata") or {})
        meta["resourceVersion"] = str(self._rv)
        obj = {**obj, "metadata": meta}
        store = self._objects[rt.group_resource]
        if type_ == "DELETED":
            store.pop(key, None)
            self._uids.pop(meta.get("uid", ""), None)
            self._gc_needed = True
        else:
            store[key] = obj
            self._uids[meta["uid"]] = (rt.group_resource, key)
        event = StoredEvent(self._rv, type_, rt.group_resource, key[0], key[1], obj, old)
        self._events.append(event)
        while len(self._events) > self.event_window:
            self._compacted_rv = self._events.popleft().rv
        history = self._history.setdefault((rt.group_resource, key[0], key[1]), [])
        history.append(obj)
        del history[: -self.history_limit]
        for sub in self._subscriptions:
            if sub.group_resource == rt.group_resource and not sub.loop.is_closed():
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, event)
        return obj

    def _remove(self, rt: ResourceType, key: ObjectKey, obj: dict[str, Any]) -> dict[str, Any]:
        self._applied = {
            k: v for k, v in self._applied.items() if k[:3] != (rt.group_resource, *key)
        }
        if rt.group_resource == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._drop_crd(obj)
        return self._commit(rt, "DELETED", key, obj, obj)

    def compact(self) -> int:
        """Forget all retained events, so resuming any older watch gets 410 Gone."""
        with self._lock:
            self._events.clear()
            self._compacted_rv = self._rv
            return self._rv

    # ----------------------------------------------------------------- creating

    def create(
        self,
        rt: ResourceType,
        namespace: str | None,
        body: Any,
        *,
        field_manager: str | None = None,
        operation: str = "Update",
        dry_run: bool = False,
    ) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise errors.bad_request("the body of the request must be a JSON object")
        with self._lock:
            obj = copy.deepcopy(dict(body))
            meta: dict[str, Any] = dict(obj.get("metadata") or {})
            self._check_type_meta(rt, obj, meta.get("name", ""))
            namespace = self._check_namespace(rt, namespace, meta)
            name = meta.get("name") or ""
            store = self._objects[rt.group_resource]
            if not name:
                prefix = meta.get("generateName")
                if not prefix:
                    raise errors.invalid(
                        rt, "", "metadata.name: Required value: name or generateName is required"
                    )
                for _ in range(100):
                    name = prefix + "".join(random.choices(_SUFFIX_ALPHABET, k=5))
                    if self._key(rt, namespace, name) not in store:
                        break
            key = self._key(rt, namespace, name)
            if key in store:
                raise errors.already_exists(rt, name)
            meta["name"] = name
            if rt.namespaced:
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            for dropped in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(dropped, None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            manager = field_manager or "unknown"
            fields = (
                patching.fields_v1(_strip(obj, keep_status=True)) if operation == "Apply" else {}
            )
            meta["managedFields"] = [self._managed_entry(rt, manager, operation, fields, None)]
            obj["metadata"] = meta
            obj["apiVersion"] = rt.api_version
            obj["kind"] = rt.kind
            if rt.has_status:
                obj.pop("status", None)
            obj = self._admit(rt, obj)
            if dry_run:
                return self._present(rt, obj)
            stored = self._commit(rt, "ADDED", key, obj, None)
            if meta.get("ownerReferences"):
                self._gc_needed = True  # a child of an owner that does not exist is collected
            if rt.group_resource == ("apiextensions.k8s.io", "customresourcedefinitions"):
                stored = self._replace(rt, key, self._apply_crd(stored), stored)
            self._collect_garbage()
            return self._present(rt, stored)

    def _check_type_meta(self, rt: ResourceType, obj: Mapping[str, Any], name: str) -> None:
        api_version = obj.get("apiVersion")
        if api_version and api_version != rt.api_version:
            raise errors.bad_request(
                f"the API version in the data ({api_version}) does not match the expected "
                f"API version ({rt.api_version})"
            )
        kind = obj.get("kind")
        if kind and kind != rt.kind:
            raise errors.bad_request(
                f"the kind in the data ({kind}) does not match the expected kind ({rt.kind})"
            )

    def _check_namespace(
        self, rt: ResourceType, namespace: str | None, meta: Mapping[str, Any]
    ) -> str | None:
        if not rt.namespaced:
            return None
        body_ns = meta.get("namespace")
        if namespace and body_ns and body_ns != namespace:
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
        namespace = namespace or body_ns
        if not namespace:
            raise errors.bad_request("a namespace is required for a namespaced resource")
        namespaces = self.find_type("", "v1", "namespaces")
        ns_obj = self._objects[namespaces.group_resource].get(("", namespace))
        if ns_obj is None:
            if not self.auto_create_namespaces:
                raise errors.not_found(namespaces, namespace)
            self.create(namespaces, None, {"metadata": {"name": namespace}})
        elif ns_obj["metadata"].get("deletionTimestamp"):
            raise errors.forbidden(
                rt,
                meta.get("name", ""),
                f"unable to create new content in namespace {namespace} because it is being "
                "terminated",
            )
        return namespace

    def _admit(
        self, rt: ResourceType, obj: dict[str, Any], existing: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Pruning, defaulting and the fields built-in strategies set on every write."""
        if not rt.custom and self.builtin_defaults:
            obj = apply_builtin_defaults(rt.group_resource, obj, existing)
        if rt.group_resource == ("apiextensions.k8s.io", "customresourcedefinitions"):
            try:
                crd_types(obj)
            except (ValueError, KeyError, TypeError) as exc:
                raise errors.invalid(rt, obj["metadata"].get("name", ""), str(exc)) from exc
        if rt.custom and self.prune_unknown_fields:
            obj = prune_and_default(obj, rt.schema)
        if rt.group_resource == ("", "namespaces"):
            phase = "Terminating" if obj["metadata"].get("deletionTimestamp") else "Active"
            obj = {**obj, "status": {**(obj.get("status") or {}), "phase": phase}}
        return obj

    def _managed_entry(
        self,
        rt: ResourceType,
        manager: str,
        operation: str,
        fields: dict[str, Any],
        subresource: str | None,
    ) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "manager": manager,
            "operation": operation,
            "apiVersion": rt.api_version,
            "time": now_rfc3339(),
            "fieldsType": "FieldsV1",
            "fieldsV1": fields,
        }
        if subresource:
            entry["subresource"] = subresource
        return entry

    # ----------------------------------------------------------------- updating

    def update(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        field_manager: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """PUT: replace the object (or only its status) with an optimistic-concurrency check."""
        if not isinstance(body, Mapping):
            raise errors.bad_request("the body of the request must be a JSON object")
        with self._lock:
            key = self._key(rt, namespace, name)
            existing = self._objects[rt.group_resource].get(key)
            if existing is None:
                raise errors.not_found(rt, name)
            new = copy.deepcopy(dict(body))
            meta = new.get("metadata") or {}
            self._check_type_meta(rt, new, name)
            if meta.get("name") and meta["name"] != name:
                raise errors.bad_request(
                    "the name of the object does not match the name on the URL"
                )
            if rt.namespaced and meta.get("namespace") and meta["namespace"] != key[0]:
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request"
                )
            rv = meta.get("resourceVersion")
            if not rv and rt.custom:
                raise errors.invalid(
                    rt,
                    name,
                    "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
                )
            result = self._write(
                rt,
                key,
                existing,
                new,
                subresource=subresource,
                manager=field_manager or "unknown",
                operation="Update",
                fields={},
                dry_run=dry_run,
            )
            return self._present(rt, result)

    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        patch_type: str,
        body: Any,
        *,
        subresource: str | None = None,
        field_manager: str | None = None,
        force: bool = False,
        dry_run: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        """PATCH in any of the four flavours; returns (object, created)."""
        with self._lock:
            key = self._key(rt, namespace, name)
            existing = self._objects[rt.group_resource].get(key)
            if patch_type == "apply":
                return self._apply(
                    rt, namespace, name, body, existing, subresource, field_manager, dry_run
                )
            if existing is None:
                raise errors.not_found(rt, name)
            if patch_type == "strategic":
                if rt.custom:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "the body of the request was in an unknown format - accepted media "
                        "types include: application/json-patch+json, "
                        "application/merge-patch+json, application/apply-patch+yaml",
                    )
                if not isinstance(body, Mapping):
                    raise errors.bad_request("a strategic merge patch must be a JSON object")
                new = patching.strategic_merge_patch(existing, body)
            elif patch_type == "merge":
                if not isinstance(body, Mapping):
                    raise errors.bad_request("a merge patch must be a JSON object")
                new = patching.merge_patch(existing, body)
            elif patch_type == "json":
                try:
                    new = patching.json_patch(existing, body)
                except patching.PatchError as exc:
                    if exc.code == 400:
                        raise errors.bad_request(str(exc)) from exc
                    raise ApiError(422, "Invalid", str(exc)) from exc
            else:
                raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {patch_type}")
            if not isinstance(new, dict):
                raise errors.invalid(rt, name, "the patch did not produce an object")
            fields = patching.fields_v1(body) if isinstance(body, Mapping) else {}
            result = self._write(
                rt,
                key,
                existing,
                new,
                subresource=subresource,
                manager=field_manager or "unknown",
                operation="Update",
                fields=fields,
                dry_run=dry_run,
            )
            return self._present(rt, result), False

    def _apply(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        existing: dict[str, Any] | None,
        subresource: str | None,
        field_manager: str | None,
        dry_run: bool,
    ) -> tuple[dict[str, Any], bool]:
        if not field_manager:
            raise ApiError(
                422,
                "Invalid",
                'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is '
                "required for apply patch",
            )
        if not isinstance(body, Mapping):
            raise errors.bad_request("an apply patch must be a YAML or JSON object")
        applied = copy.deepcopy(dict(body))
        if not applied.get("apiVersion") or not applied.get("kind"):
            raise errors.bad_request("apiVersion and kind must be set in an apply patch")
        self._check_type_meta(rt, applied, name)
        meta = applied.get("metadata") or {}
        if meta.get("name") and meta["name"] != name:
            raise errors.bad_request("the name of the object does not match the name on the URL")
        if existing is None:
            if subresource:
                raise errors.not_found(rt, name)
            created = self.create(
                rt,
                namespace,
                {**applied, "metadata": {**meta, "name": name}},
                field_manager=field_manager,
                operation="Apply",
                dry_run=dry_run,
            )
            if not dry_run:
                key = self._key(rt, namespace, name)
                self._applied[(rt.group_resource, *key, field_manager, "")] = applied
            return created, True
        key = self._key(rt, namespace, name)
        applied_key = (rt.group_resource, *key, field_manager, subresource or "")
        new = patching.apply_merge(existing, applied)
        previous = self._applied.get(applied_key)
        if previous is not None:
            new = patching.prune_unapplied(copy.deepcopy(new), previous, applied)
        fields = patching.fields_v1(
            {k: v for k, v in applied.items() if k not in ("apiVersion", "kind")}
        )
        result = self._write(
            rt,
            key,
            existing,
            new,
            subresource=subresource,
            manager=field_manager,
            operation="Apply",
            fields=fields,
            dry_run=dry_run,
        )
        if not dry_run:
            self._applied[applied_key] = applied
        return self._present(rt, result), False

    def _write(
        self,
        rt: ResourceType,
        key: ObjectKey,
        existing: dict[str, Any],
        new: dict[str, Any],
        *,
        subresource: str | None,
        manager: str,
        operation: str,
        fields: dict[str, Any],
        dry_run: bool,
    ) -> dict[str, Any]:
        """The common tail of PUT and PATCH: preconditions, isolation, generation, finalizers."""
        old_meta: dict[str, Any] = existing["metadata"]
        new_meta: dict[str, Any] = dict(new.get("metadata") or {})
        rv = new_meta.get("resourceVersion")
        if rv and str(rv) != old_meta["resourceVersion"]:
            raise errors.conflict(rt, key[1])
        uid = new_meta.get("uid")
        if uid and uid != old_meta["uid"]:
            raise errors.conflict(
                rt,
                key[1],
                f"Precondition failed: UID in precondition: {uid}, UID in object "
                f"meta: {old_meta['uid']}",
            )
        if subresource == "status":
            # Status writes change status only (the status strategy resets everything else).
            result = dict(existing)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
            meta = dict(old_meta)
        elif subresource:
            raise ApiError(404, "NotFound", f"subresource {subresource} is not served here")
        else:
            result = dict(new)
            if rt.has_status:
                if "status" in existing:
                    result["status"] = existing["status"]
                else:
                    result.pop("status", None)
            meta = new_meta
            for immutable in (
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
                "name",
                "namespace",
                "resourceVersion",
            ):
                if immutable in old_meta:
                    meta[immutable] = old_meta[immutable]
                else:
                    meta.pop(immutable, None)
            if old_meta.get("deletionTimestamp"):
                added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
                if added:
                    raise errors.invalid(
                        rt,
                        key[1],
                        "metadata.finalizers: Forbidden: no new finalizers can be "
                        "added if the object is being deleted",
                    )
        meta["managedFields"] = self._merge_managed(
            rt, old_meta.get("managedFields") or [], manager, operation, fields, subresource
        )
        result["metadata"] = meta
        result["apiVersion"] = rt.api_version
        result["kind"] = rt.kind
        result = self._admit(rt, result, existing)
        if rt.group_resource == ("apiextensions.k8s.io", "customresourcedefinitions"):
            result = self._apply_crd(result)
        if _strip(result, keep_status=not rt.has_status) != _strip(
            existing, keep_status=not rt.has_status
        ):
            generation = int(old_meta.get("generation", 1)) + 1
            result = {**result, "metadata": {**result["metadata"], "generation": generation}}
        meta = result["metadata"]
        if _without_managed_fields(result) == _without_managed_fields(existing):
            return existing  # a no-op write changes nothing, not even the resourceVersion
        if dry_run:
            return result
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            final = self._remove(rt, key, result)
            self._collect_garbage()
            return final
        if (meta.get("ownerReferences") or []) != (old_meta.get("ownerReferences") or []):
            self._gc_needed = True
        if (meta.get("finalizers") or []) != (old_meta.get("finalizers") or []):
            self._gc_needed = True
        stored = self._replace(rt, key, result, existing)
        self._disown(rt, key, manager if operation == "Apply" else None, stored)
        self._collect_garbage()
        return stored

    def _disown(
        self, rt: ResourceType, key: ObjectKey, writer: str | None, live: dict[str, Any]
    ) -> None:
        """Other managers lose the fields this write changed (see patching.disown_changed)."""
        for applied_key, applied in list(self._applied.items()):
            if applied_key[:3] != (rt.group_resource, *key) or applied_key[3] == writer:
                continue
            self._applied[applied_key] = patching.disown_changed(applied, live) or {}

    def _merge_managed(
        self,
        rt: ResourceType,
        entries: Iterable[Mapping[str, Any]],
        manager: str,
        operation: str,
        fields: dict[str, Any],
        subresource: str | None,
    ) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = []
        previous: Mapping[str, Any] | None = None
        for entry in entries:
            same = (
                entry.get("manager") == manager
                and entry.get("operation") == operation
                and entry.get("subresource") == subresource
            )
            if same:
                previous = entry
            else:
                result.append(dict(entry))
        if operation == "Apply" or previous is None:
            merged_fields = fields
        else:
            merged_fields = patching.merge_patch(previous.get("fieldsV1") or {}, fields)
        result.append(self._managed_entry(rt, manager, operation, merged_fields, subresource))
        return result

    def _replace(
        self, rt: ResourceType, key: ObjectKey, new: dict[str, Any], old: dict[str, Any]
    ) -> dict[str, Any]:
        if new == old:
            return old
        return self._commit(rt, "MODIFIED", key, new, old)

    # ----------------------------------------------------------------- scale

    def get_scale(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        """The autoscaling/v1 Scale view of an object (what `kubectl scale` and HPAs use)."""
        with self._lock:
            obj = self._objects[rt.group_resource].get(self._key(rt, namespace, name))
            if obj is None:
                raise errors.not_found(rt, name)
            return self._scale_of(rt, obj)

    def _scale_of(self, rt: ResourceType, obj: Mapping[str, Any]) -> dict[str, Any]:
        spec_path, status_path, selector_path = rt.scale_paths
        meta = obj["metadata"]
        selector = _dig(obj, selector_path) if selector_path else None
        if selector is None and not rt.custom:
            match_labels = (obj.get("spec") or {}).get("selector") or {}
            match_labels = match_labels.get("matchLabels", match_labels)
            selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
        status: dict[str, Any] = {"replicas": _dig(obj, status_path) or 0}
        if selector:
            status["selector"] = selector
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                key: meta[key]
                for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if key in meta
            },
            "spec": {"replicas": _dig(obj, spec_path) or 0},
            "status": status,
        }

    def write_scale(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        patch_type: str | None,
        body: Any,
        *,
        field_manager: str | None = None,
    ) -> dict[str, Any]:
        """PUT (patch_type None) or PATCH the Scale; only the replica count is written back."""
        with self._lock:
            key = self._key(rt, namespace, name)
            existing = self._objects[rt.group_resource].get(key)
            if existing is None:
                raise errors.not_found(rt, name)
            scale = self._scale_of(rt, existing)
            if patch_type is None:
                new_scale = body
            elif patch_type == "json":
                try:
                    new_scale = patching.json_patch(scale, body)
                except patching.PatchError as exc:
                    raise ApiError(exc.code, "Invalid", str(exc)) from exc
            elif patch_type == "strategic":
                new_scale = patching.strategic_merge_patch(scale, body)
            else:
                new_scale = patching.merge_patch(scale, body)
            if not isinstance(new_scale, Mapping):
                raise errors.bad_request("a Scale must be an object")
            meta = new_scale.get("metadata") or {}
            if meta.get("resourceVersion") and meta["resourceVersion"] != scale["metadata"].get(
                "resourceVersion"
            ):
                raise errors.conflict(rt, name)
            replicas = (new_scale.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise errors.invalid(rt, name, "spec.replicas: must be a non-negative integer")
            new = _set_path(copy.deepcopy(existing), rt.scale_paths[0], replicas)
            result = self._write(
                rt,
                key,
                existing,
                new,
                subresource=None,
                manager=field_manager or "unknown",
                operation="Update",
                fields={},
                dry_run=False,
            )
            return self._scale_of(rt, result)

    # ----------------------------------------------------------------- deleting

    def delete(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        *,
        propagation: str | None = None,
        preconditions: Mapping[str, Any] | None = None,
        dry_run: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        """Returns (last state, deleted now); finalizers keep it with a deletionTimestamp."""
        with self._lock:
            key = self._key(rt, namespace, name)
            existing = self._objects[rt.group_resource].get(key)
            if existing is None:
                raise errors.not_found(rt, name)
            meta = existing["metadata"]
            preconditions = preconditions or {}
            if preconditions.get("uid") and preconditions["uid"] != meta["uid"]:
                raise errors.conflict(
                    rt,
                    name,
                    f"Precondition failed: UID in precondition: {preconditions['uid']}, "
                    f"UID in object meta: {meta['uid']}",
                )
            expected_rv = preconditions.get("resourceVersion")
            if expected_rv and expected_rv != meta["resourceVersion"]:
                raise errors.conflict(rt, name)
            if dry_run:
                return self._present(rt, existing), False
            if meta.get("deletionTimestamp"):
                return self._present(rt, existing), False
            policy = propagation or "Background"
            if policy not in ("Background", "Foreground", "Orphan"):
                raise errors.bad_request(f"unknown propagationPolicy {policy!r}")
            if policy == "Orphan":
                self._orphan_dependents(meta["uid"])
            finalizers = list(meta.get("finalizers") or [])
            if policy == "Foreground" and self._has_dependents(meta["uid"]):
                finalizers.append(FOREGROUND)
            if rt.group_resource == ("", "namespaces"):
                finalizers = finalizers or []
                self._gc_needed = True
                new_meta = {
                    **meta,
                    "deletionTimestamp": now_rfc3339(),
                    "finalizers": finalizers,
                }
                terminating = self._admit(rt, {**existing, "metadata": new_meta})
                stored = self._replace(rt, key, terminating, existing)
                self._collect_garbage()
                final = self._objects[rt.group_resource].get(key, stored)
                return self._present(rt, final), key not in self._objects[rt.group_resource]
            if finalizers:
                new_meta = {
                    **meta,
                    "deletionTimestamp": now_rfc3339(),
                    "deletionGracePeriodSeconds": 0,
                    "finalizers": finalizers,
                    "generation": int(meta.get("generation", 1)) + 1,
                }
                stored = self._replace(rt, key, {**existing, "metadata": new_meta}, existing)
                self._gc_needed = True
                self._collect_garbage()
                return self._present(rt, stored), False
            final = self._remove(rt, key, existing)
            self._collect_garbage()
            return self._present(rt, final), True

    def delete_collection(
        self,
        rt: ResourceType,
        namespace: str | None,
        selector: Selector,
        *,
        propagation: str | None = None,
    ) -> list[dict[str, Any]]:
        with self._lock:
            doomed = [
                key
                for key, obj in self._objects[rt.group_resource].items()
                if (namespace is None or key[0] == namespace) and selector.matches(obj)
            ]
            results = []
            for ns, name in doomed:
                if (ns, name) in self._objects[rt.group_resource]:
                    obj, _ = self.delete(rt, ns or None, name, propagation=propagation)
                    results.append(obj)
            return results

    def _type_of(self, group_resource: GroupResource) -> ResourceType:
        for rt in self._types.values():
            if rt.group_resource == group_resource:
                return rt
        raise KeyError(group_resource)  # pragma: no cover

    def _all_objects(self) -> Iterable[tuple[GroupResource, ObjectKey, dict[str, Any]]]:
        for group_resource, objects in list(self._objects.items()):
            for key, obj in list(objects.items()):
                yield group_resource, key, obj

    def _has_dependents(self, uid: str) -> bool:
        return any(
            any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])
            for _, _, obj in self._all_objects()
        )

    def _orphan_dependents(self, uid: str) -> None:
        for group_resource, key, obj in self._all_objects():
            refs = obj["metadata"].get("ownerReferences") or []
            kept = [ref for ref in refs if ref.get("uid") != uid]
            if len(kept) != len(refs):
                meta = {**obj["metadata"], "ownerReferences": kept}
                if not kept:
                    del meta["ownerReferences"]
                self._replace(self._type_of(group_resource), key, {**obj, "metadata": meta}, obj)

    def _collect_garbage(self) -> None:
        """The garbage collector and namespace controller, run to a fixed point after writes."""
        if self._collecting:
            return  # deletions made by the collector itself are picked up by its own loop
        self._collecting = True
        try:
            self._collect_rounds()
        finally:
            self._collecting = False

    def _collect_rounds(self) -> None:
        rounds = 0
        while self._gc_needed and rounds < 1000:
            self._gc_needed = False
            rounds += 1
            for group_resource, key, obj in self._all_objects():
                if key not in self._objects[group_resource]:
                    continue
                obj = self._objects[group_resource][key]
                rt = self._type_of(group_resource)
                meta = obj["metadata"]
                refs = meta.get("ownerReferences") or []
                if refs and not meta.get("deletionTimestamp"):
                    owners = [self._lookup_uid(ref.get("uid", "")) for ref in refs]
                    owner_gone = all(owner is None for owner in owners)
                    in_foreground = any(
                        owner is not None
                        and owner["metadata"].get("deletionTimestamp")
                        and FOREGROUND in (owner["metadata"].get("finalizers") or [])
                        for owner in owners
                    )
                    if owner_gone or in_foreground:
                        self.delete(rt, key[0] or None, key[1])
                        self._gc_needed = True
                        continue
                if meta.get("deletionTimestamp"):
                    finalizers = list(meta.get("finalizers") or [])
                    if FOREGROUND in finalizers and not self._has_dependents(meta["uid"]):
                        finalizers.remove(FOREGROUND)
                        new = {**obj, "metadata": {**meta, "finalizers": finalizers}}
                        if not finalizers:
                            self._remove(rt, key, new)
                        else:
                            self._replace(rt, key, new, obj)
                        self._gc_needed = True
                        continue
                    if group_resource == ("", "namespaces"):
                        self._terminate_namespace(key[1], rt, key, obj)
        if rounds >= 1000:  # pragma: no cover
            raise RuntimeError("garbage collection did not converge")

    def _terminate_namespace(
        self, namespace: str, rt: ResourceType, key: ObjectKey, obj: dict[str, Any]
    ) -> None:
        remaining = False
        for group_resource, (ns, name), item in self._all_objects():
            if ns != namespace or group_resource == ("", "namespaces"):
                continue
            remaining = True
            if not item["metadata"].get("deletionTimestamp"):
                self.delete(self._type_of(group_resource), ns, name)
                self._gc_needed = True
        if not remaining and not obj["metadata"].get("finalizers"):
            self._remove(rt, key, obj)

    def _lookup_uid(self, uid: str) -> dict[str, Any] | None:
        location = self._uids.get(uid)
        if location is None:
            return None
        group_resource, key = location
        return self._objects[group_resource].get(key)

    # ----------------------------------------------------------------- watching

    def subscribe(
        self,
        rt: ResourceType,
        namespace: str | None,
        selector: Selector,
        since: str | None,
        loop: asyncio.AbstractEventLoop,
    ) -> tuple[list[StoredEvent], list[StoredEvent], int, Subscription]:
        """Start a watch: (synthetic ADDED for current objects, retained backlog, start RV, sub).

        With no resourceVersion (or "0") the current state is sent first, as the real API
        does; with N only events after N are sent, and N older than the retained window is
        410 Gone.
        """
        with self._lock:
            initial: list[StoredEvent] = []
            backlog: list[StoredEvent] = []
            if since in (None, "", "0"):
                for key, obj in sorted(
                    self._objects[rt.group_resource].items(),
                    key=lambda item: int(item[1]["metadata"]["resourceVersion"]),
                ):
                    if (namespace is None or key[0] == namespace) and selector.matches(obj):
                        rv = int(obj["metadata"]["resourceVersion"])
                        initial.append(
                            StoredEvent(rv, "ADDED", rt.group_resource, key[0], key[1], obj, None)
                        )
                start = self._rv
            else:
                try:
                    start = int(str(since))
                except ValueError as exc:
                    raise errors.bad_request(f"invalid resourceVersion {since!r}") from exc
                if start < self._compacted_rv:
                    raise errors.gone(f"too old resource version: {start} ({self._compacted_rv})")
                backlog = [
                    ev
                    for ev in self._events
                    if ev.rv > start and ev.group_resource == rt.group_resource
                ]
            sub = Subscription(rt.group_resource, loop)
            self._subscriptions.append(sub)
            return initial, backlog, start, sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subscriptions:
                self._subscriptions.remove(sub)

    def close_watches(self) -> None:
        """End every live watch stream (used when the server stops)."""
        with self._lock:
            for sub in self._subscriptions:
                if not sub.loop.is_closed():
                    sub.loop.call_soon_threadsafe(sub.queue.put_nowait, None)

    # ----------------------------------------------------------------- introspection

    def all_objects(self) -> list[tuple[ResourceType, dict[str, Any]]]:
        with self._lock:
            return [
                (self._type_of(gr), self._present(self._type_of(gr), obj))
                for gr, _, obj in self._all_objects()
            ]

    def count(self) -> int:
        with self._lock:
            return sum(len(objs) for objs in self._objects.values())


def _dig(obj: Mapping[str, Any], path: str) -> Any:
    current: Any = obj
    for segment in path.strip(".").split("."):
        if not isinstance(current, Mapping):
            return None
        current = current.get(segment)
    return current


def _set_path(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    segments = path.strip(".").split(".")
    current = obj
    for segment in segments[:-1]:
        current = current.setdefault(segment, {})
    current[segments[-1]] = value
    return obj
