"""Decisions (calibration and search: CPU-bound Python) run one at a time on the controller's
own thread: never on the event loop, and never beside each other on the loop's default
executor, where a burst of first searches held the GIL against the loop and queued the
Prometheus reads behind them (docs/scale.md)."""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any, cast

import pytest

from tests.support.cluster_api import CR
from tests.unit.controller.test_stale_body import ApiServerKube, _reconcile
from vllm_autotuner import controller as controller_module
from vllm_autotuner.adapters.kube import KubeClient
from vllm_autotuner.controller import Controller


async def test_decisions_run_one_at_a_time_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = controller_module.decide
    first_inside, release = threading.Event(), threading.Event()
    guard = threading.Lock()
    threads: list[str] = []
    in_flight, peak = 0, 0

    def recording(*args: Any, **kwargs: Any) -> Any:
        nonlocal in_flight, peak
        with guard:
            in_flight += 1
            peak = max(peak, in_flight)
            threads.append(threading.current_thread().name)
        try:
            first_inside.set()
            assert release.wait(timeout=30), "the test never released the decision"
            return real(*args, **kwargs)
        finally:
            with guard:
                in_flight -= 1

    monkeypatch.setattr(controller_module, "decide", recording)
    controller = Controller(cast(KubeClient, ApiServerKube(CR)))
    bodies = []
    for i in range(4):
        body = copy.deepcopy(CR)
        body["metadata"].update(name=f"chat-{i}", namespace="default", uid=f"u-{i}")
        bodies.append(body)
    tasks = [asyncio.create_task(_reconcile(controller, b)) for b in bodies]
    # The loop keeps running while a decision blocks: this coroutine gets to wait for it.
    assert await asyncio.to_thread(first_inside.wait, 30)
    await asyncio.sleep(0.05)  # room for more decisions to start, were they allowed to
    assert in_flight == 1
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    controller.close()
    assert len(threads) == 4
    assert peak == 1
    assert all(name.startswith("decide") for name in threads), threads
