"""The four PATCH flavours of the Kubernetes API, applied to plain JSON dicts.

Which flavour a client uses decides what survives: the `kubernetes` client sends
strategic-merge patches for built-ins (so a patch of one container must keep the others'
images), kopf and `CustomObjectsApi` send JSON merge patches, kopf guards list edits with
JSON patches whose `test` op checks the resourceVersion, and our operator applies its
children with server-side apply. Merge keys below are those of the Kubernetes API types
(`patchMergeKey` tags in k8s.io/api core/v1 and meta/v1 types.go).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

import jsonpatch

# Field name -> candidate merge keys (the first one present in an item wins; `ports` is keyed
# by containerPort in containers and by port in Services).
MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "volumeDevices": ("devicePath",),
    "ports": ("containerPort", "port"),
    "imagePullSecrets": ("name",),
    "conditions": ("type",),
    "ownerReferences": ("uid",),
    "hostAliases": ("ip",),
}
# Lists of scalars with patchStrategy=merge (union instead of replace).
MERGED_SCALAR_LISTS = frozenset({"finalizers"})


class PatchError(ValueError):
    """A patch the API server rejects with 422 (or 400 for an unreadable body)."""

    def __init__(self, message: str, code: int = 422) -> None:
        super().__init__(message)
        self.code = code


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, null deletes, lists are replaced."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result: dict[str, Any] = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _merge_key(field: str, items: list[Any]) -> str | None:
    candidates = MERGE_KEYS.get(field)
    if not candidates:
        return None
    for key in candidates:
        if any(isinstance(item, Mapping) and key in item for item in items):
            return key
    return candidates[0]


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch with the directives kubectl and client libraries send.

    Supported: keyed list merge, `$patch: replace|delete` on maps and list items,
    `$deleteFromPrimitiveList/<field>`, `$retainKeys`; `$setElementOrder/<field>` is
    accepted and ignored (order follows the existing list, new items appended).
    """
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    result: dict[str, Any] = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            removed = set(map(_hashable, value or []))
            result[field] = [v for v in result.get(field) or [] if _hashable(v) not in removed]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value, strategic=True)
        else:
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def apply_merge(target: Any, applied: Any) -> Any:
    """Merge an applied configuration (server-side apply) into the live object.

    Maps merge recursively, keyed lists merge by their key, every other list is replaced
    wholesale (the default `atomic` list type). Field ownership is not modelled here.
    """
    if not isinstance(applied, Mapping):
        return copy.deepcopy(applied)
    result: dict[str, Any] = dict(target) if isinstance(target, Mapping) else {}
    for key, value in applied.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value, strategic=False)
        else:
            result[key] = apply_merge(result.get(key), value)
    return result


def _hashable(value: Any) -> Any:
    return repr(value) if isinstance(value, (dict, list)) else value


def _merge_list(field: str, current: Any, patch: list[Any], *, strategic: bool) -> list[Any]:
    current_list: list[Any] = list(current) if isinstance(current, list) else []
    if strategic and any(isinstance(i, Mapping) and i.get("$patch") == "replace" for i in patch):
        return [
            copy.deepcopy(i)
            for i in patch
            if not (isinstance(i, Mapping) and i.get("$patch") == "replace")
        ]
    if field in MERGED_SCALAR_LISTS:
        merged = list(current_list)
        for item in patch:
            if item not in merged:
                merged.append(item)
        return merged
    key = _merge_key(field, patch)
    if key is None or not all(isinstance(i, Mapping) for i in patch):
        return copy.deepcopy(patch)
    merge = strategic_merge_patch if strategic else apply_merge
    result = list(current_list)
    for item in patch:
        if key not in item:
            raise PatchError(f"map in list {field!r} is missing its merge key {key!r}")
        index = next(
            (
                i
                for i, old in enumerate(result)
                if isinstance(old, Mapping) and old.get(key) == item[key]
            ),
            None,
        )
        if strategic and item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
            continue
        if index is None:
            result.append(merge(None, item))
        else:
            result[index] = merge(result[index], item)
    return result


