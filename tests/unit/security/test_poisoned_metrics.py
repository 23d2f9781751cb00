"""Class 8: Prometheus data never poisons other tenants, nor the status people read.

One Prometheus answers for every deployment at once. Each case adds one hostile sample (a label
value that is not a string, a malformed value, an absurd number) to the answers of a cycle that
also carries a victim deployment's clean data: the victim's snapshot must come out exactly as
without the hostile sample. Text from Prometheus (error messages, label values) and absurd
numbers must reach status and Events cut, cleaned and bounded.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.unit.security.corpus import POLICY
from tests.unit.security.hostile_objects import RecordingKube, controller, deployment
from vllm_autotuner.adapters.prometheus import PrometheusSource
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.controller import metrics_transition
from vllm_autotuner.core.conditions import ConditionUpdate
from vllm_autotuner.core.snapshot import LatencySummary, Snapshot
from vllm_autotuner.core.tuning_types import Knobs
from vllm_autotuner.observer import Observer

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
T = NOW.timestamp()
SERIES = [
    "vllm:request_success_total",
    "vllm:num_requests_running",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
]
KNOBS = Knobs(max_num_batched_tokens=8192, max_num_seqs=256, gpu_memory_utilization=0.9)


def _target(ns: str, pod: str) -> SnapshotTarget:
    return SnapshotTarget(
        namespace=ns,
        name="llama",
        pods=(pod,),
        since=None,
        knobs=KNOBS,
        revision="r1",
        window_s=300,
        model_name="m",
    )


VICTIM = _target("team-a", "llama-a")
ATTACKER = _target("team-b", "llama-b")


def _row(pod: str, ns: str, value: Any, **labels: Any) -> dict[str, Any]:
    return {
        "metric": {"namespace": ns, "pod": pod, "model_name": "m", **labels},
        "value": [T, value],
    }


def clean_answers() -> dict[str, list[Any]]:
    rows: dict[str, list[Any]] = {"request_success": [], "running": [], "preemptions": []}
    rows["ttft"] = []
    for ns, pod in (("team-a", "llama-a"), ("team-b", "llama-b")):
        rows["request_success"].append(_row(pod, ns, "600"))
        rows["running"] += [
            _row(pod, ns, "12", autotuner_part="mean"),
            _row(pod, ns, "20", autotuner_part="max"),
        ]
        rows["preemptions"].append(_row(pod, ns, "3"))
        rows["ttft"] += [
            _row(pod, ns, "300", le="0.1"),
            _row(pod, ns, "600", le="+Inf"),
            _row(pod, ns, "30", le="sum"),
        ]
    return rows


class Transport:
    """Answers each query from `answers` by the signal its text names."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers

    async def query(self, expr: str, at: float) -> Any:
        for key in ("request_success", "running", "preemptions"):
            if key in expr:
                return self.answers[key]
        if "time_to_first_token" in expr:
            return self.answers["ttft"]
        return []

    async def label_values(self, label: str, match: str, start: float, end: float) -> Any:
        return SERIES


def cycle(answers: dict[str, Any]) -> dict[tuple[str, str], Snapshot]:
    source = PrometheusSource("http://prom", min_window_s=60)
    return asyncio.run(source._cycle(Transport(answers), [VICTIM, ATTACKER], NOW))


BASELINE = cycle(clean_answers())[VICTIM.key]

