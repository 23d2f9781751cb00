"""The Service proxy counts the requests the Service failed, and only those: a client that
closes its connection after the last event of a stream is no failure (at 40 requests/s the
demo counted hundreds of those as failed requests), a pod that dies mid-stream is one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from vllm_localcluster.service_proxy import ServiceProxy

CHUNKS = 20


async def _stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    await response.prepare(request)
    for i in range(CHUNKS):
        await response.write(f"data: {i}\n\n".encode())
        await asyncio.sleep(0.001)
    if request.query.get("die"):
        assert request.transport is not None
        request.transport.abort()  # the pod goes away mid-stream
        return response
    await response.write(b"data: [DONE]\n\n")
    await asyncio.sleep(0.2)  # the client has what it needs before the stream ends
    await response.write_eof()
    return response


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/stream", _stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _read_until_done(url: str) -> None:
    """Read the stream up to [DONE] and close the connection, as vllm-sim's load client does."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        async for line in response.content:
            if line.strip() == b"data: [DONE]":
                break
        response.close()


async def _read_all(url: str) -> bool:
    async with aiohttp.ClientSession() as session:
        try:
            async with session.get(url) as response:
                await response.read()
                return True
        except aiohttp.ClientError:
            return False


async def test_a_client_closing_after_the_last_event_is_not_a_failure(upstream: str) -> None:
    proxy = ServiceProxy(lambda: [("pod", upstream)])
    await proxy.start()
    try:
        await asyncio.gather(*(_read_until_done(proxy.url + "/stream") for _ in range(10)))
        await asyncio.sleep(0.5)  # the proxy's writes after the client left have happened
        assert proxy.requests == 10
        assert proxy.refused == 0
    finally:
        await proxy.aclose()


async def test_a_pod_dying_mid_stream_is_a_failure(upstream: str) -> None:
    proxy = ServiceProxy(lambda: [("pod", upstream)])
    await proxy.start()
    try:
        ok = await _read_all(proxy.url + "/stream?die=1")
        assert not ok  # the client saw the stream cut short
        assert proxy.refused == 1
    finally:
        await proxy.aclose()


async def test_no_endpoint_is_a_failure() -> None:
    proxy = ServiceProxy(lambda: [])
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as session, session.get(proxy.url + "/x") as r:
            assert r.status == 503
        assert proxy.refused == 1
    finally:
        await proxy.aclose()
