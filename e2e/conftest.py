"""Fixtures of the closed-loop scenarios: a fresh local cluster per scenario, always cleaned up.

Each scenario gets its own cluster (kube-apiserver, etcd, controller manager, scheduler, node
agent, real Prometheus), Service proxy and operator process, because the scenarios break
things on purpose (OOM-ing pods, a killed operator, a stopped Prometheus) and must not inherit
each other's state. Teardown stops
everything and fails the test if any process it started is still running.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from tests.support.waiting import wait_for

from e2e.harness import ClosedLoop, process_gone


def pytest_configure(config: pytest.Config) -> None:
    # The lead owns pyproject.toml; the marker is registered here so `-m e2e` works unwarned.
    config.addinivalue_line(
        "markers", "e2e: closed-loop scenarios on the local cluster (pytest e2e -m e2e)"
    )


MakeLoop = Callable[..., ClosedLoop]


def _running(pids: set[int]) -> list[int]:
    return sorted(p for p in pids if not process_gone(p))


@pytest.fixture
def closed_loop(tmp_path: Path) -> Iterator[MakeLoop]:
    """`closed_loop(sim_env=..., sim_env_by_labels=..., time_scale=...)` starts the cluster
    and the Service proxy; the test applies its objects and starts the operator and load
    through the returned object. Logs (operator.log, pods/, prometheus/) stay under the
    test's tmp_path for a post-mortem."""
    loops: list[ClosedLoop] = []

    def make(
        sim_env: Mapping[str, str] | None = None,
        *,
        sim_env_by_labels: Sequence[tuple[Mapping[str, str], Mapping[str, str]]] = (),
        time_scale: float = 5.0,
        reconcile_interval_s: float = 3.0,
        audit: bool = False,
    ) -> ClosedLoop:
        loop = ClosedLoop(
            tmp_path / f"cluster-{len(loops)}",
            sim_env=sim_env,
            sim_env_by_labels=sim_env_by_labels,
            time_scale=time_scale,
            reconcile_interval_s=reconcile_interval_s,
            audit=audit,
        )
        loops.append(loop)
        return loop.start()

    yield make
    for loop in loops:
        pids = loop.close()
        wait_for(
            lambda pids=pids: not _running(pids),  # type: ignore[misc]
            timeout=20,
            interval=0.2,
            message=f"every process of the scenario to exit (started: {sorted(pids)})",
        )
