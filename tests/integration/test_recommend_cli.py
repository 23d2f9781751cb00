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
    assert len(advice["currentGuessed"]) == 3  # no knob flags: vLLM's H100 defaults, a guess
    assert advice["recommendation"] is not None, advice["reason"]
    assert advice["recommendation"]["knobs"]["maxNumBatchedTokens"] < 8192
    assert "--max-num-batched-tokens" in advice["flags"]
    assert advice["recommendation"]["gainPct"] is None  # no gain over a guess


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
            "--gpu",
            "H100",
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
        [
            sys.executable,
            "-m",
            "vllm_autotuner.cli",
            "recommend",
            "--prometheus",
            "http://x",
            "--gpu",
            "H100",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "--ttft-ms and --itl-ms" in out.stderr


def test_recommend_never_judges_two_revisions_in_one_window(
    tmp_path: Path, prometheus: PrometheusServer
) -> None:
    """Pods of two ReplicaSets serving: a rollout; once the old pod is gone, the window
    starts after it was last scraped."""
    from datetime import UTC, datetime

    from vllm_autotuner.adapters.prometheus import PrometheusSource
    from vllm_autotuner.recommend import RecommendRequest, recommend

    old, new = "llama-6d5f8b7c9-abcde", "llama-7f8c9d6b5-klmno"
    with running_sim(tmp_path) as sim_old, running_sim(tmp_path) as sim_new:
        prometheus.set_targets(
            [
                target_group(sim_old.address, namespace="inference", pod=old, job="vllm"),
                target_group(sim_new.address, namespace="inference", pod=new, job="vllm"),
            ]
        )
        wait_for_query(prometheus, 'count(up{namespace="inference"} == 1) == 2', timeout=30)
        req = RecommendRequest(prometheus.url, 2000, 25, gpu="H100", window_s=60.0)
        (advice,) = recommend(req)
        assert not advice.snapshot.available
        assert "rollout is under way" in advice.snapshot.reason
        assert advice.decision.new_state.recommendation is None

        prometheus.set_targets(
            [target_group(sim_new.address, namespace="inference", pod=new, job="vllm")]
        )
        removed = datetime.now(UTC)
        wait_for_query(prometheus, f'up{{pod="{old}"}}', accept=lambda r: r == [], timeout=30)
        source = PrometheusSource(prometheus.url)
        source.discover_targets_sync("inference", window_s=60.0)  # learns the metric names
        seen = source.last_seen_sync("inference", [old], 60.0, datetime.now(UTC))
    assert seen is not None
    assert abs((seen - removed).total_seconds()) < 5.0
