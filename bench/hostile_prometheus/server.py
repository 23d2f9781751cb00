"""A Prometheus on 127.0.0.1 that answers every query with one chosen body (benchmark, tests)."""

from __future__ import annotations

import asyncio
import threading

from bench.hostile_prometheus.answers import Answer

NAMES = [
    "vllm:request_success_total",
    "vllm:num_requests_running",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
]


class Server:
    """aiohttp on 127.0.0.1 in a thread; `answer` is what every query gets."""

    def __init__(self) -> None:
        self.answer = Answer(b"{}")
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def start(self) -> Server:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the hostile server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        from aiohttp import web

        async def names(_: web.Request) -> web.Response:
            return web.json_response({"status": "success", "data": NAMES})

        async def query(request: web.Request) -> web.StreamResponse:
            await request.read()
            answer = self.answer
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            if answer.encoding:
                response.headers["Content-Encoding"] = answer.encoding
            if answer.chunked:
                response.enable_chunked_encoding()
            else:
                response.content_length = len(answer.body)
            await response.prepare(request)
            try:
                if answer.drip_bytes_per_s:
                    for i in range(0, len(answer.body), 20):
                        await response.write(answer.body[i : i + 20])
                        await asyncio.sleep(20 / answer.drip_bytes_per_s)
                else:
                    step = 1024 * 1024
                    for i in range(0, len(answer.body), step):
                        await response.write(answer.body[i : i + step])
            except (ConnectionError, RuntimeError):
                pass  # the operator hung up: what it should do with a hostile answer
            return response

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/api/v1/label/{name}/values", names)
        app.router.add_post("/api/v1/label/{name}/values", names)
        app.router.add_post("/api/v1/query", query)
        app.router.add_get("/api/v1/query", query)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
