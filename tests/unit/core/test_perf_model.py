"""Performance models: calibration reproduces what was seen; knobs move predictions right.

The analytic model is checked for directions and consistency; the engine-backed model against
the engine's own ground truth under efficiencies it cannot see.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime

import numpy as np
import pytest

from tests.unit.core.test_decide import CTX, KNOBS, SLO_DEFAULT, make_snapshot
from vllm_autotuner.core import perf_model as pm
from vllm_autotuner.core.perf_model import AnalyticModel, Calibration, EngineModel, Workload
from vllm_autotuner.core.snapshot import KVCacheInfo, LatencySummary, LengthSummary, Snapshot
from vllm_autotuner.core.steady_state import Knobs3, steady_state
from vllm_autotuner.core.tuning_types import (
    SLO,
    DeploymentContext,
    Knobs,
    RolloutSettings,
    SLOTarget,
)
from vllm_sim.engine import Engine
from vllm_sim.types import EngineConfig, Reality
from vllm_sim.workload import LengthDist, WorkloadSpec


def calibrated(**snap_kw: object) -> tuple[AnalyticModel, Workload, Calibration]:
    snap = make_snapshot(**snap_kw)  # type: ignore[arg-type]
    model = AnalyticModel()
    w = Workload.from_snapshot(snap, SLO_DEFAULT, 0.9)
    return model, w, model.calibrate(snap, KNOBS, CTX, w, None)


def test_calibration_reproduces_the_observed_itl_and_ttft() -> None:
    model, w, cal = calibrated(itl_p95=45.0, itl_mean=22.0, ttft_p95=600.0)
    assert cal.fitted
    assert cal.fit_error is not None and cal.fit_error < 0.05
    # At the batch the window ran (the running gauge), not Little's law's: engine physics.
    st = steady_state(
        pm._traffic(w, w.request_rate),
        Knobs3(KNOBS.max_num_batched_tokens, KNOBS.max_num_seqs, model._kv(KNOBS, cal)),
        model._curve_at(cal),
        pm._costs(cal),
        running=make_snapshot().running_mean,
    )
    assert st.itl_mean_s * 1000 == pytest.approx(22.0, rel=0.05)
    # What the engine cannot explain of the median TTFT is the API overhead.
    assert st.ttft(0.5) * 1000 == pytest.approx(600.0 / 3.0, rel=0.05)


def test_smaller_token_budget_shortens_steps_but_lengthens_prefill() -> None:
    model, w, cal = calibrated(itl_p95=45.0, itl_mean=22.0)
    big, small = (
        model.predict(KNOBS, w, cal),
        model.predict(Knobs(512, 256, KNOBS.gpu_memory_utilization), w, cal),
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
    """Capacity is at the SLO's own thresholds (the margin only gates proposals)."""
    model, w, cal = calibrated()
    raw = replace(w, safety_margin=1.0)
    cap = model.predict(KNOBS, raw, cal).capacity_rps
    assert cap > 0
    assert model.predict(KNOBS, raw.at_rate(cap * 0.95), cal).meets_slo
    assert not model.predict(KNOBS, raw.at_rate(cap * 1.1), cal).meets_slo


def test_knobs_vllm_would_not_start_with_are_infeasible() -> None:
    model, w, cal = calibrated()
    # 0.2 of 80 GiB cannot hold 16 GB of weights; a budget below max_num_seqs is refused.
    for knobs in (replace(KNOBS, gpu_memory_utilization=0.2), Knobs(512, 1024, 0.92)):
        p = model.predict(knobs, w, cal)
        assert not p.feasible and p.capacity_rps == 0.0 and math.isinf(p.slo_ratio)
        assert "would not start" in p.reason


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
    prior = Calibration(bandwidth=0.8, compute=0.7)
    snap = replace(make_snapshot(), itl=replace(make_snapshot().itl, mean_ms=None, p50_ms=None))
    w = Workload.from_snapshot(snap, SLO(itl=SLOTarget(95, 50)), 0.9)
    cal = AnalyticModel().calibrate(snap, KNOBS, CTX, w, prior)
    assert (cal.bandwidth, cal.compute) == (0.8, 0.7)
    assert not cal.fitted


# ----------------------------------------------------------------- engine-backed model


MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# What the tuner cannot see: this deployment runs slower than the catalog GPU and spends CPU
# time on every admission.
HIDDEN = Reality(bandwidth_efficiency=0.7, compute_efficiency=0.6, per_request_overhead_s=0.002)
ENGINE_CTX = DeploymentContext(
    model=MODEL,
    gpu_product="NVIDIA-H100-80GB-HBM3",
    max_model_len=8192,
    rollout=RolloutSettings(max_surge=1),
)
RATE = 8.0


