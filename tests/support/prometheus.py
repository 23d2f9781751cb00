"""Helpers for tests that run the real Prometheus server against real exporters.

Prometheus 2.x needs ~5 s to publish file-discovered targets and two scrapes before `rate()`
has data, so queries are polled with a deadline (`wait_for_query`) instead of slept on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.waiting import wait_for
from vllm_localcluster.prometheus import PrometheusServer

Result = list[dict[str, Any]]


@contextmanager
def running_prometheus(workdir: Path, scrape_interval: str = "1s") -> Iterator[PrometheusServer]:
    """A started server with its files in `workdir`, stopped (process killed) on exit."""
    server = PrometheusServer(workdir, scrape_interval=scrape_interval)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def target_group(address: str, **labels: str) -> dict[str, Any]:
    """One file-SD group: `target_group("127.0.0.1:8000", namespace="ns", pod="p")`."""
    return {"targets": [address], "labels": dict(labels)}


def wait_for_query(
    prometheus: PrometheusServer,
    expr: str,
    timeout: float = 30.0,
    accept: Callable[[Result], bool] = bool,
) -> Result:
    """Poll an instant query until `accept(result)` (default: non-empty) and return the result."""
    holder: dict[str, Result] = {}

    def ready() -> bool:
        holder["result"] = prometheus.query(expr)
        return accept(holder["result"])

    wait_for(ready, timeout=timeout, interval=0.25, message=f"PromQL {expr!r}")
    return holder["result"]


def wait_for_targets_up(prometheus: PrometheusServer, count: int, timeout: float = 30.0) -> Result:
    """Wait until `count` targets are scraped successfully (up == 1)."""
    return wait_for_query(
        prometheus, "up == 1", timeout=timeout, accept=lambda result: len(result) >= count
    )


def scalar(result: Result) -> float:
    """The value of a one-element instant vector (values come back as strings)."""
    assert len(result) == 1, result
    return float(result[0]["value"][1])
