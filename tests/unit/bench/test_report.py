"""The benchmark's judgement: predictions held to the truth, and the verdict's harm checks."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest
from bench.tuning import methods, report
from bench.tuning.scenario import parse
from bench.tuning.world import World

from vllm_autotuner.core.decide import Decision
from vllm_autotuner.core.perf_model import Prediction
from vllm_autotuner.core.snapshot import Snapshot
from vllm_autotuner.core.tuning_types import Knobs, TuningState

A = Knobs(2048, 256, 0.9)
B = Knobs(1024, 128, 0.9)


class FakeTruth:
    """Known true capacities (a Truth's interface: capacity(knobs))."""

    def __init__(self, values: dict[Knobs, float]) -> None:
        self.values = values

    def capacity(self, k: Knobs) -> float:
        return self.values[k]


def prediction(capacity: float) -> Prediction:
    return Prediction(100.0, 20.0, 5000.0, None, 0.0, True, capacity, True)


def test_predictions_are_recorded_next_to_the_truth_and_the_window_load() -> None:
    s = parse(
        {
            "name": "report-test",
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "gpu": "H100",
            "replicas": 2,
            "horizon_s": 600,
            "workload": {"preset": "chat", "rate": 3.0},
            "slo": {"itl": {"percentile": 95, "threshold_ms": 60}},
        }
    )
    w = World(s, A)
    w.advance_to(600)
    pods, since = w.ready_pods(A)
    decision = Decision(
        "hold",
        "test",
        TuningState.initial(A),
        predictions=((A, prediction(2.4)), (B, prediction(6.0))),
    )
    snap = Snapshot(datetime(2026, 1, 1, tzinfo=UTC), 300.0, request_rate=5.8, num_pods=2)
    truth = FakeTruth({A: 2.0, B: 5.0})
    points = methods._predictions(decision, snap, w, pods, since, 300.0, truth)
    applied, proposed = points
    assert (applied.role, proposed.role) == ("applied", "proposed")
    assert applied.error() == pytest.approx(0.2)
    assert proposed.error() == pytest.approx(0.2)
    assert applied.observed_rate == pytest.approx(2.9)
    # The Service sent ~3 req/s to each pod, above the applied knobs' true 2.0: overloaded.
    assert applied.arrival_rate == pytest.approx(3.0, rel=0.2)
    assert applied.overloaded and proposed.overloaded
    calm = FakeTruth({A: 10.0, B: 5.0})
    (a2, _) = methods._predictions(decision, snap, w, pods, since, 300.0, calm)
    assert a2.overloaded is False
    empty = Decision("hold", "test", TuningState.initial(A))
    assert methods._predictions(empty, snap, w, pods, since, 300.0, truth) == []


def _row(goodput: float, failed_tuning: int, vm: int, vm_exact: int) -> dict[str, Any]:
    return {
        "goodput": goodput,
        "failed_tuning": failed_tuning,
        "failed_tuning_pct": 100.0 * failed_tuning / 100_000,
        "violation_minutes": vm,
        "violation_minutes_exact": vm_exact,
        "ratio": 1.0,
        "trials": 2,
        "crash_left_standing": False,
    }


def _result(ours: dict[str, Any], preds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "scenario": "s1",
        "methods": {
            "defaults": _row(10.0, 0, 30, 30),
            "bo30": _row(10.0, 0, 30, 30),
            "oracle-static": _row(10.0, 0, 5, 5),
            "ours": ours,
        },
        "ours_trace": {"predictions": preds},
    }


def _point(role: str, err: float, overloaded: bool) -> dict[str, Any]:
    return {"role": role, "true": 10.0, "error": err, "overloaded": overloaded}


def test_verdict_passes_a_harmless_run_and_names_each_harm() -> None:
    preds = [_point("applied", 0.05, False), _point("applied", -0.08, True),
             _point("proposed", 0.2, False)]  # fmt: skip
    good = _result(_row(10.5, 50, 18, 12), preds)
    lines = report.verdict([good])
    assert all("NOT MET" not in line for line in lines), lines
    harmful = copy.deepcopy(good)
    harmful["methods"]["ours"] = {**_row(9.0, 500, 18, 25), "failed_tuning_late": 420}
    text = "\n".join(report.verdict([harmful]))
    assert "defaults' on every scenario: NOT MET: s1 (9.00 < 10.00)" in text
    assert "every search baseline's: NOT MET" in text
    assert (
        "0.1% of arrivals: NOT MET: s1 (500 = 0.500%, 420 of them aborted after missing the "
        "TTFT threshold)" in text
    )
    assert "within 15 of oracle-static where the defaults violate: NOT MET: s1 (25" in text
    bad_model = _result(_row(10.5, 0, 10, 10), [_point("applied", 0.5, True)])
    assert any(
        line.startswith("model capacity error") and "NOT MET" in line
        for line in report.verdict([bad_model])
    )


def test_accuracy_summary_separates_roles_and_flags_overload() -> None:
    preds = [_point("applied", 0.05, False), _point("applied", -0.30, True),
             _point("applied", 0.10, False), _point("proposed", 0.2, False),
             {"role": "proposed", "true": 0.0, "error": None, "overloaded": False}]  # fmt: skip
    lines = report.accuracy([_result(_row(10, 0, 1, 1), preds)])
    applied = next(line for line in lines if "applied" in line)
    assert "3 decisions" in applied and "median 10%" in applied and "worst 30%" in applied
    assert "1 in overloaded windows: median 30%, worst 30%" in applied
    proposed = next(line for line in lines if "proposed" in line)
    assert "(1 with true capacity 0, left out)" in proposed
    assert "median 20%" in proposed
    none = report.accuracy([_result(_row(10, 0, 1, 1), [])])
    assert "no predictions recorded" in none[0]


def test_the_table_shows_gpu_hours_and_reads_results_without_them() -> None:
    row = {**_row(10.0, 0, 1, 1), "final": {"maxNumBatchedTokens": 512, "maxNumSeqs": 64,
           "gpuMemoryUtilization": 0.9}, "goodput_vs_defaults": 1.0, "tuning_minutes": 0,
           "rollbacks": 0, "trial_crashes": 0, "live_crashes": 0, "failed_requests": 0}  # fmt: skip
    oracle = {"knobs": row["final"], "capacity": 2.0, "grid_size": 4}
    hours = {**row, "gpu_hours": 3.25, "gpu_hours_vs_defaults": 1.083}
    text = report.table([{"scenario": "s1", "oracle": oracle, "methods": {"ours": hours}}])
    assert "GPU-hours (÷ defaults)" in text
    assert "| 3.25 (1.083) |" in text
    widths = {line.count("|") for line in text.splitlines() if line.startswith("|")}
    assert len(widths) == 1, widths  # every row has the header's columns
    old = report.table([{"scenario": "s1", "oracle": oracle, "methods": {"ours": row}}])
    assert "| n/a | 2 |" in old