def ground_truth(
    knobs: Knobs, rate: float = RATE, n: int = 600, prompt_mean: float = 1000.0
) -> Snapshot:
    """Run the engine with hidden efficiencies and summarise it as Prometheus would."""
    spec = WorkloadSpec(
        prompt=LengthDist("lognormal", prompt_mean, 0.6, 16, 6000),
        output=LengthDist("lognormal", 200, 0.5, 4, 2000),
        duration=n / rate,
        seed=3,
        max_requests=n,
    ).with_rate(rate)
    config = EngineConfig(
        model=MODEL,
        gpu="H100",
        max_num_batched_tokens=knobs.max_num_batched_tokens,
        max_num_seqs=knobs.max_num_seqs,
        gpu_memory_utilization=knobs.gpu_memory_utilization,
        max_model_len=8192,
    )
    engine = Engine(config, HIDDEN, seed=1)
    recs = engine.run(spec.generate())
    ttft = np.array([r.ttft for r in recs if r.ttft is not None]) * 1000
    itl = np.concatenate([np.asarray(r.itl) for r in recs]) * 1000
    e2e = np.array([r.e2e for r in recs]) * 1000
    prompts = np.array([r.prompt_len for r in recs], dtype=float)
    outputs = np.array([r.output_len for r in recs], dtype=float)
    arrivals = max(r.arrival_time for r in recs) - min(r.arrival_time for r in recs)

    def lat(a: np.ndarray) -> LatencySummary:
        p50, p90, p95, p99 = (float(x) for x in np.percentile(a, [50, 90, 95, 99]))
        return LatencySummary(p50, p90, p95, p99, None, float(a.mean()))

    return Snapshot(
        time=datetime(2026, 12, 2, tzinfo=UTC),
        window_s=arrivals,
        knobs=knobs,
        request_rate=len(recs) / arrivals,
        completed_requests=len(recs),
        ttft=lat(ttft),
        itl=lat(itl),
        e2e=lat(e2e),
        prompt_len=LengthSummary(float(prompts.mean()), *np.percentile(prompts, [50, 90])),
        generation_len=LengthSummary(float(outputs.mean()), *np.percentile(outputs, [50, 90])),
        kv_cache=KVCacheInfo(
            num_gpu_blocks=engine.kv.num_gpu_blocks,
            block_size=engine.kv.block_size,
            kv_cache_size_tokens=engine.kv.kv_cache_size_tokens,
            gpu_memory_utilization=knobs.gpu_memory_utilization,
            kv_cache_memory_bytes=engine.kv.kv_cache_memory_bytes,
        ),
    )


@pytest.fixture(scope="module")
def engine_calibrated() -> tuple[EngineModel, Workload, Calibration]:
    observed_at = Knobs(8192, 256, 0.9)
    snap = ground_truth(observed_at)
    model = EngineModel()
    w = Workload.from_snapshot(snap, SLO_DEFAULT, 0.9)
    return model, w, model.calibrate(snap, observed_at, ENGINE_CTX, w, None)


@pytest.mark.parametrize("knobs", [Knobs(2048, 256, 0.9), Knobs(1024, 128, 0.9)])
def test_engine_model_predicts_the_engines_ground_truth_at_other_knobs(
    engine_calibrated: tuple[EngineModel, Workload, Calibration], knobs: Knobs
) -> None:
    model, w, cal = engine_calibrated
    assert cal.extra["bandwidth_efficiency"] != 1.0  # it did learn something
    predicted = model.predict(knobs, w, cal)
    truth = ground_truth(knobs)
    assert truth.itl.p95_ms is not None and truth.ttft.p95_ms is not None
    assert predicted.itl_ms == pytest.approx(truth.itl.p95_ms, rel=0.15)
    assert predicted.ttft_ms == pytest.approx(truth.ttft.p95_ms, rel=0.15)


def test_engine_model_capacity_is_the_edge_of_the_slo(
    engine_calibrated: tuple[EngineModel, Workload, Calibration],
) -> None:
    model, w, cal = engine_calibrated
    relaxed = replace(w, slo=SLO(ttft=SLOTarget(95, 1000), itl=SLOTarget(95, 100)))
    p = model.predict(Knobs(2048, 256, 0.9), relaxed, cal)
    assert p.feasible and p.capacity_rps >= relaxed.request_rate
    above = model.predict(Knobs(2048, 256, 0.9), relaxed.at_rate(p.capacity_rps * 2.2), cal)
    assert not above.meets_slo


def test_engine_model_reports_configs_that_cannot_start(
    engine_calibrated: tuple[EngineModel, Workload, Calibration],
) -> None:
    model, w, cal = engine_calibrated
    p = model.predict(Knobs(8192, 256, 0.12), w, cal)  # weights alone need more than 12%
    assert not p.feasible and p.capacity_rps == 0.0


def test_engine_model_falls_back_to_the_analytic_model_off_catalog() -> None:
    snap = make_snapshot()
    ctx = DeploymentContext(model="acme/unknown-model", gpu_product="H100")
    w = Workload.from_snapshot(snap, SLO_DEFAULT, 0.9)
    em, am = EngineModel(), AnalyticModel()
    cal_e = em.calibrate(snap, KNOBS, ctx, w, None)
    cal_a = am.calibrate(snap, KNOBS, ctx, w, None)
    assert cal_e == cal_a
    assert em.predict(KNOBS, w, cal_e) == am.predict(KNOBS, w, cal_a)
