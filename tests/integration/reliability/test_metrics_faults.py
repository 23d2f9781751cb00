"""Prometheus misbehaves: down, slow, partial, NaN, counters reset — no change on bad data.

The operator must hold the knobs while the metrics cannot be trusted, say why in the
MetricsAvailable condition, and resume tuning by itself once they can (no restart).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import aiohttp.web
import pytest

from tests.support.cluster_api import CR_PATH, NS, Api, ApiServer
from tests.support.fake_fleet import FakeKubelet
from tests.support.faults import (
    START,
    FaultySnapshots,
    cond,
    cond_when,
    cr_with_mode,
    events,
    fast_policy,
    live_knobs,
    operator,
    operator_config,
    template_history,
    trials_of,
    tuning_of,
    wait_some,
)
from tests.support.waiting import wait_for
from vllm_localcluster.faults import FaultProxy

# What MetricsAvailable's message must mention for each kind of bad data.
EXPECTED_REASON = {
    "down": "ConnectionRefusedError",
    "unavailable": "503",
    "partial": "partial data",
    "nan": "rate=nan",
    "reset": "rate=-",
}


@pytest.mark.parametrize("mode", sorted(EXPECTED_REASON))
def test_bad_metrics_change_nothing_and_tuning_resumes_without_a_restart(
    apiserver: ApiServer, proxy: FaultProxy, api: Api, mode: str
) -> None:
    api.create("/apis/vllm.autotuner.io/v1alpha1/vllmtuningpolicies", fast_policy())
    api.create(CR_PATH, cr_with_mode("Auto"))
    metrics = FaultySnapshots(mode=mode)
    with FakeKubelet(apiserver, NS), operator(operator_config(proxy), metrics):
        # Several cycles of bad data reach the operator (the SLO is missed all along, so
        # good data would have started a rollout at once).
        wait_for(lambda: metrics.served.count(mode) >= 4, 20, message=f"{mode} cycles served")
        wait_some(
            cond_when(api, "MetricsAvailable", "False", EXPECTED_REASON[mode]),
            10,
            f"MetricsAvailable=False saying {EXPECTED_REASON[mode]!r}",
        )
        wait_for(lambda: metrics.served.count(mode) >= 6, 20, message="more bad cycles")
        assert live_knobs(api) == START
        assert template_history(proxy) == [START]
        assert trials_of(api) == []
        assert tuning_of(api).get("phase") not in ("RollingOut", "Verifying")

        metrics.mode = "ok"
        wait_for(
            lambda: cond(api, "MetricsAvailable").get("status") == "True",
            20,
            message="MetricsAvailable=True after recovery",
        )
        # The recovery is announced (the first bad window was not a loss: nothing was seen yet).
        wait_for(lambda: events(api, "MetricsRecovered"), 10, message="a MetricsRecovered Event")
        wait_for(lambda: trials_of(api), 20, message="tuning resumed: a trial started")
        wait_for(lambda: live_knobs(api) != START, 20, message="the candidate rolled out")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SilentServer:
    """An HTTP server on 127.0.0.1 that accepts requests and never answers them."""

    def __init__(self) -> None:
        self.port = 0
        self.requests = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._release = asyncio.Event()
        self._thread = threading.Thread(target=self._main, name="silent-prom", daemon=True)

    async def _hang(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.requests += 1
        await self._release.wait()
        return aiohttp.web.Response(status=503)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = aiohttp.web.Application()
        app.router.add_route("*", "/{tail:.*}", self._hang)
        runner = aiohttp.web.AppRunner(app, shutdown_timeout=0.5)
        self._loop.run_until_complete(runner.setup())
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = int(runner.addresses[0][1])
        self._ready.set()
        self._loop.run_until_complete(self._release.wait())
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def __enter__(self) -> SilentServer:
        self._thread.start()
        assert self._ready.wait(10), "silent server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._release.set)
        self._thread.join(10)


@pytest.fixture
def silent_prometheus() -> Iterator[SilentServer]:
    with SilentServer() as server:
        yield server


@pytest.mark.parametrize("kind", ["down", "slow"])
def test_real_prometheus_source_down_or_slow_holds_and_says_why(
    apiserver: ApiServer, proxy: FaultProxy, api: Api, silent_prometheus: SilentServer, kind: str
) -> None:
    port = _closed_port() if kind == "down" else silent_prometheus.port
    config = operator_config(
        proxy,
        interval_s=0.5,
        prometheus_url=f"http://127.0.0.1:{port}",
        prometheus_timeout_s=0.5,
        prometheus_min_window_s=1.0,
    )
    api.create("/apis/vllm.autotuner.io/v1alpha1/vllmtuningpolicies", fast_policy())
    api.create(CR_PATH, cr_with_mode("Auto"))
    with FakeKubelet(apiserver, NS), operator(config):
        # The first cycles wait for the pods' window; then the queries fail and say so.
        available = wait_some(
            cond_when(api, "MetricsAvailable", "False", "prometheus"),
            20,
            "MetricsAvailable=False with Prometheus' failure",
        )
        if kind == "slow":
            assert silent_prometheus.requests >= 1
            assert "time" in available["message"].lower(), available
        # Still reconciling (the timeout does not block the loop) and nothing changed.
        wait_for(
            lambda: (tuning_of(api).get("lastDecision") or {}).get("action") == "hold",
            10,
            message="a hold decision",
        )
        assert live_knobs(api) == START
        assert trials_of(api) == []
