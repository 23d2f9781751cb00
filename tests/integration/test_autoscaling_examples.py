"""The autoscaler examples' query in the real Prometheus: it is load / capacity.

Three "vLLM pods" (the stable one, the canary, and a pod of another deployment whose name
starts the same) expose a success counter growing 6 per second and 30 waiting requests; the
operator exposes its capacity gauge through its own registry. The KEDA query, run verbatim,
and the recording rule of the HPA example, loaded as a rule file, must both give
(6 + 6 + 60 / 60) / capacity: the other deployment's pod is not counted, and without a
published capacity the example's fallback (2 req/s) is used. The rate window is shortened
from 2m to 15s (`fast`), so that the test needs seconds of data rather than two minutes;
everything else is the examples' text.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml
from prometheus_client import generate_latest

from tests.support.prometheus import scalar, target_group, wait_for_query
from tests.unit.api.test_autoscaling_examples import by_kind, keda_query
from vllm_autotuner.adapters.metrics import OperatorMetrics
from vllm_localcluster.prometheus import PrometheusServer

RATE = 6.0  # successes per second per pod
WAITING = 30.0  # requests waiting per pod
STABLE = "llama-7d9f8c6b5d-x2x4z"
CANARY = "llama-canary-5c6d7f8b9-abcde"
OTHER = "llama-70b-5d8f9c7b6-qwert"  # another VLLMDeployment, "llama-70b"


@contextmanager
def exporter(body: Callable[[], bytes]) -> Iterator[str]:
    """An HTTP /metrics on 127.0.0.1 that answers `body()`; yields its address."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            payload = body()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def fast(expr: str) -> str:
    assert expr.count("[2m]") == 1, expr
    return expr.replace("[2m]", "[15s]")


def test_the_example_query_is_load_over_capacity(tmp_path: Path) -> None:
    started = time.monotonic()

    def vllm_pod() -> bytes:
        total = RATE * (time.monotonic() - started)
        return (
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{finished_reason="stop",model_name="m"}} {total}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {WAITING}\n'
        ).encode()

    metrics = OperatorMetrics()
    metrics.set_capacity("team-a", "llama", "predicted", 4.0)
    metrics.set_capacity("team-a", "other", "predicted", 100.0)  # another deployment's

    rule = dict(by_kind("PrometheusRule")[0][1]["spec"])
    for group in rule["groups"]:
        for recording in group["rules"]:
            recording["expr"] = fast(recording["expr"])
        group["interval"] = "1s"
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule))
    prom_dir = tmp_path / "prometheus"
    with (
        exporter(vllm_pod) as pods,
        exporter(lambda: generate_latest(metrics.registry)) as operator,
        PrometheusServer(prom_dir, rule_files=[str(rules)]) as prometheus,
    ):
        prometheus.set_targets(
            [
                target_group(pods, namespace="team-a", pod=STABLE),
                target_group(pods, namespace="team-a", pod=CANARY),
                target_group(pods, namespace="team-a", pod=OTHER),
                target_group(operator, job="vllm-autotuner"),
            ]
        )
        expected = (2 * RATE + 2 * WAITING / 60) / 4.0

        def near(value: float) -> bool:
            return abs(value - expected) < 0.1 * expected

        got = wait_for_query(
            prometheus, fast(keda_query()), 60, accept=lambda r: len(r) == 1 and near(scalar(r))
        )
        assert near(scalar(got))
        recorded = wait_for_query(
            prometheus,
            'vllm_autotuner:replicas_needed{namespace="team-a", deployment="llama"}',
            60,
            accept=lambda r: len(r) == 1 and near(scalar(r)),
        )
        assert near(scalar(recorded))

        # No capacity published yet (or any more): the example's cautious 2 req/s.
        metrics.set_capacity("team-a", "llama", "predicted", None)
        fallback = (2 * RATE + 2 * WAITING / 60) / 2.0
        wait_for_query(
            prometheus,
            fast(keda_query()),
            60,
            accept=lambda r: len(r) == 1 and abs(scalar(r) - fallback) < 0.1 * fallback,
        )
