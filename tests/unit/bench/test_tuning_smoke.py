"""The tuning benchmark's closed loop, end to end on a small deterministic scenario.

Quality is asserted (the operator leaves the deployment with more true capacity under the SLO
than vLLM's defaults), time is not. The PromQL checks pin the Prometheus semantics the loop
relies on with numbers worked out by hand from Prometheus' documented rules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from bench.tuning import methods
from bench.tuning.promsim import TSDB, Evaluator, SimTransport
from bench.tuning.runner import live_stats
from bench.tuning.scenario import Scenario, load, parse
from bench.tuning.truth import Truth
from bench.tuning.world import World

from vllm_autotuner.adapters import promql
from vllm_autotuner.core.tuning_types import Knobs

SMOKE: dict[str, Any] = {
    "name": "smoke-rag-a100",
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "gpu": "A100-80GB",
    "max_model_len": 16384,
    "replicas": 1,
    "load_time_s": 60,
    # One replica restarts without downtime only with surge; without, the tuner waits for
    # headroom (tests/unit/core/test_hitless.py).
    "rollout": {"max_surge": 1},
    "horizon_s": 1500,
    "seed": 3,
    # Long retrieved prompts: vLLM's A100 default budget (2048 tokens) prefills each prompt in
    # several steps, so first tokens come late; the physics says a larger budget helps.
    "workload": {"preset": "rag", "rate": 1.0},
    "slo": {
        "ttft": {"percentile": 95, "threshold_ms": 1500},
        "itl": {"percentile": 95, "threshold_ms": 80},
    },
    "bounds": {
        "max_num_batched_tokens": {"min": 512, "max": 16384, "max_step": 8192},
        "max_num_seqs": {"min": 16, "max": 512, "max_step": 256},
        "gpu_memory_utilization": {"min": 0.8, "max": 0.95, "max_step": 0.05},
    },
    "policy": {
        "evaluation_window_s": 120,
        "verify_window_s": 240,
        "min_interval_s": 300,
        "min_requests_per_window": 50,
    },
    "reality": {"bandwidth_efficiency": 0.92, "compute_efficiency": 0.8, "step_jitter": 0.05},
    "truth": {"requests": 300, "seed": 5},
}


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return parse(SMOKE)


def test_operator_loop_beats_vllm_defaults(scenario: Scenario) -> None:
    defaults = methods.vllm_defaults(scenario)
    world = World(scenario, defaults)
    tuning, trace, _ = methods.run_ours(scenario, world, "analytic", lambda _: None)

    assert world.t == pytest.approx(scenario.horizon_s)
    assert tuning.trials, f"no rollout finished; actions: {trace.actions}"
    assert any(a == "commit" for _, a, _ in trace.actions)
    truth = Truth(scenario, cache_dir=None)
    before, after = truth.capacity(defaults), truth.capacity(tuning.final)
    assert after > before, f"{tuning.final} ({after:.2f}) vs defaults {defaults} ({before:.2f})"
    assert not world.crash_left_standing()
    # The run's numbers are what the users saw: traffic was served and counted.
    assert world.goodput() > 0
    view = world.minute_view()
    assert len(view.violated) == math.ceil(scenario.horizon_s / 60)


def test_world_counts_restarts_and_failures(scenario: Scenario) -> None:
    scenario = dataclasses.replace(
        scenario, rollout=dataclasses.replace(scenario.rollout, max_surge=0)
    )
    defaults = methods.vllm_defaults(scenario)
    world = World(scenario, defaults, horizon_s=600)
    world.advance_to(120)
    other = methods.clamp(Knobs(1024, 128, defaults.gpu_memory_utilization), scenario.bounds)
    world.apply(other)
    world.advance_to(150)
    # One replica, maxSurge 0: the only pod is down while the new one loads.
    assert not any(p.ready for p in world.pod_health())
    world.advance_to(600)
    health = world.pod_health()
    assert all(p.ready and p.revision_knobs == other for p in health)
    assert world.replacements == 1
    assert world.failed() > 0  # arrivals during the restart found no ready pod
    # Without surge no second GPU is ever held: the old pod left before the new one loaded.
    hours = live_stats(world).gpu_hours
    assert 0.0 < hours <= scenario.replicas * 600 / 3600.0 + 1e-9


def test_a_rollout_with_surge_holds_one_more_gpu_while_it_runs(scenario: Scenario) -> None:
    """The surge pod is a GPU the users pay for: GPU-hours count it (bench/tuning's table)."""
    defaults = methods.vllm_defaults(scenario)
    still, rolled = World(scenario, defaults, horizon_s=600), World(scenario, defaults, 600)
    other = methods.clamp(Knobs(1024, 128, defaults.gpu_memory_utilization), scenario.bounds)
    rolled.advance_to(120)
    rolled.apply(other)
    for w in (still, rolled):
        w.advance_to(600)
    assert scenario.rollout.max_surge >= 1
    base, more = live_stats(still).gpu_hours, live_stats(rolled).gpu_hours
    assert base == pytest.approx(scenario.replicas * 600 / 3600.0)
    # At least the new pod's loading time on a GPU beside the old pods.
    assert more >= base + scenario.rollout.load_time_s / 3600.0 - 1e-9


def test_increase_extrapolates_like_prometheus() -> None:
    db = TSDB()
    labels = {"__name__": "c_total", "pod": "a"}
    for t, v in ((5, 10), (20, 20), (35, 30), (50, 40)):
        db.append(labels, t, v)
    ev = Evaluator(db)
    (row,) = ev.query('increase(c_total{pod="a"}[60s])', 60)
    # 2/3 per second over a 60 s window; both gaps to the edges are under 1.1 intervals.
    assert row[1] == pytest.approx(40.0)
    ((labels, rate),) = ev.query('sum by (pod) (rate(c_total{pod=~"a|b"}[60s]))', 60)
    assert labels == {"pod": "a"}
    assert rate == pytest.approx(40.0 / 60)


def test_increase_survives_a_counter_reset() -> None:
    db = TSDB()
    labels = {"__name__": "c_total", "pod": "a"}
    for t, v in ((5, 10), (20, 20), (35, 5), (50, 15)):
        db.append(labels, t, v)
    (row,) = Evaluator(db).query("increase(c_total[60s])", 60)
    # 10 + (restart: 5 counted from 0) + 10 = 25 over 45 s sampled, extrapolated to 60 s.
    assert row[1] == pytest.approx(25 * 60 / 45)


def test_transport_answers_or_and_label_replace() -> None:
    db = TSDB()
    db.append({"__name__": "g", "pod": "a"}, 10, 1.0)
    db.append({"__name__": "g", "pod": "a"}, 20, 3.0)
    expr = (
        'label_replace(avg by (pod) (avg_over_time(g[30s])), "part", "mean", "part", "") or '
        'label_replace(max by (pod) (max_over_time(g[30s])), "part", "max", "part", "")'
    )
    out = asyncio.run(SimTransport(db, offset=1000.0).query(expr, 1020.0))
    got = {(r["metric"]["part"], float(r["value"][1])) for r in out}
    assert got == {("mean", 2.0), ("max", 3.0)}
    with pytest.raises(ValueError):
        Evaluator(db).query("histogram_quantile(0.9, g)", 20)


def _scraped_counts(increments: list[float], pods: tuple[str, ...] = ("a",)) -> TSDB:
    """A first-token counter per pod, scraped every 15 s, growing by `increments`."""
    db = TSDB()
    for pod in pods:
        total = 0.0
        labels = {"__name__": "vllm:time_to_first_token_seconds_count", "pod": pod,
                  "namespace": "ns", "model_name": "m"}  # fmt: skip
        for i, inc in enumerate([0.0, *increments]):
            total += inc
            db.append(labels, 15.0 * i, total)
    return db


def _dispersion_of(db: TSDB, t: float, window_s: int = 300) -> tuple[float | None, int]:
    sel = promql.Selector(namespaces=("ns",), pods=("a", "b"))
    signal = promql.SIGNALS_BY_KEY["arrivals"]
    expr = promql.build_query(signal, ("vllm:time_to_first_token_seconds_count",), sel, window_s)
    samples = promql.parse_vector(asyncio.run(SimTransport(db).query(expr, t)))
    by_pod: dict[str, list[promql.Sample]] = {}
    for s in samples:
        by_pod.setdefault(s.labels["pod"], []).append(s)
    return promql._dispersion(by_pod, window_s)


def test_a_subquery_samples_its_inner_query_at_multiples_of_its_step() -> None:
    db = _scraped_counts([3.0, 5.0, 3.0, 5.0, 3.0, 5.0])  # scrapes at 0, 15, ..., 90 s
    ev = Evaluator(db)
    # idelta at 30, 45, 60, 75, 90 s: the last scrape interval's count, 5, 3, 5, 3, 5.
    ((_, mean),) = ev.query("avg_over_time((idelta(vllm:time_to_first_token_seconds_count"
                            "[60s]))[60s:15s])", 90.0)  # fmt: skip
    assert mean == pytest.approx((5 + 3 + 5 + 3) / 4)  # (30, 90]: 45, 60, 75, 90
    ((_, var),) = ev.query("stdvar_over_time((idelta(vllm:time_to_first_token_seconds_count"
                           "[60s]))[60s:15s])", 90.0)  # fmt: skip
    assert var == pytest.approx(1.0)
    ((_, n),) = ev.query("count_over_time(vllm:time_to_first_token_seconds_count[60s])", 90.0)
    assert n == 5  # 30, 45, 60, 75, 90


def test_the_dispersion_query_tells_poisson_from_bursts() -> None:
    """The adapter's own query on Poisson and on gamma (shape 0.3) arrivals at 10 req/s:
    variance over mean of the counts per scrape near 1 and near the gaps' cv2 (3.3)."""
    rng = np.random.default_rng(7)
    for shape, expected in ((1.0, 1.0), (0.3, 1.0 / 0.3)):
        times = np.cumsum(rng.gamma(shape, 1.0 / (shape * 10.0), size=40_000))
        counts = np.histogram(times, bins=np.arange(0.0, 3601.0, 15.0))[0]
        d, n = _dispersion_of(_scraped_counts([float(c) for c in counts], ("a", "b")), 3600.0)
        assert n == 2 * (20 - 4)  # 20 intervals a pod in 300 s, less 4 segment means
        assert d is not None and d == pytest.approx(expected, rel=0.5)


def test_the_dispersion_of_steady_counts_is_zero_and_a_reset_counts_nothing() -> None:
    d, n = _dispersion_of(_scraped_counts([10.0] * 30), 450.0)
    assert d == pytest.approx(0.0, abs=1e-9) and n == 20 - 4
    db = _scraped_counts([10.0] * 30)
    db.append({"__name__": "vllm:time_to_first_token_seconds_count", "pod": "a",
               "namespace": "ns", "model_name": "m"}, 465.0, 4.0)  # fmt: skip
    d, _ = _dispersion_of(db, 465.0)
    assert d is not None and d < 2.0  # the reset's -296 is clamped to 0, not squared


def test_one_pod_sees_the_bursts_thinned_by_the_routing() -> None:
    s = load("bench/scenarios/bursty-8b-h100.yaml")  # shape 0.3 over 2 pods, at random
    assert s.pod_burstiness() == pytest.approx(1.0 / (0.5 / 0.3 + 0.5))  # cv2 2.17
    one = dataclasses.replace(s, replicas=1)
    assert one.pod_burstiness() == pytest.approx(0.3)
    calm = dataclasses.replace(s, workload={**s.workload, "burstiness": 1.0})
    assert calm.pod_burstiness() == 1.0
    assert calm.truth_key() != s.truth_key()
    spec = s.shape(20.0, 4000, 3)
    gaps = np.diff([r.arrival_time for r in spec.generate()])
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(0.5 / 0.3 + 0.5, rel=0.2)


def test_a_load_step_inside_the_window_is_not_a_burst() -> None:
    """Poisson counts at 10 then 20 req/s, the step inside the window: the segments' means
    say the load moved, and the window tells nothing of burstiness (their variance over mean
    would read about 20). A ramp of a few percent over the window still counts."""
    rng = np.random.default_rng(11)
    for at in (25, 30, 35):  # the step a quarter, half and three quarters into the window
        counts = [float(rng.poisson(150.0 if i < at else 300.0)) for i in range(40)]
        d, n = _dispersion_of(_scraped_counts(counts, ("a", "b")), 15.0 * 40)
        assert d is None and n == 0
    ramp = [float(rng.poisson(150.0 * (1.0 + 0.05 * i / 40))) for i in range(40)]
    d, _ = _dispersion_of(_scraped_counts(ramp, ("a", "b")), 15.0 * 40)
    assert d is not None and 0.4 < d < 1.8
