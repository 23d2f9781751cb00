"""A Service for the one-machine cluster: one stable URL in front of a Service's ready pods.

In a cluster, kube-proxy sends each connection to one of the Service's ready endpoints, read
from the EndpointSlices the EndpointSlice controller maintains, so clients keep working while a
rollout replaces pods. The demo's load generator needs the same: this proxy reads the real
EndpointSlices of one Service (every 0.2 s), and forwards each HTTP request (streaming
responses included) to a ready endpoint, round robin. As kube-proxy does: a terminating pod's
endpoint is not ready from the moment of its deletion, so it gets no new requests; when no
endpoint is ready, the terminating ones that still serve are used (ProxyTerminatingEndpoints,
GA in 1.28); with none at all it answers 503, as a Service without endpoints refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from vllm_localcluster.kubeapi import AsyncApi, Endpoint
from vllm_localcluster.node.container import loopback_of

Endpoints = Callable[[], list[tuple[str, str]]]  # (pod, base URL) of ready pods
REFRESH_S = 0.2


def routable(slices: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(pod, base URL) of the endpoints kube-proxy would send new connections to."""
    ready: list[tuple[str, str]] = []
    serving_terminating: list[tuple[str, str]] = []
    for item in slices:
        ports = item.get("ports") or []
        if not ports or ports[0].get("port") is None:
            continue
        port = int(ports[0]["port"])
        for endpoint in item.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            pod = str((endpoint.get("targetRef") or {}).get("name", ""))
            for address in endpoint.get("addresses") or []:
                url = f"http://{loopback_of(address)}:{port}"
                if conditions.get("ready") is not False:  # unset means ready (API docs)
                    ready.append((pod, url))
                elif conditions.get("serving") and conditions.get("terminating"):
                    serving_terminating.append((pod, url))
    return sorted(ready or serving_terminating)


class EndpointSliceReader:
    """The routable endpoints of one Service, refreshed from the API in the proxy's loop."""

    def __init__(self, api: Endpoint, namespace: str, service: str) -> None:
        self.api = api
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self.selector = f"kubernetes.io/service-name={service}"
        self.current: list[tuple[str, str]] = []

    def __call__(self) -> list[tuple[str, str]]:
        return list(self.current)

    async def run(self, stop: asyncio.Event) -> None:
        client = AsyncApi(self.api, timeout_s=5.0)
        try:
            while not stop.is_set():
                with contextlib.suppress(Exception):  # the API may be away for a moment
                    slices = await client.list(self.path, labelSelector=self.selector)
                    self.current = routable(slices)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), REFRESH_S)
        finally:
            await client.close()


_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


class _ClientGone(Exception):
    """Writing to the client failed: it closed the connection."""


async def _to_client(write: Awaitable[object]) -> None:
    try:
        await write
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError included
        raise _ClientGone from exc


class ServiceProxy:
    """Forwards to `endpoints()`; `for_service` reads them from a Service's EndpointSlices."""

    def __init__(self, endpoints: Endpoints, host: str = "127.0.0.1", port: int = 0) -> None:
        self.endpoints = endpoints
        self._reader = endpoints if isinstance(endpoints, EndpointSliceReader) else None
        self.host = host
        self.port = port
        self._counter = itertools.count()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.requests = 0
        # Requests the Service failed: no ready endpoint, or the pod failed them mid-request
        # (not the client closing its own connection, which is no failure of the Service).
        self.refused = 0

    @classmethod
    def for_service(
        cls, api: Endpoint, namespace: str, service: str, port: int = 0
    ) -> ServiceProxy:
        return cls(EndpointSliceReader(api, namespace, service), port=port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _pick(self) -> str | None:
        ready = sorted(self.endpoints())
        if not ready:
            return None
        return ready[next(self._counter) % len(ready)][1]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        target = self._pick()
        self.requests += 1
        if target is None or self._session is None:
            self.refused += 1
            return web.json_response({"error": "no ready endpoints for this Service"}, status=503)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        response: web.StreamResponse | None = None
        try:
            async with self._session.request(
                request.method, target + request.rel_url.path_qs, data=body, headers=headers
            ) as upstream:
                response = web.StreamResponse(status=upstream.status)
                for key, value in upstream.headers.items():
                    if key.lower() not in _HOP_BY_HOP:
                        response.headers[key] = value
                await _to_client(response.prepare(request))
                async for chunk in upstream.content.iter_any():
                    await _to_client(response.write(chunk))
                await _to_client(response.write_eof())
                return response
        except _ClientGone:
            # The client closed its side first (e.g. right after the last event of a stream):
            # nothing failed on the Service's side, and nobody is left to answer.
            return response or web.Response(status=499)
        except (aiohttp.ClientError, ConnectionResetError):
            # The pod went away mid-request (a rollout stopped it): the client sees the
            # connection end, as it would through kube-proxy.
            self.refused += 1
            if response is not None:
                # Headers are sent: cut the client's connection, so that it sees the stream
                # end early instead of a well-formed, truncated response.
                if request.transport is not None:
                    request.transport.abort()
                return response
            return web.json_response({"error": "upstream connection failed"}, status=502)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def start_in_thread(self, timeout: float = 10.0) -> ServiceProxy:
        def main() -> None:
            async def body() -> None:
                self._loop = asyncio.get_running_loop()
                self._stop = asyncio.Event()
                await self.start()
                reader = None
                if self._reader is not None:
                    reader = asyncio.create_task(self._reader.run(self._stop))
                self._ready.set()
                await self._stop.wait()
                if reader is not None:
                    await reader
                await self.aclose()

            asyncio.run(body())

        self._thread = threading.Thread(target=main, name="service-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the service proxy did not start")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
