"""The analytic performance model: calibration reproduces what was seen; knobs move it right."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tests.unit.core.test_decide import CTX, KNOBS, SLO_DEFAULT, make_snapshot
from vllm_autotuner.core.perf_model import AnalyticModel, Calibration, Workload
from vllm_autotuner.core.snapshot import KVCacheInfo
from vllm_autotuner.core.tuning_types import SLO, SLOTarget


def calibrated(**snap_kw: object) -> tuple[AnalyticModel, Workload, Calibration]:
    snap = make_snapshot(**snap_kw)  # type: ignore[arg-type]
    model = AnalyticModel()
    w = Workload.from_snapshot(snap, SLO_DEFAULT, 0.9)
    return model, w, model.calibrate(snap, KNOBS, CTX, w, None)


def test_calibration_reproduces_the_observed_itl_and_ttft() -> None:
    model, w, cal = calibrated(itl_p95=45.0, itl_mean=22.0, ttft_p95=600.0)
    assert cal.fitted
    p = model.predict(KNOBS, w, cal)
    assert p.itl_ms == pytest.approx(45.0, rel=0.05)
    st = model._steady(KNOBS, w, cal)
    assert st.step_s * 1000 == pytest.approx(22.0, rel=0.05)
    # The median TTFT is matched through the per-request overhead.
    ttft50 = model._latencies(KNOBS, w, cal, percentile_override=50.0)[0] * 1000
    assert ttft50 == pytest.approx(600.0 / 3.0, rel=0.05)


def test_smaller_token_budget_shortens_steps_but_lengthens_prefill() -> None:
    model, w, cal = calibrated(itl_p95=45.0, itl_mean=22.0)
    big, small = (
        model.predict(KNOBS, w, cal),
        model.predict(replace(KNOBS, max_num_batched_tokens=512), w, cal),
    )
    assert small.itl_ms < big.itl_ms
    assert small.ttft_ms > big.ttft_ms


def test_more_memory_means_more_kv_and_no_less_capacity() -> None:
    model, w, cal = calibrated(kv_max=0.95, preemption_rate=0.3)
    lo = model.predict(replace(KNOBS, gpu_memory_utilization=0.85), w, cal)
    hi = model.predict(replace(KNOBS, gpu_memory_utilization=0.94), w, cal)
    assert lo.kv_capacity_tokens is not None and hi.kv_capacity_tokens is not None
    assert hi.kv_capacity_tokens > lo.kv_capacity_tokens
    assert hi.capacity_rps >= lo.capacity_rps


def test_fewer_sequences_cap_capacity() -> None:
    model, w, cal = calibrated()
    few = model.predict(replace(KNOBS, max_num_seqs=16), w, cal)
    many = model.predict(KNOBS, w, cal)
    assert few.capacity_rps < many.capacity_rps


def test_capacity_is_the_edge_of_meeting_the_slo() -> None:
    model, w, cal = calibrated()
    cap = model.predict(KNOBS, w, cal).capacity_rps
    assert cap > 0
    assert model.predict(KNOBS, w.at_rate(cap * 0.95), cal).meets_slo
    assert not model.predict(KNOBS, w.at_rate(cap * 1.1), cal).meets_slo


def test_a_kv_cache_too_small_for_one_request_is_infeasible() -> None:
    model, w, cal = calibrated()
    gib = 2**30
    # 42 GiB of weights and activations on an 80 GiB GPU: at 0.5 nothing is left for KV.
    cal = replace(cal, kv_bytes_per_token=131072, gpu_memory_bytes=80 * gib,
                  observed_kv_tokens=30 * gib / 131072, observed_gmu=0.9)  # fmt: skip
    p = model.predict(replace(KNOBS, gpu_memory_utilization=0.5), w, cal)
    assert not p.feasible and p.capacity_rps == 0.0 and math.isinf(p.slo_ratio)


def test_kv_capacity_follows_memory_with_known_bytes_per_token() -> None:
    # 8B on 80 GiB: 128 KiB per token; 30 GiB of KV observed at 0.9 utilisation.
    gib = 2**30
    cal = Calibration(
        kv_bytes_per_token=131072,
        gpu_memory_bytes=80 * gib,
        observed_kv_tokens=30 * gib / 131072,
        observed_gmu=0.9,
    )
    # Non-KV memory is 0.9 * 80 - 30 = 42 GiB; at 0.95 KV gets 76 - 42 = 34 GiB.
    kv = cal.kv_tokens_at(0.95)
    assert kv is not None
    assert kv == pytest.approx(34 * gib / 131072)


def test_kv_bytes_come_from_cache_config_when_exposed() -> None:
    snap = make_snapshot(
        kv_cache=KVCacheInfo(
            kv_cache_size_tokens=200_000,
            kv_cache_memory_bytes=200_000 * 65536,
            gpu_memory_utilization=0.92,
        )
    )
    model = AnalyticModel()
    w = Workload.from_snapshot(snap, SLO_DEFAULT, 0.9)
    cal = model.calibrate(snap, KNOBS, CTX, w, None)
    assert cal.kv_bytes_per_token == pytest.approx(65536)
    assert cal.observed_kv_tokens == 200_000


def test_calibration_round_trips_through_status() -> None:
    _, _, cal = calibrated()
    assert Calibration.from_dict(cal.to_dict()) == cal


def test_without_itl_the_prior_is_kept() -> None:
    prior = Calibration(step_scale=2.5, compute_scale=0.7)
    snap = replace(make_snapshot(), itl=replace(make_snapshot().itl, mean_ms=None, p50_ms=None))
    w = Workload.from_snapshot(snap, SLO(itl=SLOTarget(95, 50)), 0.9)
    cal = AnalyticModel().calibrate(snap, KNOBS, CTX, w, prior)
    assert (cal.step_scale, cal.compute_scale) == (2.5, 0.7)
    assert not cal.fitted
