"""Synthetic workloads: distributions, determinism, rate profiles, prefixes, summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.unit.sim.fake_engine import FakeEngine
from vllm_sim.types import EngineConfig, RequestRecord
from vllm_sim.workload import (
    PRESETS,
    LengthDist,
    RateProfile,
    Slo,
    WorkloadSpec,
    arrival_times,
    run_virtual,
    summarize,
)


def spec(**kwargs: object) -> WorkloadSpec:
    return WorkloadSpec.from_dict(kwargs)


def test_same_spec_same_requests_and_the_seed_matters() -> None:
    a = spec(preset="chat", rate=5, duration=100, seed=3, prefix={"ratio": 0.2, "groups": 3})
    b = spec(preset="chat", rate=5, duration=100, seed=3, prefix={"ratio": 0.2, "groups": 3})
    c = spec(preset="chat", rate=5, duration=100, seed=4, prefix={"ratio": 0.2, "groups": 3})
    assert a.generate() == b.generate()
    assert a.generate() != c.generate()


def test_requests_are_sorted_and_inside_the_horizon() -> None:
    requests = spec(rate=10, duration=50, seed=1).generate()
    times = [r.arrival_time for r in requests]
    assert times == sorted(times)
    assert times[0] >= 0 and times[-1] < 50
    assert len({r.request_id for r in requests}) == len(requests)


def test_poisson_count_and_dispersion() -> None:
    rate, duration = 20.0, 500.0
    times = arrival_times(RateProfile("constant", rate), duration, np.random.default_rng(0))
    expected = rate * duration
    assert abs(len(times) - expected) < 4 * math.sqrt(expected)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV = 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_changes_dispersion_not_rate(burstiness: float) -> None:
    rate, duration = 20.0, 500.0
    rng = np.random.default_rng(1)
    times = arrival_times(RateProfile("constant", rate), duration, rng, burstiness)
    gaps = np.diff(times)
    assert len(times) == pytest.approx(rate * duration, rel=0.06)
    # Gamma(shape k): coefficient of variation 1/sqrt(k).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def _numeric_integral(profile: RateProfile, t0: float, t1: float) -> float:
    grid = np.linspace(t0, t1, 200_001)
    return float(np.trapezoid(profile.rate_at(grid), grid))


@pytest.mark.parametrize(
    "rate",
    [
        {"steps": [[0, 5], [100, 20], [150, 0]]},
        {"ramp": {"from": 1, "to": 30}},
        {"diurnal": {"mean": 15, "amplitude": 0.8, "period": 80, "phase": 0.5}},
        {"constant": 12},
    ],
)
def test_rate_profiles_integrate_to_the_expected_counts(rate: dict[str, object]) -> None:
    duration = 200.0
    workload = spec(rate=rate, duration=duration, seed=5)
    profile = workload.rate
    for t0, t1 in [(0, duration), (0, 50), (50, 120), (120, duration)]:
        assert profile.expected_count(t0, t1) == pytest.approx(
            _numeric_integral(profile, t0, t1), rel=1e-3, abs=1e-3
        )
    times = np.array([r.arrival_time for r in workload.generate()])
    for t0, t1 in [(0, duration), (0, 50), (50, 120), (120, duration)]:
        expected = _numeric_integral(profile, t0, t1)
        observed = np.count_nonzero((times >= t0) & (times < t1))
        assert abs(observed - expected) <= 4 * math.sqrt(expected) + 2, (t0, t1)


def test_no_arrivals_where_the_rate_is_zero() -> None:
    workload = spec(rate={"steps": [[0, 0], [50, 10], [100, 0]]}, duration=150, seed=2)
    times = np.array([r.arrival_time for r in workload.generate()])
    assert len(times) > 0
    assert np.all((times >= 50 - 0.05) & (times < 100 + 0.05))


@pytest.mark.parametrize(
    "dist",
    [
        LengthDist("lognormal", 600, 0.8),
        LengthDist("lognormal", 250, 0.3),
        LengthDist("uniform", 150, 0, 100, 200),
        LengthDist("fixed", 512),
    ],
)
def test_length_distributions_have_their_mean(dist: LengthDist) -> None:
    values = dist.sample(np.random.default_rng(0), 50_000)
    assert values.mean() == pytest.approx(dist.mean, rel=0.02)
    assert values.min() >= 1


def test_lengths_are_clipped() -> None:
    dist = LengthDist.parse(
        {"dist": "lognormal", "mean": 1000, "sigma": 1.5, "min": 50, "max": 2000}
    )
    values = dist.sample(np.random.default_rng(0), 10_000)
    assert values.min() >= 50 and values.max() <= 2000
    assert {50, 2000} <= set(values.tolist())  # sigma is wide enough to hit both bounds


@pytest.mark.parametrize(
    ("preset", "prompt_range", "output_range"),
    [
        ("chat", (450, 750), (200, 300)),
        ("rag", (3000, 6000), (100, 200)),
        ("code", (1200, 1800), (320, 480)),
        ("reasoning", (800, 1200), (1200, 1800)),
    ],
)
def test_presets_have_the_advertised_shapes(
    preset: str, prompt_range: tuple[int, int], output_range: tuple[int, int]
) -> None:
    requests = spec(preset=preset, rate=50, duration=100, seed=0).generate()
    prompts = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.max_tokens for r in requests])
    assert prompt_range[0] <= prompts.mean() <= prompt_range[1]
    assert output_range[0] <= outputs.mean() <= output_range[1]
    assert set(PRESETS) == {"chat", "rag", "code", "reasoning"}


def test_shared_prefix_groups() -> None:
    ratio, groups = 0.25, 4
    workload = spec(
        prompt={"dist": "uniform", "min": 400, "max": 800},
        output=32,
        rate=20,
        duration=100,
        prefix={"ratio": ratio, "groups": groups},
    )
    requests = workload.generate()
    assert {r.prefix_id for r in requests} == {f"workload-prefix-{g}" for g in range(groups)}
    assert all(0 < r.prefix_len < r.prompt_len for r in requests)
    # One system prompt per group: the same length within the group.
    for group in {r.prefix_id for r in requests}:
        assert len({r.prefix_len for r in requests if r.prefix_id == group}) == 1
    shared = sum(r.prefix_len for r in requests) / sum(r.prompt_len for r in requests)
    assert shared == pytest.approx(ratio, rel=0.05)


def test_no_prefix_by_default() -> None:
    requests = spec(rate=5, duration=20).generate()
    assert all(r.prefix_id is None and r.prefix_len == 0 for r in requests)


def test_max_requests_bounds_the_count() -> None:
    assert len(spec(rate=100, duration=100, max_requests=37).generate()) == 37


@pytest.mark.parametrize(
    "bad",
    [
        {"rate": 1, "colour": "blue"},
        {"preset": "poetry"},
        {"rate": {"sawtooth": 3}},
        {"prompt": {"dist": "pareto", "mean": 3}},
        {"prefix": {"ratio": 1.5}},
    ],
)
def test_bad_specs_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        WorkloadSpec.from_dict(bad)


def record(ttft: float, e2e: float, tokens: int, arrival: float = 0.0) -> RequestRecord:
    first = arrival + ttft
    finish = arrival + e2e
    gap = (finish - first) / (tokens - 1)
    return RequestRecord(
        request_id=f"r{arrival}",
        arrival_time=arrival,
        prompt_len=100,
        output_len=tokens,
        max_tokens=tokens,
        first_scheduled_time=arrival,
        first_token_time=first,
        finish_time=finish,
        finish_reason="length",
        itl=[gap] * (tokens - 1),
    )


def test_summary_percentiles_throughput_and_goodput() -> None:
    records = [record(0.1, 1.1, 11), record(0.2, 2.2, 11, 1.0), record(0.3, 1.3, 11, 2.0)]
    records.append(record(0.4, 4.4, 11, 3.0))
    summary = summarize(records, duration=10.0, slo=Slo(ttft=0.25, tpot=0.15))
    assert summary.ttft["p50"] == pytest.approx(0.25)
    assert summary.ttft["mean"] == pytest.approx(0.25)
    assert summary.request_throughput == pytest.approx(4 / 10.0)
    assert summary.output_token_throughput == pytest.approx(44 / 10.0)
    # tpot = (e2e - ttft) / 10: 0.1, 0.2, 0.1, 0.4; good = ttft <= 0.25 and tpot <= 0.15 -> 1.
    assert summary.goodput == pytest.approx(1 / 10.0)
    assert summary.slo_attainment == pytest.approx(1 / 4)
    assert summary.itl["p50"] == pytest.approx(np.median([0.1] * 20 + [0.2] * 10 + [0.4] * 10))
    assert "ttft" in summary.table()


def test_run_virtual_finishes_every_request() -> None:
    engine = FakeEngine(EngineConfig(model="m", max_num_seqs=4), step_s=0.01)
    workload = spec(
        prompt=100, output={"dist": "uniform", "min": 2, "max": 20}, rate=50, duration=4
    )
    requests = workload.generate()
    calls: list[tuple[float, int, int]] = []
    records = run_virtual(engine, workload, progress=lambda *a: calls.append(a), progress_every=0.5)
    assert sorted(r.request_id for r in records) == sorted(r.request_id for r in requests)
    by_id = {r.request_id: r for r in requests}
    for rec in records:
        assert rec.output_len == by_id[rec.request_id].max_tokens
        assert rec.arrival_time == by_id[rec.request_id].arrival_time
        assert rec.ttft is not None and rec.ttft >= engine.step_s - 1e-9
    assert calls and calls[-1][2] == len(requests)
    assert not engine.has_unfinished()
