"""`vllm-autotuner recommend` against the real Prometheus scraping a simulated vLLM pod.

The pod runs vLLM's default token budget for an H100 under long-prompt traffic, whose prefill
chunks push the ITL p95 far over a 25 ms SLO; the command must say so and recommend a smaller
budget, reading nothing but Prometheus.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.sim.simproc import running_sim
from tests.support.prometheus import target_group, wait_for_query
from vllm_localcluster.prometheus import PrometheusServer
from vllm_sim.loadgen import run_http
from vllm_sim.workload import WorkloadSpec

TIME_SCALE = 5.0


@pytest.mark.slow
def test_recommend_reads_prometheus_and_asks_for_a_smaller_token_budget(
    tmp_path: Path, prometheus: PrometheusServer
) -> None:
    with running_sim(
        tmp_path, "--max-num-batched-tokens", "8192", "--sim-time-scale", str(TIME_SCALE)
    ) as sim:
        prometheus.set_targets(
            [target_group(sim.address, namespace="inference", pod="llama-0", job="vllm")]
        )
        wait_for_query(prometheus, 'up{pod="llama-0"} == 1', timeout=30)
        workload = WorkloadSpec.preset("rag", 5.0, 45 * TIME_SCALE, seed=3)
        result = asyncio.run(
            run_http(sim.url, workload, time_scale=TIME_SCALE, duration=45, timeout=90)
        )
        assert len(result.records) > 150
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "vllm_autotuner.cli",
                "recommend",
                "--prometheus",
                prometheus.url,
                "--namespace",
                "inference",
                "--ttft-ms",
                "2000",
                "--itl-ms",
                "25",
                "--gpu",
                "H100",
                "--window",
                "40s",
                "--min-requests",
                "20",
                "--rate-scale",
                str(TIME_SCALE),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    (advice,) = json.loads(out.stdout)
    assert advice["namespace"] == "inference"
    assert advice["metricsAvailable"] is True, advice["reason"]
    assert advice["current"]["maxNumBatchedTokens"] == 8192
    assert advice["recommendation"] is not None, advice["reason"]
    assert advice["recommendation"]["knobs"]["maxNumBatchedTokens"] < 8192
    assert "--max-num-batched-tokens" in advice["flags"]


def test_recommend_says_clearly_when_prometheus_is_down(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_autotuner.cli",
            "recommend",
            "--prometheus",
            "http://127.0.0.1:9",
            "--ttft-ms",
            "500",
            "--itl-ms",
            "50",
            "--timeout",
            "2s",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert "127.0.0.1:9" in out.stderr


def test_recommend_refuses_a_request_without_an_slo() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vllm_autotuner.cli", "recommend", "--prometheus", "http://x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "--ttft-ms and --itl-ms" in out.stderr