def prune_unapplied(obj: Any, previous: Any, current: Any) -> Any:
    """Remove what a manager applied before but no longer applies.

    This approximates server-side apply's ownership: fields the same manager set last time and
    left out now are deleted (as when the operator drops an env var from a rendered Deployment).
    Fields set by other managers are not tracked, so they survive only if the manager never
    applied them.
    """
    if not isinstance(obj, dict) or not isinstance(previous, Mapping):
        return obj
    current_map: Mapping[str, Any] = current if isinstance(current, Mapping) else {}
    for key, old_value in previous.items():
        if key not in obj:
            continue
        if key not in current_map:
            del obj[key]
        elif isinstance(old_value, Mapping):
            prune_unapplied(obj[key], old_value, current_map[key])
        elif isinstance(old_value, list) and isinstance(obj[key], list):
            merge_key = _merge_key(key, old_value)
            new_list = current_map[key] if isinstance(current_map[key], list) else []
            if merge_key is None:
                continue
            kept_keys = {i.get(merge_key) for i in new_list if isinstance(i, Mapping)}
            old_items = {i.get(merge_key): i for i in old_value if isinstance(i, Mapping)}
            new_items = {i.get(merge_key): i for i in new_list if isinstance(i, Mapping)}
            remaining = []
            for item in obj[key]:
                item_key = item.get(merge_key) if isinstance(item, Mapping) else None
                if item_key in old_items and item_key not in kept_keys:
                    continue
                if item_key in old_items:
                    prune_unapplied(item, old_items[item_key], new_items[item_key])
                remaining.append(item)
            obj[key] = remaining
    return obj


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902; a failed `test` or a bad path is 422 Unprocessable, as on a real server."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations", code=400)
    try:
        return jsonpatch.apply_patch(target, operations, in_place=False)
    except jsonpatch.JsonPatchTestFailed as exc:
        raise PatchError(f"the server rejected our request: {exc}") from exc
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
        raise PatchError(f"the server rejected our request: {exc}") from exc
    except (TypeError, KeyError, IndexError, ValueError) as exc:
        raise PatchError(f"invalid JSON patch: {exc}") from exc


def fields_v1(obj: Any) -> dict[str, Any]:
    """A FieldsV1 ownership set in the API's `f:`/`k:` notation for the fields an apply set."""
    result: dict[str, Any] = {}
    if not isinstance(obj, Mapping):
        return result
    for key, value in obj.items():
        if isinstance(value, Mapping):
            result[f"f:{key}"] = fields_v1(value)
        elif isinstance(value, list) and (merge_key := _merge_key(key, value)) is not None:
            entries: dict[str, Any] = {".": {}}
            for item in value:
                if isinstance(item, Mapping) and merge_key in item:
                    ident = json.dumps({merge_key: item[merge_key]}, separators=(",", ":"))
                    entries[f"k:{ident}"] = {".": {}, **fields_v1(item)}
            result[f"f:{key}"] = entries
        else:
            result[f"f:{key}"] = {}
    return result


def disown_changed(applied: Any, live: Any) -> Any:
    """What a manager still owns after someone else wrote the object.

    A field whose live value no longer equals what the manager applied was taken over by the
    other writer (server-side apply moves ownership to whoever last set a value), so a later
    apply that omits it must not delete it.
    """
    if not isinstance(applied, Mapping) or not isinstance(live, Mapping):
        return applied if applied == live else None
    result: dict[str, Any] = {}
    for key, value in applied.items():
        if key not in live:
            continue
        current = live[key]
        if isinstance(value, Mapping):
            kept = disown_changed(value, current)
            if kept is not None:
                result[key] = kept
        elif isinstance(value, list) and (merge_key := _merge_key(key, value)) is not None:
            by_key = {i.get(merge_key): i for i in current or [] if isinstance(i, Mapping)}
            items = []
            for item in value:
                if isinstance(item, Mapping) and item.get(merge_key) in by_key:
                    kept = disown_changed(item, by_key[item.get(merge_key)])
                    items.append({**(kept or {}), merge_key: item[merge_key]})
            result[key] = items
        elif value == current:
            result[key] = value
    return result
