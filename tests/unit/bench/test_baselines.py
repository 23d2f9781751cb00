"""Fair search baselines (issue 19): no trial on a configuration vLLM refuses to start, and
benchmark runs sized by time so that long outputs reach steady state."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from bench.tuning import methods, truth
from bench.tuning.scenario import Scenario, load, parse

from vllm_autotuner.core.tuning_types import Knobs

BASE: dict[str, Any] = {
    "name": "baselines-test",
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "gpu": "H100",
    "max_model_len": 8192,
    "replicas": 1,
    "workload": {"preset": "chat", "rate": 2.0},
    "slo": {
        "ttft": {"percentile": 95, "threshold_ms": 1000},
        "itl": {"percentile": 95, "threshold_ms": 60},
    },
    # A budget range that reaches below the sequence range: half the space is refused.
    "bounds": {
        "max_num_batched_tokens": {"min": 64, "max": 2048},
        "max_num_seqs": {"min": 16, "max": 1024},
    },
}


def scenario(**over: Any) -> Scenario:
    return parse({**BASE, **over})


@pytest.mark.parametrize(
    ("knobs", "refused"),
    [
        (Knobs(512, 512, 0.9), False),
        (Knobs(511, 512, 0.9), True),  # SchedulerConfig: budget below max_num_seqs
        (Knobs(512, 16, 1.0), False),
        (Knobs(512, 16, 1.01), True),  # CacheConfig: utilisation above 1
        (Knobs(512, 0, 0.9), True),
    ],
)
def test_vllm_refuses_what_its_startup_checks_refuse(knobs: Knobs, refused: bool) -> None:
    assert (methods.vllm_refuses(knobs) is not None) == refused


def test_random_draws_never_land_on_a_refused_configuration() -> None:
    space = methods.Space(scenario().bounds)
    rng = np.random.default_rng(5)
    raw = [space.knobs(u) for u in rng.random((400, 3))]
    # The unfiltered space does hold refused points (so the filter below is doing something).
    assert sum(methods.vllm_refuses(k) is not None for k in raw) > 50
    draws = [methods.startable(space, rng) for _ in range(400)]
    assert all(methods.vllm_refuses(k) is None for k in draws)
    assert len({(k.max_num_batched_tokens, k.max_num_seqs) for k in draws}) > 100


def test_bo_candidates_are_filtered_to_startable_ones() -> None:
    space = methods.Space(scenario().bounds)
    units = np.random.default_rng(9).random((2000, 3))
    kept = methods.startable_units(space, units)
    assert 0 < len(kept) < len(units)
    assert all(methods.vllm_refuses(space.knobs(u)) is None for u in kept)


def test_bench_plan_is_sized_by_the_expected_request_latency() -> None:
    chat = truth.bench_plan(scenario())
    reasoning = truth.bench_plan(scenario(workload={"preset": "reasoning", "rate": 0.5}))
    # chat: ~250 output tokens at 60 ms + 1 s; reasoning: ~1500 tokens at 60 ms + 1 s.
    assert chat.expected_e2e_s == pytest.approx(1.0 + 250 * 0.06, rel=0.15)
    assert reasoning.expected_e2e_s == pytest.approx(1.0 + 1500 * 0.06, rel=0.15)
    for plan in (chat, reasoning):
        assert plan.warmup_s >= 2 * plan.expected_e2e_s
        assert plan.measure_s >= 3 * plan.expected_e2e_s
        assert plan.cooldown_s >= plan.expected_e2e_s
    with_e2e = scenario(slo={"e2e": {"percentile": 90, "threshold_ms": 20000}})
    assert truth.bench_plan(with_e2e).expected_e2e_s == pytest.approx(20.0)


def test_a_time_sized_run_judges_only_the_steady_window() -> None:
    s = scenario(workload={"preset": "reasoning", "rate": 0.5})
    plan = truth.BenchPlan(
        expected_e2e_s=30.0, warmup_s=60.0, measure_s=90.0, cooldown_s=30.0, min_requests=20
    )
    rate = 1.0
    v = truth.run_for(s, Knobs(2048, 256, 0.9), rate, 4, plan)
    assert not v.crashed
    # It ran through the warm-up and the measured window, and stopped once the judged
    # requests were done (not when every cool-down arrival was).
    assert v.seconds >= plan.warmup_s + plan.measure_s
    assert v.seconds < plan.warmup_s + plan.measure_s + plan.cooldown_s + 400
    judged = [
        r
        for r in s.shape(rate, 180, 4).generate()
        if r.arrival_time >= plan.warmup_s and r.arrival_time < plan.warmup_s + plan.measure_s
    ]
    assert len(judged) >= plan.min_requests


def test_the_ground_truth_judges_a_rate_in_steady_state() -> None:
    """bursty-8b-h100's 1024/512/0.96 at 34 req/s: a fixed run of the scenario's 800 requests
    (the old truth: 21 s against ~10 s requests, the batch never full) meets the SLO; in steady
    state it does not (4,000-request runs sustain about 31), and the truth says so. (With
    Poisson arrivals, as the truth had them when this was measured.)"""
    bursty = load("bench/scenarios/bursty-8b-h100.yaml")
    s = dataclasses.replace(bursty, workload={**bursty.workload, "burstiness": 1.0})
    k = Knobs(1024, 512, 0.96)
    assert truth.run_at(s, k, 34.0, s.truth_requests, s.truth_seed).meets
    plan = truth.truth_plan(s)
    assert plan.min_requests == s.truth_requests
    assert not truth.run_for(s, k, 34.0, s.truth_seed, plan).meets
    capacity = truth.Truth(s, cache_dir=None).capacity(k)
    assert 0 < capacity < 34.0
