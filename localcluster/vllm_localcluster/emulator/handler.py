"""The HTTP face of the emulator: kmock's request handling over `ObjectStore` semantics.

kmock parses and records every request and serves its reaction DSL (so a test can still add
`emulator['get /openapi/v2'] << {...}`); resource URLs are served here, from the store,
because kmock's own in-memory emulator lacks what kopf and our operator depend on (uids,
resourceVersions, 201s, selectors, SSA, status isolation, garbage collection; see
kmock 0.8, probed). Discovery is answered from the same
registry the store uses, so CRDs created through the API are discoverable at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import yaml

from vllm_localcluster.emulator import errors
from vllm_localcluster.emulator.errors import ApiError
from vllm_localcluster.emulator.schema import ResourceType
from vllm_localcluster.emulator.selectors import Selector, SelectorError
from vllm_localcluster.emulator.store import ObjectStore, StoredEvent

logger = logging.getLogger(__name__)

PATCH_TYPES = {
    "application/json-patch+json": "json",
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
    "application/apply-patch+yaml": "apply",
}
_BINARY_TYPES = frozenset({"application/vnd.kubernetes.protobuf", "application/cbor"})
_VERSION_RE = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?$")


@dataclass(frozen=True)
class ApiPath:
    """A resource URL: /api/v1/... or /apis/{group}/{version}/... ."""

    group: str
    version: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None
    watch_prefix: bool = False


def parse_api_path(path: str) -> ApiPath | None:
    """Parse a resource URL; None for discovery and non-API paths.

    Unlike kmock's parser this tells `/api/v1/namespaces/x` (a Namespace) from
    `/api/v1/namespaces/x/pods` (pods in x).
    """
    parts = [p for p in path.strip("/").split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    watch_prefix = bool(rest) and rest[0] == "watch"
    if watch_prefix:
        rest = rest[1:]
    if not rest:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return ApiPath(group, version, plural, namespace, name, subresource, watch_prefix)


@dataclass
class RequestRecord:
    """One API request, as an auditor would see it (for RBAC and "who wrote what" checks)."""

    verb: str  # get, list, watch, create, update, patch, delete, deletecollection, or the method
    group: str | None
    version: str | None
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    content_type: str | None
    field_manager: str | None
    user_agent: str | None
    method: str
    path: str
    time: float
    params: dict[str, str]
    body: Any = None  # the parsed JSON (or apply YAML) body; None when absent or unreadable
    status_code: int | None = None

    def matches(self, criteria: Mapping[str, Any]) -> bool:
        """Equality per field; a set, list or tuple value means "any of these"."""
        for key, expected in criteria.items():
            actual = getattr(self, key)
            if isinstance(expected, (set, frozenset, list, tuple)):
                if actual not in expected:
                    return False
            elif actual != expected:
                return False
        return True


@dataclass
class Fault:
    """A planned failure or delay for matching requests (for reliability tests)."""

    match: Callable[[RequestRecord], bool] | Mapping[str, Any] | None
    status: int | None
    times: int | None
    delay: float = 0.0
    message: str = "injected fault"
    hits: int = 0

    def applies(self, record: RequestRecord) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.match is None:
            return True
        if callable(self.match):
            return bool(self.match(record))
        return record.matches(self.match)


_REASONS = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def _version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes version ordering: GA > beta > alpha, then higher numbers first."""
    match = _VERSION_RE.match(version)
    if not match:
        return (0, 0, 0)
    stage = {"alpha": 1, "beta": 2}.get(match[2] or "", 3)
    return (stage, int(match[1]), int(match[3] or 0))


