"""A real Prometheus scrapes a running vllm-sim; PromQL on vLLM's names must work.

vllm-sim answers /metrics through prometheus_client's content negotiation, as vLLM does. A
Prometheus 2.x asks for OpenMetrics without `escaping=`, which prometheus_client >= 0.23 answers
with `vllm_` sample names, so that is what it stores (a real vLLM pod scraped the same way does
the same); Prometheus 3.x asks for UTF-8 names and keeps `vllm:`. Both spellings are checked in
tests/unit/sim/test_metrics.py; here, whichever the installed Prometheus negotiates."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.integration.sim.simproc import MODEL, SimProcess, running_sim
from tests.support.prometheus import target_group, wait_for_query, wait_for_targets_up
from vllm_localcluster.prometheus import PrometheusServer

pytestmark = pytest.mark.prometheus


class Traffic:
    """Steady streaming requests from a background thread until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body: dict[str, Any] = {"prompt": "x", "max_tokens": 40, "stream": True}
        body["vllm_sim"] = {"prompt_tokens": 500}
        while not self.stop.is_set():
            with requests.post(
                f"{self.url}/v1/completions", json=body, stream=True, timeout=30
            ) as r:
                for _ in r.iter_lines():
                    pass
            self.sent += 1

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


@pytest.fixture
def scraped_sim(tmp_path: Path, prometheus: PrometheusServer) -> Iterator[SimProcess]:
    with running_sim(tmp_path) as sim:
        prometheus.set_targets(
            [target_group(sim.address, namespace="team-a", pod="llama-0", job="vllm")]
        )
        yield sim


def negotiated_prefix(prometheus: PrometheusServer) -> str:
    version = requests.get(f"{prometheus.url}/api/v1/status/buildinfo", timeout=5).json()
    major = int(version["data"]["version"].split(".")[0])
    return "vllm_" if major < 3 else "vllm:"


def test_promql_on_the_names_prometheus_negotiates(
    scraped_sim: SimProcess, prometheus: PrometheusServer
) -> None:
    wait_for_targets_up(prometheus, 1)
    prefix = negotiated_prefix(prometheus)
    with Traffic(scraped_sim.url):
        (running,) = wait_for_query(prometheus, prefix + 'num_requests_running{pod="llama-0"}')
        labels = running["metric"]
        assert labels["namespace"] == "team-a" and labels["job"] == "vllm"
        assert labels["model_name"] == MODEL
        (rate,) = wait_for_query(
            prometheus, f"rate({prefix}generation_tokens_total[5s]) > 0", timeout=30
        )
        assert float(rate["value"][1]) > 0
        (p90,) = wait_for_query(
            prometheus,
            "histogram_quantile(0.9, sum by (le) "
            f"(rate({prefix}time_to_first_token_seconds_bucket[5s])))",
            timeout=30,
            accept=lambda result: bool(result) and not math.isnan(float(result[0]["value"][1])),
        )
        assert float(p90["value"][1]) > 0
    # One pod only ever exports one spelling.
    other = "vllm:" if prefix == "vllm_" else "vllm_"
    assert prometheus.query(f'{{__name__=~"{other}.+"}}') == []
