"""A fault-injecting proxy in front of the real API server, for the reliability tests and the soak.

kube-apiserver cannot be made to fail on cue, so this proxy stands between it and the client
under test (the operator): every request is forwarded unchanged (the client's own bearer token
included, so the API server still authenticates and authorises it, and its audit log names the
client), and recorded; a test injects faults that match requests by verb, resource, user agent
or any predicate: an error status (409, 500, 503...), a delay before forwarding (the answer
comes after the client gave up, but the write lands), cut watch streams, and the 410 Gone that
a watch resuming from a compacted resourceVersion receives (the ERROR event kube-apiserver
sends, with reason Expired), and watch events that arrive garbled (`corrupt_watch_events`: the
line of each chosen event is replaced, by default by a line cut short, as a proxy that drops a
connection mid-line would leave it; every other event of the stream passes unchanged).

The client talks plain HTTP to 127.0.0.1; the proxy talks HTTPS to the API server, trusting
its CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import aiohttp
from aiohttp import web

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


@dataclass
class RequestRecord:
    """One request as the proxy saw it, in the API server's vocabulary (verb, resource...)."""

    method: str
    path: str
    params: dict[str, str]
    verb: str
    group: str
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    user_agent: str | None
    content_type: str | None
    body: Any
    time: float = field(default_factory=time.time)
    status_code: int | None = None


def parse_request(method: str, path: str, query: str, headers: Mapping[str, str],
                  raw: bytes) -> RequestRecord:  # fmt: skip
    """Name a request the way the API server's RequestInfo does."""
    params = dict(parse_qsl(query))
    parts = [p for p in path.split("/") if p]
    group, rest = "", parts
    if parts[:1] == ["api"]:
        rest = parts[2:]
    elif parts[:1] == ["apis"]:
        group, rest = (parts[1] if len(parts) > 1 else ""), parts[3:]
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    resource = rest[0] if rest else None
    name = rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else None
    if resource == "namespaces" and namespace is None and name is not None:
        namespace = name
    verb = {
        "GET": "get",
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete",
    }.get(method, method.lower())
    if method == "GET" and name is None:
        verb = "watch" if params.get("watch") in ("1", "true") else "list"
    if method == "DELETE" and name is None:
        verb = "deletecollection"
    body: Any = None
    if raw:
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode(errors="replace")
    return RequestRecord(
        method=method,
        path=path,
        params=params,
        verb=verb,
        group=group,
        resource=resource,
        subresource=subresource,
        namespace=namespace,
        name=name,
        user_agent=headers.get("User-Agent"),
        content_type=headers.get("Content-Type"),
        body=body,
    )


Matcher = Callable[[RequestRecord], bool] | Mapping[str, Any]


def matches(match: Matcher, record: RequestRecord) -> bool:
    if callable(match):
        return bool(match(record))
    for key, wanted in match.items():
        value = getattr(record, key)
        if isinstance(wanted, (set, frozenset, list, tuple)):
            if value not in wanted:
                return False
        elif value != wanted:
            return False
    return True


@dataclass
class Fault:
    """`status` None with a `delay`: forward late. `times` None: for ever."""

    match: Matcher
    status: int | None
    times: int | None
    delay: float = 0.0
    message: str = "injected fault"
    hits: int = 0

    def take(self, record: RequestRecord) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if not matches(self.match, record):
            return False
        self.hits += 1
        return True


CUT_LINE = b'{"type":"ADDED","object":{"metadata":{"name":"poi'
"""A watch event line cut short: not JSON."""


@dataclass
class WatchCorruption:
    """Watch events on `resource` whose event (type and object) `select` picks reach the client
    as `line` instead; `times` None: for ever. `hits` counts the events replaced."""

    resource: str
    select: Callable[[Mapping[str, Any]], bool]
    line: bytes = CUT_LINE
    times: int | None = None
    hits: int = 0

    def rewrite(self, event: Mapping[str, Any]) -> bytes | None:
        if self.times is not None and self.hits >= self.times:
            return None
        if not self.select(event):
            return None
        self.hits += 1
        return self.line


def event_named(name: str) -> Callable[[Mapping[str, Any]], bool]:
    """Selects the watch events about the object called `name`."""

    def select(event: Mapping[str, Any]) -> bool:
        obj = event.get("object")
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        return isinstance(meta, Mapping) and meta.get("name") == name

    return select


