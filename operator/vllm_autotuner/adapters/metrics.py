"""The operator's own Prometheus metrics (what it decided, rolled out, rolled back).

Served on a separate port by prometheus_client. These names are documented in
docs/operations.md with suggested alerts; keep them stable.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from vllm_autotuner.core.tuning_types import Phase

PHASES: tuple[str, ...] = get_args(Phase)
KNOBS = ("maxNumBatchedTokens", "maxNumSeqs", "gpuMemoryUtilization")
CAPACITY_SOURCES = ("predicted", "measured")


class LabelledGauges:
    """Gauge families whose series are plain dict entries, read when Prometheus scrapes.

    A prometheus_client Gauge keeps an object, a value holder and a lock per labelled series:
    at 1,000 deployments, ~15,000 series were 14,000 Gauge objects (bench.scale). Here a series
    is one tuple key and one float. The same exposition (one family per name, every family
    listed even when it has no series)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._families: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._values: dict[str, dict[tuple[str, ...], float]] = {}
        registry.register(self)

    def family(self, name: str, documentation: str, labels: Iterable[str]) -> _Family:
        self._families[name] = (documentation, tuple(labels))
        self._values[name] = {}
        return _Family(self._values[name], len(self._families[name][1]))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, (documentation, labels) in self._families.items():
            family = GaugeMetricFamily(name, documentation, labels=labels)
            for values, value in list(self._values[name].items()):  # the scrape's own thread
                family.add_metric(values, value)
            yield family


class _Family:
    """One gauge family's series, by label values in the family's label order."""

    def __init__(self, values: dict[tuple[str, ...], float], arity: int) -> None:
        self._series = values
        self._arity = arity

    def set(self, *labels: str, value: float) -> None:
        if len(labels) != self._arity:
            raise ValueError(f"expected {self._arity} label values, got {labels!r}")
        self._series[labels] = float(value)

    def remove(self, *labels: str) -> None:
        self._series.pop(labels, None)


class OperatorMetrics:
    """One registry per operator instance, so tests can run several operators in a process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._phases: set[str] = set()
        self._slo_series: dict[tuple[str, str], set[tuple[str, str]]] = {}
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
        gauges = LabelledGauges(self.registry)
        self.knob = gauges.family(
            "vllm_autotuner_knob",
            "The value of each tuned vLLM flag currently applied.",
            ["namespace", "deployment", "knob"],
        )
        self.phase = gauges.family(
            "vllm_autotuner_phase",
            "1 for the tuner's current phase of a VLLMDeployment, 0 for the others.",
            ["namespace", "deployment", "phase"],
        )
        self.slo_met = gauges.family(
            "vllm_autotuner_slo_met",
            "1 when the last window met every SLO target, 0 when not; absent without data.",
            ["namespace", "deployment"],
        )
        self.capacity = gauges.family(
            "vllm_autotuner_capacity_rps",
            "Requests per second one replica serves within the SLO with the applied knobs: "
            "the model's prediction (source=predicted) and the measured value (measured).",
            ["namespace", "deployment", "source"],
        )
        self.slo_threshold = gauges.family(
            "vllm_autotuner_slo_threshold_seconds",
            "The SLO each deployment is tuned against: the threshold at a percentile.",
            ["namespace", "deployment", "metric", "percentile"],
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
            self.knob.set(namespace, name, knob, value=value)

    def set_phase(self, namespace: str, name: str, phase: str) -> None:
        self._phases.add(phase)  # a phase newer than PHASES still gets forgotten
        for value in dict.fromkeys((*PHASES, phase)):
            self.phase.set(namespace, name, value, value=1.0 if value == phase else 0.0)

    def set_slo_met(self, namespace: str, name: str, met: bool | None) -> None:
        """None (no usable window) removes the series: absent, not a false 0."""
        if met is None:
            self.slo_met.remove(namespace, name)
        else:
            self.slo_met.set(namespace, name, value=1.0 if met else 0.0)

    def set_capacity(self, namespace: str, name: str, source: str, rps: float | None) -> None:
        """Capacity of one replica under the SLO (`source` "predicted" or "measured")."""
        if source not in CAPACITY_SOURCES:
            raise ValueError(f"capacity source {source!r} is not one of {CAPACITY_SOURCES}")
        if rps is None:
            self.capacity.remove(namespace, name, source)
        else:
            self.capacity.set(namespace, name, source, value=rps)

    def set_slo_targets(
        self, namespace: str, name: str, targets: Iterable[tuple[str, float, float]]
    ) -> None:
        """(metric, percentile in percent, threshold in ms) of each target in force."""
        wanted = {(metric, f"{percentile:g}"): ms / 1000.0 for metric, percentile, ms in targets}
        for labels in self._slo_series.pop((namespace, name), set()) - wanted.keys():
            self.slo_threshold.remove(namespace, name, *labels)
        for (metric, percentile), seconds in wanted.items():
            self.slo_threshold.set(namespace, name, metric, percentile, value=seconds)
        self._slo_series[(namespace, name)] = set(wanted)

    def forget(self, namespace: str, name: str) -> None:
        """Drop every gauge series of a deleted deployment (counters keep their history)."""
        series = [
            *((self.knob, (namespace, name, knob)) for knob in KNOBS),
            *((self.capacity, (namespace, name, src)) for src in CAPACITY_SOURCES),
            (self.slo_met, (namespace, name)),
        ]
        phases = dict.fromkeys((*PHASES, *sorted(self._phases)))
        series += [(self.phase, (namespace, name, p)) for p in phases]
        for gauge, labels in series:
            gauge.remove(*labels)
        self.set_slo_targets(namespace, name, ())
        self._slo_series.pop((namespace, name), None)

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serves /metrics in a daemon thread; the server (its `shutdown()` stops it)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