class KubernetesAPIEmulator(kmock.KubernetesScaffold):
    """A kmock handler serving a realistic Kubernetes API from an `ObjectStore`."""

    def __init__(
        self,
        *,
        auto_create_namespaces: bool = True,
        event_window: int = 10_000,
        history_limit: int = 50,
        prune_unknown_fields: bool = True,
        builtin_defaults: bool = True,
        bookmark_interval: float = 5.0,
        max_requests_kept: int = 100_000,
    ) -> None:
        self.store = ObjectStore(
            auto_create_namespaces=auto_create_namespaces,
            event_window=event_window,
            history_limit=history_limit,
            prune_unknown_fields=prune_unknown_fields,
            builtin_defaults=builtin_defaults,
        )
        self.bookmark_interval = bookmark_interval
        self.max_requests_kept = max_requests_kept
        self._records: list[RequestRecord] = []
        self._faults: list[Fault] = []
        super().__init__()

    # ------------------------------------------------------------------ public API for tests

    @property
    def requests(self) -> list[RequestRecord]:
        return list(self._records)

    def requests_matching(
        self, match: Callable[[RequestRecord], bool] | None = None, **criteria: Any
    ) -> list[RequestRecord]:
        return [r for r in self.requests if r.matches(criteria) and (match is None or match(r))]

    def verbs_used(self, user_agent_prefix: str | None = None) -> set[tuple[str, str, str]]:
        """(verb, group, resource[/subresource]) of every API request, for RBAC checks."""
        return {
            (r.verb, r.group or "", r.resource + (f"/{r.subresource}" if r.subresource else ""))
            for r in self.requests
            if r.resource is not None
            and (user_agent_prefix is None or (r.user_agent or "").startswith(user_agent_prefix))
        }

    def clear_requests(self) -> None:
        self._records.clear()

    def inject(
        self,
        match: Callable[[RequestRecord], bool] | Mapping[str, Any] | None = None,
        status: int | None = 500,
        times: int | None = 1,
        delay: float = 0.0,
        message: str = "injected fault",
    ) -> Fault:
        """Fail (status) and/or delay (seconds) the next `times` matching requests.

        `match` is a callable on RequestRecord or a dict of RequestRecord fields, e.g.
        `{"verb": "patch", "resource": "vllmdeployments", "subresource": "status"}`.
        `status=None` only delays. `times=None` keeps the fault forever.
        """
        fault = Fault(match, status, times, delay, message)
        self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        self._faults.clear()

    def register_crd(self, crd: Mapping[str, Any]) -> list[ResourceType]:
        return self.store.register_crd(crd).types

    def register_crds_from(self, path: str | Path) -> list[ResourceType]:
        """Register every CustomResourceDefinition in a YAML file or a directory of them."""
        root = Path(path)
        files = (
            sorted(root.glob("*.yaml")) + sorted(root.glob("*.yml")) if root.is_dir() else [root]
        )
        registered: list[ResourceType] = []
        for file in files:
            for doc in yaml.safe_load_all(file.read_text()):
                if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                    registered.extend(self.register_crd(doc))
        return registered

    def get_object(
        self, resource: str | ResourceType, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        """The current object, e.g. `get_object("apps/v1/deployments", "default", "x")`."""
        return self.store.peek(self.store.resolve(resource), namespace, name)

    def list_objects(
        self,
        resource: str | ResourceType,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        rt = self.store.resolve(resource)
        selector = Selector.parse(label_selector, field_selector)
        return self.store.list_objects(rt, namespace, selector).items

    def object_history(
        self, resource: str | ResourceType, namespace: str | None, name: str
    ) -> list[dict[str, Any]]:
        """Past versions (oldest first, bounded), including the final state of a deleted one."""
        return self.store.history(self.store.resolve(resource), namespace, name)

    def compact(self) -> int:
        """Expire all retained watch events (resuming any older watch then gets 410 Gone)."""
        return self.store.compact()

    # ------------------------------------------------------------------ request handling

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """Parse the request ourselves: kmock 0.8's parser fails on `/api/v1/namespaces`."""
        body = await raw_request.read()
        try:
            data = json.loads(body) if body.strip() else None
        except ValueError:
            data = None
        api_path = parse_api_path(raw_request.path)
        method = raw_request.method.upper()
        action: kmock.action | None = None
        if api_path is not None:
            watching = raw_request.query.get("watch") in ("true", "1") or api_path.watch_prefix
            action = {
                "GET": kmock.action.WATCH
                if watching
                else (kmock.action.FETCH if api_path.name else kmock.action.LIST),
                "POST": kmock.action.CREATE,
                "PUT": kmock.action.UPDATE,
                "PATCH": kmock.action.UPDATE,
                "DELETE": kmock.action.DELETE,
            }.get(method)
        request = kmock.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=method,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            cookies=dict(raw_request.cookies),
            body=body,
            text=body.decode("utf-8", errors="replace"),
            data=data,
            action=action,
            resource=kmock.resource(
                group=api_path.group, version=api_path.version, plural=api_path.plural
            )
            if api_path
            else None,
            namespace=api_path.namespace if api_path else None,
            name=api_path.name if api_path else None,
            subresource=api_path.subresource if api_path else None,
        )
        self._requests.append(request)
        return await self._handle(request)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        api_path = parse_api_path(request.url.path)
        record = self._record(request, api_path)
        response: aiohttp.web.StreamResponse
        try:
            fault = next((f for f in self._faults if f.applies(record)), None)
            if fault is not None:
                fault.hits += 1
                if fault.delay:
                    await asyncio.sleep(fault.delay)
                if fault.status is not None:
                    raise ApiError(
                        fault.status, _REASONS.get(fault.status, "InternalError"), fault.message
                    )
            if api_path is None:
                discovery = self._discovery(request.url.path)
                if request.url.path in ("/healthz", "/readyz", "/livez"):
                    response = aiohttp.web.Response(text="ok")
                elif discovery is not None:
                    response = aiohttp.web.json_response(discovery)
                else:
                    response = await super()._handle(request)
            else:
                response = await self._serve(request, api_path, record, raw)
        except ApiError as exc:
            response = aiohttp.web.json_response(exc.status(), status=exc.code)
        except kmock.KubernetesError as exc:
            status = ApiError(exc.status, exc.reason or "NotFound", exc.message or "")
            response = aiohttp.web.json_response(status.status(), status=exc.status)
        except Exception as exc:
            logger.exception("emulator failed on %s %s", request.method, request.url)
            status = ApiError(500, "InternalError", f"{type(exc).__name__}: {exc}")
            status.details = {"causes": [{"message": traceback.format_exc()}]}
            response = aiohttp.web.json_response(status.status(), status=500)
        record.status_code = response.status
        return response

    def _record(self, request: kmock.Request, api_path: ApiPath | None) -> RequestRecord:
        method = str(request.method.value if hasattr(request.method, "value") else request.method)
        params = request.params
        verb = method.lower()
        if api_path is not None:
            watching = params.get("watch") in ("true", "1") or api_path.watch_prefix
            if method == "GET":
                verb = "watch" if watching else ("get" if api_path.name else "list")
            elif method == "POST":
                verb = "create"
            elif method == "PUT":
                verb = "update"
            elif method == "PATCH":
                verb = "patch"
            elif method == "DELETE":
                verb = "delete" if api_path.name else "deletecollection"
        headers = {k.lower(): v for k, v in request.headers.items()}
        record = RequestRecord(
            verb=verb,
            group=api_path.group if api_path else None,
            version=api_path.version if api_path else None,
            resource=api_path.plural if api_path else None,
            subresource=api_path.subresource if api_path else None,
            namespace=api_path.namespace if api_path else None,
            name=api_path.name if api_path else None,
            content_type=(headers.get("content-type") or "").split(";")[0] or None,
            field_manager=params.get("fieldManager"),
            user_agent=headers.get("user-agent"),
            method=method,
            path=request.url.path,
            time=time.time(),
            params=dict(params),
            body=_parsed_body(request.body, headers.get("content-type") or ""),
        )
        self._records.append(record)
        if len(self._records) > self.max_requests_kept:
            del self._records[: len(self._records) // 2]
        # kmock keeps full request bodies too; bound them for long demo runs.
        kept: list[Any] = self._requests
        if len(kept) > self.max_requests_kept:
            del kept[: len(kept) // 2]
        return record

    async def _serve(
        self,
        request: kmock.Request,
        path: ApiPath,
        record: RequestRecord,
        raw: aiohttp.web.BaseRequest | None,
    ) -> aiohttp.web.StreamResponse:
        rt = self.store.find_type(path.group, path.version, path.plural)
        params = request.params
        method = record.method
        dry_run = params.get("dryRun") == "All"
        manager: str | None = params.get("fieldManager") or _manager_from_user_agent(
            record.user_agent
        )
        if path.subresource == "scale" and "scale" in rt.subresources and path.name:
            return await self._serve_scale(rt, path, record, request, manager)
        if path.subresource not in (None, "status"):
            raise ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource "
                f"({path.plural}/{path.subresource})",
            )
        if path.subresource == "status" and not rt.has_status:
            raise ApiError(404, "NotFound", f"{rt.describe()} has no status subresource")
        if rt.namespaced and path.namespace is None and method in ("PUT", "PATCH") and path.name:
            raise errors.bad_request("a namespace is required for a namespaced resource")
        namespace = path.namespace if rt.namespaced else None

        if request.body and record.content_type in _BINARY_TYPES:
            # No protobuf or CBOR decoding here; real clients retry with JSON after a 415.
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types "
                f"include: application/json, application/yaml, {', '.join(PATCH_TYPES)}",
            )
        if record.verb == "watch":
            assert raw is not None
            selector = _selector(params, path.name)
            return await self._watch(rt, namespace, selector, params, raw, record)
        if record.verb == "list":
            selector = _selector(params, None)
            limit = int(params["limit"]) if params.get("limit", "").isdigit() else None
            result = self.store.list_objects(rt, namespace, selector, limit, params.get("continue"))
            meta: dict[str, Any] = {"resourceVersion": result.resource_version}
            if result.continue_token:
                meta["continue"] = result.continue_token
            if result.remaining is not None:
                meta["remainingItemCount"] = result.remaining
            return aiohttp.web.json_response(
                {
                    "kind": rt.list_kind,
                    "apiVersion": rt.api_version,
                    "metadata": meta,
                    "items": result.items,
                }
            )
        if record.verb == "get":
            assert path.name is not None
            return aiohttp.web.json_response(self.store.get(rt, namespace, path.name))
        if record.verb == "create":
            if path.name is not None:
                raise ApiError(405, "MethodNotAllowed", "POST to a named resource is not served")
            body = _json_body(request.body)
            obj = self.store.create(rt, namespace, body, field_manager=manager, dry_run=dry_run)
            return aiohttp.web.json_response(obj, status=201)
        if record.verb == "update":
            assert path.name is not None
            body = _json_body(request.body)
            obj = self.store.update(
                rt,
                namespace,
                path.name,
                body,
                subresource=path.subresource,
                field_manager=manager,
                dry_run=dry_run,
            )
            return aiohttp.web.json_response(obj)
        if record.verb == "patch":
            assert path.name is not None
            patch_type = PATCH_TYPES.get(record.content_type or "")
            if patch_type is None:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - accepted media types "
                    f"include: {', '.join(PATCH_TYPES)}",
                )
            if patch_type == "apply":
                body = _yaml_body(request.body)
                manager = params.get("fieldManager")
            else:
                body = _json_body(request.body)
            obj, created = self.store.patch(
                rt,
                namespace,
                path.name,
                patch_type,
                body,
                subresource=path.subresource,
                field_manager=manager,
                force=params.get("force") == "true",
                dry_run=dry_run,
            )
            return aiohttp.web.json_response(obj, status=201 if created else 200)
        if record.verb == "delete":
            assert path.name is not None
            options = _json_body(request.body) if request.body.strip() else {}
            options = options if isinstance(options, dict) else {}
            policy = params.get("propagationPolicy") or options.get("propagationPolicy")
            orphan = params.get("orphanDependents") or options.get("orphanDependents")
            if policy is None and orphan in (True, "true"):
                policy = "Orphan"
            obj, deleted = self.store.delete(
                rt,
                namespace,
                path.name,
                propagation=policy,
                preconditions=options.get("preconditions"),
                dry_run=dry_run or options.get("dryRun") == ["All"],
            )
            if deleted and not rt.custom:
                details: dict[str, Any] = {
                    "name": path.name,
                    "kind": rt.plural,
                    "uid": obj["metadata"]["uid"],
                }
                if rt.group:
                    details["group"] = rt.group
                return aiohttp.web.json_response(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Success",
                        "details": details,
                    }
                )
            return aiohttp.web.json_response(obj)
        if record.verb == "deletecollection":
            selector = _selector(params, None)
            items = self.store.delete_collection(
                rt, namespace, selector, propagation=params.get("propagationPolicy")
            )
            return aiohttp.web.json_response(
                {
                    "kind": rt.list_kind,
                    "apiVersion": rt.api_version,
                    "metadata": {"resourceVersion": str(self.store.resource_version)},
                    "items": items,
                }
            )
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on {request.url.path}")

    async def _serve_scale(
        self,
        rt: ResourceType,
        path: ApiPath,
        record: RequestRecord,
        request: kmock.Request,
        manager: str | None,
    ) -> aiohttp.web.StreamResponse:
        assert path.name is not None
        namespace = path.namespace if rt.namespaced else None
        if record.verb == "get":
            return aiohttp.web.json_response(self.store.get_scale(rt, namespace, path.name))
        if record.verb in ("update", "patch"):
            patch_type = (
                None
                if record.verb == "update"
                else PATCH_TYPES.get(record.content_type or "", "merge")
            )
            body = _yaml_body(request.body) if patch_type == "apply" else _json_body(request.body)
            scale = self.store.write_scale(
                rt,
                namespace,
                path.name,
                None if patch_type == "apply" else patch_type,
                body,
                field_manager=manager,
            )
            return aiohttp.web.json_response(scale)
        raise ApiError(405, "MethodNotAllowed", f"{record.method} is not allowed on scale")

    async def _watch(
        self,
        rt: ResourceType,
        namespace: str | None,
        selector: Selector,
        params: Mapping[str, str],
        raw: aiohttp.web.BaseRequest,
        record: RequestRecord,
    ) -> aiohttp.web.StreamResponse:
        loop = asyncio.get_running_loop()
        since = params.get("resourceVersion")
        send_initial = params.get("sendInitialEvents") == "true"
        bookmarks = params.get("allowWatchBookmarks") == "true"
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        response = aiohttp.web.StreamResponse(
            status=200, headers={"Content-Type": "application/json"}
        )
        response.enable_chunked_encoding()
        try:
            initial, backlog, start_rv, sub = self.store.subscribe(
                rt, namespace, selector, None if send_initial else since, loop
            )
        except ApiError as exc:
            if exc.code != 410:
                raise
            await response.prepare(raw)
            record.status_code = 200
            await _write_event(response, {"type": "ERROR", "object": exc.status()})
            await response.write_eof()
            return response
        await response.prepare(raw)
        record.status_code = 200
        last_rv = start_rv
        deadline = loop.time() + timeout if timeout is not None else None
        try:
            for event in initial:
                await _write_event(response, _wire(rt, event.type, event.obj))
            if send_initial:
                await _write_event(response, _bookmark(rt, start_rv, initial_end=True))
            for event in backlog:
                last_rv = event.rv
                wire = _translate(rt, event, namespace, selector)
                if wire is not None:
                    await _write_event(response, wire)
            next_bookmark = loop.time() + self.bookmark_interval
            while True:
                now = loop.time()
                if deadline is not None and now >= deadline:
                    break
                wait = 1.0
                if deadline is not None:
                    wait = min(wait, deadline - now)
                if bookmarks:
                    wait = min(wait, max(0.0, next_bookmark - now))
                try:
                    event_or_none = await asyncio.wait_for(sub.queue.get(), timeout=wait)
                except TimeoutError:
                    if raw.transport is None or raw.transport.is_closing():
                        break
                    if bookmarks and loop.time() >= next_bookmark:
                        await _write_event(response, _bookmark(rt, last_rv))
                        next_bookmark = loop.time() + self.bookmark_interval
                    continue
                if event_or_none is None:
                    break
                if event_or_none.rv <= last_rv:
                    continue
                last_rv = event_or_none.rv
                wire = _translate(rt, event_or_none, namespace, selector)
                if wire is not None:
                    await _write_event(response, wire)
            await response.write_eof()
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.store.unsubscribe(sub)
        return response

    # ------------------------------------------------------------------ discovery

    def _discovery(self, path: str) -> dict[str, Any] | None:
        parts = [p for p in path.strip("/").split("/") if p]
        types = self.store.types()
        if parts == ["api"]:
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}
                ],
            }
        if len(parts) == 2 and parts[0] == "api":
            return self._resource_list("", parts[1], types)
        if parts == ["apis"]:
            groups = sorted({rt.group for rt in types if rt.group})
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [self._group(group, types) for group in groups],
            }
        if len(parts) == 2 and parts[0] == "apis":
            if not any(rt.group == parts[1] for rt in types):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return {"kind": "APIGroup", "apiVersion": "v1", **self._group(parts[1], types)}
        if len(parts) == 3 and parts[0] == "apis":
            return self._resource_list(parts[1], parts[2], types)
        return None

    def _group(self, group: str, types: Iterable[ResourceType]) -> dict[str, Any]:
        versions = sorted(
            {rt.version for rt in types if rt.group == group}, key=_version_priority, reverse=True
        )
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": entries, "preferredVersion": entries[0]}

    def _resource_list(
        self, group: str, version: str, types: Iterable[ResourceType]
    ) -> dict[str, Any]:
        selected = sorted(
            (rt for rt in types if rt.group == group and rt.version == version),
            key=lambda rt: rt.plural,
        )
        if not selected:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        resources: list[dict[str, Any]] = []
        for rt in selected:
            entry: dict[str, Any] = {
                "name": rt.plural,
                "singularName": rt.singular,
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": sorted(rt.verbs),
            }
            if rt.shortnames:
                entry["shortNames"] = list(rt.shortnames)
            if rt.categories:
                entry["categories"] = list(rt.categories)
            resources.append(entry)
            for sub in sorted(rt.subresources):
                resources.append(
                    {
                        "name": f"{rt.plural}/{sub}",
                        "singularName": "",
                        "namespaced": rt.namespaced,
                        "kind": rt.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }


def _manager_from_user_agent(user_agent: str | None) -> str:
    """The API server's default field manager: the user agent up to the first "/"."""
    return (user_agent or "unknown").split("/", 1)[0] or "unknown"


def _parsed_body(body: bytes, content_type: str) -> Any:
    if not body.strip():
        return None
    try:
        if content_type.startswith("application/apply-patch+yaml"):
            return yaml.safe_load(body.decode("utf-8"))
        return json.loads(body)
    except (ValueError, yaml.YAMLError, UnicodeDecodeError):
        return None


def _selector(params: Mapping[str, str], name: str | None) -> Selector:
    field_selector = params.get("fieldSelector") or ""
    if name:
        field_selector = ",".join(filter(None, [field_selector, f"metadata.name={name}"]))
    try:
        return Selector.parse(params.get("labelSelector"), field_selector)
    except SelectorError as exc:
        raise errors.bad_request(f"unable to parse selector: {exc}") from exc


def _json_body(body: bytes) -> Any:
    if not body.strip():
        raise errors.bad_request("the request body is empty")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise errors.bad_request(f"the request body is not valid JSON: {exc}") from exc


def _yaml_body(body: bytes) -> Any:
    try:
        return yaml.safe_load(body.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise errors.bad_request(f"the apply body is not valid YAML: {exc}") from exc


def _wire(rt: ResourceType, type_: str, obj: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": type_, "object": {**obj, "apiVersion": rt.api_version}}


def _bookmark(rt: ResourceType, rv: int, initial_end: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if initial_end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    return {
        "type": "BOOKMARK",
        "object": {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta},
    }


def _translate(
    rt: ResourceType, event: StoredEvent, namespace: str | None, selector: Selector
) -> dict[str, Any] | None:
    """The event this watcher sees: objects entering or leaving a selector are ADDED/DELETED."""
    if namespace is not None and event.namespace != namespace:
        return None
    now_in = selector.matches(event.obj)
    was_in = event.old is not None and selector.matches(event.old)
    if event.type == "ADDED":
        return _wire(rt, "ADDED", event.obj) if now_in else None
    if event.type == "DELETED":
        return _wire(rt, "DELETED", event.obj) if (now_in or was_in) else None
    if now_in and was_in:
        return _wire(rt, "MODIFIED", event.obj)
    if now_in:
        return _wire(rt, "ADDED", event.obj)
    if was_in:
        return _wire(rt, "DELETED", event.obj)
    return None


async def _write_event(response: aiohttp.web.StreamResponse, event: Mapping[str, Any]) -> None:
    await response.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")


__all__ = [
    "ApiPath",
    "Fault",
    "KubernetesAPIEmulator",
    "RequestRecord",
    "parse_api_path",
]
