"""Every query of the chart's Grafana dashboard returns data from a real Prometheus scraping a
vllm-sim server under load and the operator's own metrics endpoint."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.sim.simproc import running_sim
from tests.support.prometheus import target_group, wait_for_query
from tests.support.waiting import WaitTimeout
from tests.unit.ship.test_monitoring import panel_queries
from vllm_autotuner.adapters.metrics import OperatorMetrics
from vllm_localcluster.prometheus import PrometheusServer
from vllm_sim.loadgen import run_http
from vllm_sim.workload import WorkloadSpec

TIME_SCALE = 5.0
NAMESPACE, DEPLOYMENT = "team-a", "llama"  # what test_monitoring's VARIABLES select
POD = f"{DEPLOYMENT}-6d5f8b7c9-abcde"  # a Deployment's pod name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def operator_metrics() -> Iterator[tuple[OperatorMetrics, int]]:
    """The operator's metrics for one deployment, as a reconcile leaves them."""
    metrics = OperatorMetrics()
    args = (NAMESPACE, DEPLOYMENT)
    metrics.set_knobs(*args, {"maxNumBatchedTokens": 4096, "maxNumSeqs": 256,
                              "gpuMemoryUtilization": 0.92})  # fmt: skip
    metrics.set_phase(*args, "Verifying")
    metrics.set_slo_met(*args, True)
    metrics.set_slo_targets(*args, [("ttft", 95.0, 2000.0), ("itl", 95.0, 50.0),
                                    ("e2e", 95.0, 20000.0)])  # fmt: skip
    metrics.set_capacity(*args, "predicted", 12.0)
    metrics.set_capacity(*args, "measured", 10.5)
    metrics.rollouts.labels(*args).inc()
    metrics.rollbacks.labels(*args).inc()
    metrics.decisions.labels(*args, "commit").inc()
    port = free_port()
    server = metrics.serve(port, addr="127.0.0.1")
    try:
        yield metrics, port
    finally:
        server.shutdown()


def test_every_panel_returns_data(
    tmp_path: Path,
    prometheus: PrometheusServer,
    operator_metrics: tuple[OperatorMetrics, int],
) -> None:
    _, port = operator_metrics
    with running_sim(tmp_path, "--sim-time-scale", str(TIME_SCALE)) as sim:
        prometheus.set_targets(
            [
                target_group(sim.address, namespace=NAMESPACE, pod=POD, job="vllm"),
                target_group(f"127.0.0.1:{port}", job="vllm-autotuner-metrics"),
            ]
        )
        wait_for_query(prometheus, "count(up == 1) == 2", timeout=30)
        workload = WorkloadSpec.preset("chat", 4.0, 20 * TIME_SCALE, seed=1)
        result = asyncio.run(
            run_http(sim.url, workload, time_scale=TIME_SCALE, duration=20, timeout=60)
        )
        assert len(result.records) > 40
        empty = []
        for title, expr in panel_queries().items():
            try:
                wait_for_query(prometheus, expr, timeout=20)
            except WaitTimeout:
                empty.append(title)
    assert empty == []