HOSTILE: dict[str, tuple[str, Any]] = {
    # label values that are not strings, in every label the operator reads
    "pod-int": ("request_success", _row(7, "team-b", "1")),
    "pod-null": ("request_success", _row(None, "team-b", "1")),
    "pod-list": ("request_success", _row(["llama-a"], "team-a", "1")),
    "pod-dict": ("request_success", _row({"a": 1}, "team-a", "1")),
    "pod-bool": ("request_success", _row(True, "team-b", "1")),
    "namespace-list": ("request_success", _row("llama-b", ["team-b"], "1")),
    "model-name-dict": ("request_success", _row("llama-b", "team-b", "1", model_name={"x": 1})),
    "le-number": ("ttft", _row("llama-b", "team-b", "5", le=0.5)),
    "le-list": ("ttft", _row("llama-b", "team-b", "5", le=["0.5"])),
    "part-int": ("running", _row("llama-b", "team-b", "5", autotuner_part=1)),
    "part-list": ("running", _row("llama-b", "team-b", "5", autotuner_part=["mean"])),
    "extra-label-dict": ("running", _row("llama-b", "team-b", "5", engine={"0": 1})),
    # malformed samples
    "metric-string": ("request_success", {"metric": "llama-b", "value": [T, "1"]}),
    "metric-list": ("request_success", {"metric": ["llama-b"], "value": [T, "1"]}),
    "value-missing": ("request_success", {"metric": {"pod": "llama-b"}}),
    "value-one-element": ("request_success", {"metric": {"pod": "llama-b"}, "value": ["1"]}),
    "value-null": ("request_success", _row("llama-b", "team-b", None)),
    "value-dict": ("request_success", _row("llama-b", "team-b", {"v": 1})),
    "value-list": ("request_success", _row("llama-b", "team-b", [1])),
    "value-bool": ("request_success", _row("llama-b", "team-b", True)),
    "value-nan": ("request_success", _row("llama-b", "team-b", "NaN")),
    "value-inf": ("request_success", _row("llama-b", "team-b", "+Inf")),
    "value-huge-exponent": ("request_success", _row("llama-b", "team-b", "1e999")),
    "value-words": ("request_success", _row("llama-b", "team-b", "lots")),
    "item-string": ("request_success", "llama-b 600"),
    "item-null": ("request_success", None),
    "item-list": ("request_success", [["llama-b", 600]]),
    # absurd numbers from the attacker's own pod
    "running-1e308": ("running", _row("llama-b", "team-b", "1e308", autotuner_part="mean")),
    "preemptions-1e308": ("preemptions", _row("llama-b", "team-b", "1e308")),
    "le-1e308": ("ttft", _row("llama-b", "team-b", "600", le="1e308")),
}


@pytest.mark.parametrize(("signal", "sample"), HOSTILE.values(), ids=list(HOSTILE))
def test_one_hostile_sample_never_changes_another_tenants_snapshot(
    signal: str, sample: Any
) -> None:
    answers = clean_answers()
    answers[signal].append(sample)
    snaps = cycle(answers)
    victim = snaps[VICTIM.key]
    assert victim.available, victim.reason
    assert victim == replace(BASELINE, time=victim.time)
    attacker = snaps[ATTACKER.key]
    for value in (attacker.running_mean, attacker.preemption_rate, attacker.ttft.p95_ms):
        assert value is None or (math.isfinite(value) and value < 1e9), attacker


@pytest.mark.parametrize(
    "answer", [{"x": 1}, "garbage", 12, None], ids=["dict", "str", "int", "null"]
)
def test_an_answer_that_is_not_a_list_leaves_other_signals_readable(answer: Any) -> None:
    answers = clean_answers()
    answers["running"] = answer
    victim = cycle(answers)[VICTIM.key]
    assert victim.available and victim.completed_requests == 600


# ------------------------------------------------------------------ what reaches status


