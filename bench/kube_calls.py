"""The cost of one operator API call through the kubernetes package: its synchronous ApiClient
in our bounded thread pool (what `adapters/kube.py` does) against its asyncio port
(`kubernetes.aio`, the former kubernetes_asyncio) on the event loop.

A local aiohttp server answers every server-side apply with a Deployment-sized JSON body
(16 KiB, what the API server returns); each client sends `--calls` applies, `--concurrency` at
a time, and the script prints wall time, process CPU and resident memory growth per client.

    python -m bench.kube_calls [--calls 2000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from vllm_autotuner.adapters.kube import KubeClient, KubeCredentials

BODY = json.dumps(
    {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llm", "namespace": "team-a", "resourceVersion": "1"},
        "spec": {"template": {"spec": {"containers": [{"args": ["x" * 64] * 200}]}}},
    }
).encode()
MANIFEST: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "llm", "namespace": "team-a"},
    "spec": {"replicas": 1},
}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


async def serve() -> tuple[web.AppRunner, str]:
    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=BODY, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def measure(
    name: str, call: Callable[[], Awaitable[Any]], calls: int, concurrency: int
) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await call()

    before_rss, cpu0, wall0 = rss_mib(), time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    print(
        f"{name:<34} {calls / wall:7.0f} calls/s  {1e6 * cpu / calls:6.0f} us CPU/call  "
        f"RSS +{rss_mib() - before_rss:5.1f} MiB"
    )


async def threaded(url: str, calls: int, concurrency: int) -> None:
    client = KubeClient(KubeCredentials.for_server(url, token="t"), concurrency=concurrency)
    try:
        await measure("sync ApiClient, thread pool", lambda: client.apply(MANIFEST), calls,
                      concurrency)  # fmt: skip
    finally:
        await client.close()


async def asyncio_port(url: str, calls: int, concurrency: int) -> None:
    from kubernetes.aio.client import ApiClient, Configuration

    config = Configuration(host=url)
    config.api_key["BearerToken"] = "Bearer t"
    async with ApiClient(config) as api:

        async def apply() -> Any:
            method, full, headers, body, _ = await api.param_serialize(
                method="PATCH",
                resource_path="/apis/apps/v1/namespaces/team-a/deployments/llm",
                query_params=[("fieldManager", "vllm-autotuner"), ("force", "true")],
                header_params={"Content-Type": "application/apply-patch+yaml"},
                body=MANIFEST,
                auth_settings=["BearerToken"],
            )
            response = await api.call_api(method, full, header_params=headers, body=body)
            return json.loads(await response.read())

        await measure("kubernetes.aio ApiClient, event loop", apply, calls, concurrency)


async def main(calls: int, concurrency: int) -> None:
    runner, url = await serve()
    try:
        await threaded(url, calls // 10, concurrency)  # warm-up: imports, pools
        await asyncio_port(url, calls // 10, concurrency)
        await threaded(url, calls, concurrency)
        await asyncio_port(url, calls, concurrency)
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.kube_calls", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000, help="applies per client")
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight at once")
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.concurrency))
