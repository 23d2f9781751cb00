"""A Service for the one-machine cluster: one stable URL in front of a Deployment's ready pods.

In a cluster, kube-proxy sends each connection to one of the Service's ready endpoints, so
clients keep working while a rollout replaces pods. The demo's load generator needs the same:
this proxy forwards each HTTP request (streaming responses included) to a ready pod, round
robin, and answers 503 while there is none, as a Service without endpoints would refuse.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable

import aiohttp
from aiohttp import web

Endpoints = Callable[[], list[tuple[str, str]]]  # (pod, base URL) of ready pods

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


class ServiceProxy:
    def __init__(self, endpoints: Endpoints, host: str = "127.0.0.1", port: int = 0) -> None:
        self.endpoints = endpoints
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
        self.refused = 0

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
        try:
            async with self._session.request(
                request.method, target + request.rel_url.path_qs, data=body, headers=headers
            ) as upstream:
                response = web.StreamResponse(status=upstream.status)
                for key, value in upstream.headers.items():
                    if key.lower() not in _HOP_BY_HOP:
                        response.headers[key] = value
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, ConnectionResetError):
            # The pod went away mid-request (a rollout stopped it): the client sees the
            # connection end, as it would through kube-proxy.
            self.refused += 1
            return web.json_response({"error": "upstream connection failed"}, status=502)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._runner = web.AppRunner(app, handle_signals=False)
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
                self._ready.set()
                await self._stop.wait()
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
