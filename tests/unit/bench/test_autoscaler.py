"""The benchmark's replica autoscaler (bench/tuning/autoscaler.py): the HPA's rules on each
signal, read from the world's Prometheus, and the world that renders its count at once."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
from bench.tuning.autoscaler import HPA, WARMUP_S, AutoscalerSpec
from bench.tuning.promsim import TSDB
from bench.tuning.scenario import parse
from bench.tuning.world import World

from tests.unit.bench.test_world import BASE
from vllm_autotuner.core.tuning_types import Knobs

SPEC = AutoscalerSpec(min_replicas=1, max_replicas=8, utilization=0.8)


@dataclass
class Fake:
    """What the HPA reads of a world: its TSDB and the count it wrote last."""

    replica_target: int
    db: TSDB = field(default_factory=TSDB)
    totals: dict[int, float] = field(default_factory=dict)  # each pod's counter so far


def feed(
    w: Fake, t0: float, t1: float, pods: int, rate: float, kv: float = 0.3, waiting: float = 0.0
) -> None:
    """Scrapes every 15 s of `pods` pods, each completing `rate` requests/s."""
    t = t0
    while t <= t1 + 1e-9:
        for i in range(pods):
            base = {"namespace": "bench", "pod": f"p{i}", "job": "vllm"}
            total = {**base, "__name__": "vllm:request_success_total", "finished_reason": "stop"}
            w.totals[i] = w.totals.get(i, 0.0) + rate * (15.0 if t > 0 else 0.0)
            w.db.append(total, t, w.totals[i])
            w.db.append({**base, "__name__": "vllm:kv_cache_usage_perc"}, t, kv)
            w.db.append({**base, "__name__": "vllm:num_requests_waiting"}, t, waiting)
        t += 15.0


def sync(hpa: HPA, w: Fake, t: float) -> int:
    n = hpa.sync(w, t)  # type: ignore[arg-type]
    w.replica_target = n
    return n


def test_load_over_capacity_scales_up_at_once_to_the_needed_count() -> None:
    w = Fake(2)
    feed(w, 0, 300, pods=2, rate=20.0)  # 40 req/s
    hpa = HPA(SPEC, "capacity", capacity=lambda: 10.0)
    assert sync(hpa, w, WARMUP_S - 15) == 2  # the rate window is not full yet
    # needed 4 replicas at full capacity, 5 at 80 %; one sync may at most double (+4 pods)
    assert sync(hpa, w, 300) == 5
    assert hpa.last_value == pytest.approx(4.0, rel=0.02)
    assert sync(hpa, w, 315) == 5  # within the tolerance: no change


def test_without_a_published_capacity_the_fallback_is_used() -> None:
    w = Fake(2)
    feed(w, 0, 300, pods=2, rate=20.0)
    hpa = HPA(AutoscalerSpec(fallback_capacity_rps=20.0), "capacity")
    assert sync(hpa, w, 300) == math.ceil(40 / 20 / 0.8)


def test_scale_down_waits_for_the_stabilization_window_then_one_pod_at_a_time() -> None:
    w = Fake(6)
    feed(w, 0, 300, pods=6, rate=7.5)  # 45 req/s: 4.5 needed, 6 at 80 % (within tolerance)
    hpa = HPA(SPEC, "capacity", capacity=lambda: 10.0)
    assert sync(hpa, w, 300) == 6
    feed(w, 315, 1500, pods=6, rate=1.0)  # the load falls to 6 req/s: 1 replica
    counts = [sync(hpa, w, t) for t in range(315, 1500, 15)]
    assert counts[0] == 6
    first_down = next(i for i, n in enumerate(counts) if n < 6)
    assert 315 + 15 * first_down >= 300 + SPEC.stabilization_s  # held for 5 minutes
    steps = [a - b for a, b in itertools.pairwise(counts) if a != b]
    assert steps and all(s == 1 for s in steps)  # one pod per period
    assert counts[-1] < 6 and min(counts) >= SPEC.min_replicas


@pytest.mark.parametrize(
    ("signal", "kv", "waiting", "want"),
    [("kv", 0.35, 0.0, 3), ("kv", 0.7, 0.0, 4), ("kv", 1.0, 0.0, 6), ("waiting", 0.3, 4.0, 8)],
)
def test_kv_and_waiting_scale_the_count_by_their_ratio_to_the_target(
    signal: Any, kv: float, waiting: float, want: int
) -> None:
    w = Fake(4)
    feed(w, 0, 300, pods=4, rate=5.0, kv=kv, waiting=waiting)
    hpa = HPA(SPEC, signal)
    assert sync(hpa, w, 300) == want


def test_bad_specs_are_refused_with_the_key() -> None:
    with pytest.raises(ValueError, match="unknown autoscaler keys"):
        AutoscalerSpec.parse({"max_replica": 3})
    with pytest.raises(ValueError, match="utilization"):
        AutoscalerSpec.parse({"utilization": -1})
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        AutoscalerSpec.parse({"min_replicas": 4, "max_replicas": 2})
    assert AutoscalerSpec.parse({"max_replicas": 3}).max_replicas == 3


def test_the_world_renders_the_autoscalers_count_and_counts_gpu_time() -> None:
    s = parse({**BASE, "horizon_s": 420, "autoscaler": {"max_replicas": 4}})
    assert s.autoscaler is not None
    hpa = HPA(s.autoscaler, "capacity", capacity=lambda: 0.5)  # 4 req/s need all 4 replicas
    knobs = Knobs(2048, 256, 0.9)
    w = World(s, knobs, 420, autoscaler=hpa)
    assert w.gpus == 4 + s.rollout.max_surge
    w.advance_to(420)
    assert w.replica_target == 4
    (first_change, _) = w.replica_timeline[1]
    assert first_change >= WARMUP_S
    assert w.deployments["stable"].replicas == 4
    assert len([p for p in w.pods if p.track == "stable"]) == 4
    # GPU time: 2 pods from the start, 4 once the autoscaler scaled (loading included).
    assert 2 * 420 < w.gpu_seconds < 4 * 420
