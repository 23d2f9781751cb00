"""Decisions (calibration and search: CPU-bound Python) run one at a time on the controller's
own thread: never on the event loop, and never beside each other on the loop's default
executor, where a burst of first searches held the GIL against the loop and queued the
Prometheus reads behind them (docs/scale.md)."""

from __future__ import annotations

import asyncio
import copy
import threading
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tests.support.cluster_api import CR
from tests.unit.controller.test_stale_body import ApiServerKube, _reconcile
from tests.unit.core.test_decide import make_policy
from vllm_autotuner import controller as controller_module
from vllm_autotuner.adapters.kube import KubeClient
from vllm_autotuner.controller import Controller, reuses
from vllm_autotuner.core.search_memo import SearchMemo


def _body(i: int) -> dict[str, Any]:
    body = copy.deepcopy(dict(CR))
    body["metadata"] = {**body["metadata"], "name": f"chat-{i}", "namespace": "default",
                        "uid": f"u-{i}"}  # fmt: skip
    return body


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
    bodies = [_body(i) for i in range(4)]
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
    assert all(name.startswith("decide_") for name in threads), threads


NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
POLICY_5M = make_policy("Auto", evaluation_window_s=300.0)


def _memo_at(age_s: float) -> SearchMemo:
    """A memo whose only field the lane choice reads is its time."""
    return cast(SearchMemo, SimpleNamespace(time=NOW - timedelta(seconds=age_s)))


@pytest.mark.parametrize(
    ("age_s", "lane"),
    [(None, "search"), (0.0, "reuse"), (299.0, "reuse"), (300.0, "search"), (-5.0, "search")],
)
def test_a_young_memo_takes_the_reuse_lane(age_s: float | None, lane: str) -> None:
    memo = None if age_s is None else _memo_at(age_s)
    assert ("reuse" if reuses(memo, NOW, POLICY_5M) else "search") == lane


async def test_a_decision_that_reuses_its_search_does_not_wait_behind_a_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One deployment's first search blocks its lane; another, with a memo a minute old,
    decides on the reuse lane meanwhile."""
    real = controller_module.decide
    searching, release = threading.Event(), threading.Event()
    threads: dict[str, str] = {}

    def recording(*args: Any, **kwargs: Any) -> Any:
        state_name = "memo" if args[-1] is not None else "first"
        threads[state_name] = threading.current_thread().name
        if state_name == "first":
            searching.set()
            assert release.wait(timeout=30), "the test never released the search"
        return real(*args, **kwargs)

    monkeypatch.setattr(controller_module, "decide", recording)
    clock = NOW
    controller = Controller(cast(KubeClient, ApiServerKube(CR)), clock=lambda: clock)
    first, second = (_body(i) for i in range(2))
    controller._searches[("default", second["metadata"]["name"])] = _memo_at(60.0)
    blocked = asyncio.create_task(_reconcile(controller, first))
    assert await asyncio.to_thread(searching.wait, 30)
    await asyncio.wait_for(_reconcile(controller, second), timeout=30)
    assert not blocked.done()
    release.set()
    await asyncio.wait_for(blocked, timeout=30)
    controller.close()
    assert threads["first"].startswith("decide_")
    assert threads["memo"].startswith("decide-reuse")