class FixedSource:
    """Whatever snapshot the test wants the observer to hand the controller."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    async def snapshots(self, targets: Any, now: datetime) -> dict[tuple[str, str], Snapshot]:
        return {t.key: replace(self.snapshot, time=now) for t in targets}


def status_after(snapshot: Snapshot) -> tuple[dict[str, Any], RecordingKube, list[Any]]:
    kube = RecordingKube()
    ctl = controller(kube)
    ctl.observer = Observer(FixedSource(snapshot), clock=ctl.clock)
    obj = deployment(("spec.tuning", {"mode": "Recommend", "policyRef": "default"}))
    events: list[Any] = []

    async def go() -> None:
        outcome = await ctl.reconcile(
            obj, policies={"default": POLICY["spec"]}, namespace_labels={}, children={}
        )
        await ctl.observer.refresh()
        status: dict[str, Any] = {}
        for patch in kube.patches:
            status.update(patch["status"])
        again = await ctl.reconcile(
            {**obj, "status": status},
            policies={"default": POLICY["spec"]},
            namespace_labels={},
            children={},
        )
        events.extend(outcome.events + again.events)

    asyncio.run(go())
    status: dict[str, Any] = {}
    for patch in kube.patches:
        status.update(patch["status"])
    return status, kube, events


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


HOSTILE_REASONS = {
    "one-megabyte": "Prometheus query failed: " + "x" * 1_000_000,
    "terminal-escape": "Prometheus query failed: \x1b[2J\x1b[31mall good\x1b[0m",
    "nul-and-bell": "bad\x00answer\x07",
    "bidi-override": "model_name \u202egnp.exe",
    "many-lines": "line\n" * 20_000,
    "line-separators": "a\u2028b\u2029c\r\nd",
}


@pytest.mark.parametrize("reason", HOSTILE_REASONS.values(), ids=list(HOSTILE_REASONS))
def test_text_from_prometheus_reaches_status_and_events_cut_and_clean(reason: str) -> None:
    status, _, events = status_after(Snapshot.unavailable(NOW, 300, reason))
    metrics = {c["type"]: c for c in status["conditions"]}["MetricsAvailable"]
    assert metrics["status"] == "False"
    texts = _strings(status) + [e.message for e in events]
    assert all(len(t) <= 4096 for t in texts), max(len(t) for t in texts)
    assert all(len(e.message) <= 1024 for e in events)
    bad = [t for t in texts if any(ch in t for ch in "\x00\x07\x1b\n\r\u2028\u2029\u202e")]
    assert bad == []
    json.dumps(status, allow_nan=False)  # the API server could parse every byte of it


@pytest.mark.parametrize("reason", HOSTILE_REASONS.values(), ids=list(HOSTILE_REASONS))
def test_an_event_note_quoting_prometheus_is_cut_and_clean(reason: str) -> None:
    """Metrics lost while tuning post a Warning that quotes the reason (metrics_transition)."""
    was_fresh = {
        "conditions": [{"type": "MetricsAvailable", "status": "True", "reason": "MetricsFresh"}]
    }
    update = ConditionUpdate("MetricsAvailable", "False", "MetricsUnavailable", reason)
    (event,) = metrics_transition(was_fresh, [update])
    assert len(event.message) <= 1024
    assert not any(ch in event.message for ch in "\x00\x07\x1b\n\r\u2028\u2029\u202e")


ABSURD = {
    "running-1e308": {"running_mean": 1e308},
    "waiting-inf": {"waiting_mean": math.inf},
    "preemptions-1e300": {"preemption_rate": 1e300},
    "ttft-p95-inf": {"ttft": LatencySummary(p95_ms=math.inf, at_slo_ms=1.0)},
    "itl-p95-1e308": {"itl": LatencySummary(p95_ms=1e308, at_slo_ms=1.0)},
}


@pytest.mark.parametrize("fields", ABSURD.values(), ids=list(ABSURD))
def test_absurd_numbers_never_reach_status(fields: dict[str, Any]) -> None:
    sane = {
        "ttft": LatencySummary(p95_ms=100.0, at_slo_ms=100.0),
        "itl": LatencySummary(p95_ms=20.0, at_slo_ms=20.0),
    }
    snapshot = Snapshot(
        time=NOW,
        window_s=300,
        available=True,
        reason="",
        revision="r",
        knobs=KNOBS,
        num_pods=1,
        request_rate=2.0,
        completed_requests=600,
        **{**sane, **fields},
    )
    status, _, _ = status_after(snapshot)
    json.dumps(status, allow_nan=False)  # the API server could parse every byte of it
    observed = status.get("observed") or {}
    numbers = [v for v in observed.values() if isinstance(v, float)]
    assert all(abs(v) <= 1e15 for v in numbers), observed