def status_body(code: int, message: str, reason: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip


REASONS = {409: "Conflict", 500: "InternalError", 503: "ServiceUnavailable", 429: "TooManyRequests"}


class FaultProxy:
    """Start with `start_in_thread()`, point the client at `url`, `stop()` at the end."""

    def __init__(self, upstream: str, ca_file: str, token: str | None = None) -> None:
        """`token`: sent for clients that send none (the operator under test, configured with
        the proxy's plain URL only); a client's own Authorization header always wins."""
        self.upstream = upstream.rstrip("/")
        self.ca_file = ca_file
        self.token = token
        self.port = 0
        self.requests: list[RequestRecord] = []
        self._faults: list[Fault] = []
        self._corruptions: list[WatchCorruption] = []
        self._lock = threading.Lock()
        self._expired_before: int | None = None
        self._watches: set[web.StreamResponse] = set()
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ faults

    def inject(
        self,
        match: Matcher,
        *,
        status: int | None,
        times: int | None = 1,
        delay: float = 0.0,
        message: str = "injected fault",
    ) -> Fault:
        fault = Fault(match, status, times, delay, message)
        with self._lock:
            self._faults.append(fault)
        return fault

    def corrupt_watch_events(
        self,
        resource: str,
        select: Callable[[Mapping[str, Any]], bool],
        *,
        line: bytes = CUT_LINE,
        times: int | None = None,
    ) -> WatchCorruption:
        """Watch events on `resource` that `select` picks arrive as `line`, in the watches
        opened from now on (a stream already open is relayed as it began)."""
        corruption = WatchCorruption(resource, select, line, times)
        with self._lock:
            self._corruptions.append(corruption)
        return corruption

    def clear_faults(self) -> None:
        """Drop the injected faults and watch corruptions (an expiry set by
        `expire_watches_before` stays: a compacted history does not come back)."""
        with self._lock:
            self._faults.clear()
            self._corruptions.clear()

    def expire_watches_before(self, resource_version: int) -> None:
        """Watches resuming from an older resourceVersion get 410 Gone, as after compaction."""
        with self._lock:
            self._expired_before = resource_version

    def close_watches(self) -> None:
        """Cut every watch stream in flight (the client sees its connection end)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._close_watches(), loop).result(10)

    async def _close_watches(self) -> None:
        for response in list(self._watches):
            transport = response._req.transport if response._req is not None else None
            if transport is not None:
                transport.close()

    def requests_matching(self, **criteria: Any) -> list[RequestRecord]:
        with self._lock:
            recorded = list(self.requests)
        return [r for r in recorded if matches(criteria, r)]

    def clear_requests(self) -> None:
        with self._lock:
            self.requests.clear()

    # ------------------------------------------------------------------ forwarding

    def _fault_for(self, record: RequestRecord) -> Fault | None:
        with self._lock:
            self.requests.append(record)
            for fault in self._faults:
                if fault.take(record):
                    return fault
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        record = parse_request(request.method, request.path, request.query_string,
                               request.headers, raw)  # fmt: skip
        fault = self._fault_for(record)
        if fault is not None:
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.status is not None:
                record.status_code = fault.status
                reason = REASONS.get(fault.status, "InternalError")
                body = status_body(fault.status, fault.message, reason)
                return web.json_response(body, status=fault.status)
        expired = self._expired_before
        resumed_from = record.params.get("resourceVersion", "")
        if (
            record.verb == "watch"
            and expired is not None
            and resumed_from.isdigit()
            and 0 < int(resumed_from) < expired
        ):
            record.status_code = 200
            message = f"too old resource version: {resumed_from} ({expired})"
            event = {"type": "ERROR", "object": status_body(410, message, "Expired")}
            return web.Response(text=json.dumps(event) + "\n", content_type="application/json")
        return await self._forward(request, record, raw)

    def _corruptions_for(self, record: RequestRecord) -> list[WatchCorruption]:
        if record.verb != "watch":
            return []
        with self._lock:
            return [c for c in self._corruptions if c.resource == record.resource]

    def _rewrite(self, line: bytes, corruptions: list[WatchCorruption]) -> bytes:
        """The line to send for one upstream watch event line (without its newline)."""
        try:
            event = json.loads(line)
        except ValueError:
            return line
        if not isinstance(event, Mapping):
            return line
        with self._lock:
            for corruption in corruptions:
                replaced = corruption.rewrite(event)
                if replaced is not None:
                    return replaced
        return line

    async def _relay(
        self,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        corruptions: list[WatchCorruption],
    ) -> None:
        """Copy the body; a corrupted watch is cut into event lines, each rewritten or not."""
        if not corruptions:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            return
        pending = b""
        async for chunk in upstream.content.iter_any():
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                await response.write(self._rewrite(line, corruptions) + b"\n")
        if pending:
            await response.write(pending)

    async def _forward(
        self, request: web.Request, record: RequestRecord, raw: bytes
    ) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        if self.token is not None and "Authorization" not in request.headers:
            headers["Authorization"] = f"Bearer {self.token}"
        corruptions = self._corruptions_for(record)
        if corruptions:  # the events are read as text lines: no compressed stream
            headers = {k: v for k, v in headers.items() if k.lower() != "accept-encoding"}
            headers["Accept-Encoding"] = "identity"
        url = self.upstream + request.rel_url.path_qs
        try:
            async with self._session.request(
                request.method, url, data=raw or None, headers=headers
            ) as upstream:
                record.status_code = upstream.status
                response = web.StreamResponse(status=upstream.status)
                for key, value in upstream.headers.items():
                    if key.lower() not in _HOP_BY_HOP:
                        response.headers[key] = value
                await response.prepare(request)
                if record.verb == "watch":
                    self._watches.add(response)
                try:
                    await self._relay(upstream, response, corruptions)
                    await response.write_eof()
                finally:
                    self._watches.discard(response)
                return response
        except (aiohttp.ClientError, ConnectionResetError):
            record.status_code = 503
            return web.json_response(
                status_body(503, "the API server is unreachable", "ServiceUnavailable"),
                status=503,
            )

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> None:
        context = ssl.create_default_context(cafile=self.ca_file)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(ssl=context, limit=64),
            auto_decompress=False,
        )
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # Handlers still streaming a watch at shutdown are cut after 1 s (aiohttp waits 60 s).
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    def start_in_thread(self, timeout: float = 10.0) -> FaultProxy:
        def main() -> None:
            async def body() -> None:
                self._loop = asyncio.get_running_loop()
                self._stop = asyncio.Event()
                await self._start()
                self._ready.set()
                await self._stop.wait()
                # Upstream first: open watches end at once instead of holding the server's
                # graceful shutdown until their next event.
                if self._session is not None:
                    await self._session.close()
                await self._close_watches()
                if self._runner is not None:
                    await self._runner.cleanup()

            asyncio.run(body())

        self._thread = threading.Thread(target=main, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the fault proxy did not start")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
