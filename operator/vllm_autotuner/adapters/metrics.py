"""The operator's own Prometheus metrics (what it decided, rolled out, rolled back).

Served on a separate port by prometheus_client. These names are documented in
docs/operations.md with suggested alerts; keep them stable.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class OperatorMetrics:
    """One registry per operator instance, so tests can run several operators in a process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "vllm_autotuner_decisions",
            "Tuning decisions taken, by action (hold, recommend, rollout, commit, rollback...).",
            ["namespace", "deployment", "action"],
            registry=self.registry,
        )
        self.rollouts = Counter(
            "vllm_autotuner_rollouts",
            "Rollouts of a new knob configuration started.",
            ["namespace", "deployment"],
            registry=self.registry,
        )
        self.rollbacks = Counter(
            "vllm_autotuner_rollbacks",
            "Rollbacks to the last good configuration.",
            ["namespace", "deployment"],
            registry=self.registry,
        )
        self.knob = Gauge(
            "vllm_autotuner_knob",
            "The value of each tuned vLLM flag currently applied.",
            ["namespace", "deployment", "knob"],
            registry=self.registry,
        )
        self.reconcile_duration = Histogram(
            "vllm_autotuner_reconcile_duration_seconds",
            "Duration of one reconcile of a VLLMDeployment.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.reconcile_errors = Counter(
            "vllm_autotuner_reconcile_errors",
            "Reconciles that failed with an error (retried on the next cycle).",
            ["namespace", "deployment"],
            registry=self.registry,
        )

    def set_knobs(self, namespace: str, name: str, values: dict[str, float]) -> None:
        for knob, value in values.items():
            self.knob.labels(namespace=namespace, deployment=name, knob=knob).set(value)

    def forget(self, namespace: str, name: str) -> None:
        for knob in ("maxNumBatchedTokens", "maxNumSeqs", "gpuMemoryUtilization"):
            with contextlib.suppress(KeyError):
                self.knob.remove(namespace, name, knob)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
