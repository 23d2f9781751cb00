"""Diagnosis on synthetic snapshots: the right bottleneck, the right knob, the right direction."""

from __future__ import annotations

import pytest

from tests.unit.core.test_decide import KNOBS, SLO_DEFAULT, make_snapshot
from vllm_autotuner.core.diagnosis import diagnose
from vllm_autotuner.core.tuning_types import SLO, Knobs, SLOTarget


def test_too_little_traffic_is_idle() -> None:
    d = diagnose(make_snapshot(completed=37, rate=0.1), SLO_DEFAULT, KNOBS, min_requests=200)
    assert d.kind == "idle"
    assert "37 requests" in d.evidence
    assert (d.directions.mnbt, d.directions.mns, d.directions.gmu) == (0, 0, 0)


def test_full_kv_with_preemptions_is_kv_bound() -> None:
    snap = make_snapshot(kv_max=0.97, preemption_rate=0.5)
    d = diagnose(snap, SLO_DEFAULT, KNOBS)
    assert d.kind == "kv_bound"
    assert "97%" in d.evidence and "0.50 preemptions/s" in d.evidence
    assert d.directions.gmu == +1 and d.directions.mns == -1


def test_full_kv_without_preemptions_is_not_kv_bound() -> None:
    d = diagnose(make_snapshot(kv_max=0.97), SLO_DEFAULT, KNOBS)
    assert d.kind == "healthy"


def test_itl_over_slo_is_decode_latency_bound() -> None:
    d = diagnose(make_snapshot(itl_p95=80.0), SLO_DEFAULT, KNOBS)
    assert d.kind == "decode_latency_bound"
    assert "ITL p95 80 ms > 50 ms" in d.evidence
    assert d.directions.mnbt == -1 and d.directions.mns == -1
    assert d.violates_slo


def test_ttft_over_slo_with_itl_headroom_is_prefill_bound() -> None:
    d = diagnose(make_snapshot(ttft_p95=3000.0, itl_p95=20.0), SLO_DEFAULT, KNOBS)
    assert d.kind == "prefill_bound"
    assert "TTFT p95 3000 ms > 1000 ms" in d.evidence
    assert d.directions.mnbt == +1


def test_ttft_over_slo_without_itl_headroom_is_not_prefill_bound() -> None:
    d = diagnose(make_snapshot(ttft_p95=3000.0, itl_p95=48.0), SLO_DEFAULT, KNOBS)
    assert d.kind != "prefill_bound"
    assert d.directions.mnbt != +1


def test_running_at_max_num_seqs_with_a_queue_is_concurrency_bound() -> None:
    knobs = Knobs(8192, 256, 0.92)
    snap = make_snapshot(knobs, running_max=256.0, waiting_mean=12.0, ttft_p95=2500.0)
    d = diagnose(snap, SLO_DEFAULT, knobs)
    assert d.kind == "concurrency_bound"
    assert "maxNumSeqs=256" in d.evidence
    assert d.directions.mns == +1


def test_concurrency_bound_needs_kv_room() -> None:
    knobs = Knobs(8192, 256, 0.92)
    snap = make_snapshot(knobs, running_max=256.0, waiting_mean=12.0, kv_max=0.95)
    assert diagnose(snap, SLO_DEFAULT, knobs).kind != "concurrency_bound"


def test_healthy_and_the_percentile_the_slo_names() -> None:
    assert diagnose(make_snapshot(), SLO_DEFAULT, KNOBS).kind == "healthy"
    # A p99 SLO is judged at p99 (make_snapshot puts TTFT p99 at 1.5 x p95).
    slo = SLO(ttft=SLOTarget(99.0, 500.0))
    d = diagnose(make_snapshot(ttft_p95=400.0), slo, KNOBS)
    assert d.violations and d.violations[0][1] == 600.0


def test_histogram_maths_matches_promql_interpolation() -> None:
    """Percentiles and attainment from cumulative buckets, as histogram_quantile computes them."""
    from vllm_autotuner.core.snapshot import fraction_below, histogram_quantile

    buckets = [(0.1, 10.0), (0.5, 60.0), (1.0, 90.0), (float("inf"), 100.0)]
    # Rank 50 falls 40/50 of the way through (0.1, 0.5].
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 40 / 50)
    # Rank 95 is in +Inf: PromQL answers the largest finite bound.
    assert histogram_quantile(0.95, buckets) == 1.0
    assert fraction_below(0.3, buckets) == pytest.approx((10 + 50 * 0.5) / 100)
    assert fraction_below(2.0, buckets) == pytest.approx(0.9)
    assert histogram_quantile(0.5, []) is None and fraction_below(1.0, [(1.0, 0.0)]) is None
