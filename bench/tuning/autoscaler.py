"""A replica autoscaler in the benchmark's world: the HPA controller's algorithm on one signal.

It scales the VLLMDeployment (its scale subresource): `World.replica_target` is the count it
writes, and the operator (or, for the defaults, a plain render of the default knobs) turns it
into the Deployments. Every `sync_s` (the HPA's 15 s) it reads the world's Prometheus, as KEDA
or prometheus-adapter would, and asks for replicas by one of three signals:

- `capacity`: load ÷ capacity, the examples' query (examples/autoscaling/): the completed
  requests/s plus the queue worked off within a minute, divided by the per-replica capacity the
  operator publishes (`status.capacity`, core/autoscaling.published_capacity), at a target
  utilisation (`AverageValue`: replicas = ceil(needed / utilisation));
- `kv`: the pods' mean KV-cache usage against a target (a `Pods` metric:
  replicas = ceil(current * usage / target));
- `waiting`: the pods' mean waiting requests against a target (the vLLM production stack's and
  llm-d's queue-depth signal).

The HPA's rules as the Kubernetes docs give them (horizontal-pod-autoscale.md): no change
within a 10 % tolerance of the target; scale up at once (by at most max(100 %, 4 pods) per
sync, the default policy); scale down to the highest recommendation of the last
`stabilization_s` (300 s by default), at most `scale_down_pods` per `scale_down_period_s` (the
examples' policy); always within [min_replicas, max_replicas].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from bench.tuning.promsim import Evaluator

if TYPE_CHECKING:
    from bench.tuning.world import World

Signal = Literal["capacity", "kv", "waiting"]
SIGNALS: tuple[Signal, ...] = ("capacity", "kv", "waiting")
_KEYS = (
    "min_replicas", "max_replicas", "sync_s", "tolerance", "stabilization_s", "scale_down_pods",
    "scale_down_period_s", "utilization", "kv_target", "waiting_target", "fallback_capacity_rps",
)  # fmt: skip

LOAD = (
    "sum(rate(vllm:request_success_total[120s]))",
    "sum(last_over_time(vllm:num_requests_waiting[30s]))",
)
WARMUP_S = 150.0  # the 120 s rate window and a scrape
KV = "avg(last_over_time(vllm:kv_cache_usage_perc[30s]))"
WAITING = "avg(last_over_time(vllm:num_requests_waiting[30s]))"


@dataclass(frozen=True)
class AutoscalerSpec:
    """The `autoscaler:` section of a scenario (every key optional)."""

    min_replicas: int = 1
    max_replicas: int = 8
    sync_s: float = 15.0
    tolerance: float = 0.1
    stabilization_s: float = 300.0
    scale_down_pods: int = 1
    scale_down_period_s: float = 120.0
    utilization: float = 0.8  # capacity: aim at this share of one replica's capacity
    kv_target: float = 0.7  # kv: mean KV-cache usage per pod
    waiting_target: float = 2.0  # waiting: mean requests waiting per pod
    fallback_capacity_rps: float = 2.0  # capacity: until the operator publishes one

    @classmethod
    def parse(cls, raw: Any) -> AutoscalerSpec:
        if not isinstance(raw, Mapping):
            raise ValueError(f"autoscaler must be a mapping of {', '.join(_KEYS)}, got {raw!r}")
        unknown = set(raw) - set(_KEYS)
        if unknown:
            raise ValueError(f"unknown autoscaler keys: {sorted(unknown)} (known: {_KEYS})")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"autoscaler.{key} must be a number >= 0, got {value!r}")
            values[key] = value
        spec = cls(**values)
        if not 1 <= spec.min_replicas <= spec.max_replicas:
            raise ValueError("autoscaler needs 1 <= min_replicas <= max_replicas")
        if min(spec.sync_s, spec.utilization, spec.kv_target, spec.waiting_target) <= 0:
            raise ValueError("autoscaler.sync_s and the targets must be > 0")
        return spec


@dataclass
class HPA:
    spec: AutoscalerSpec
    signal: Signal
    # The operator's published per-replica capacity now (None: not published yet).
    capacity: Callable[[], float | None] = lambda: None
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    scale_downs: list[tuple[float, int]] = field(default_factory=list)
    last_value: float | None = None  # the signal's value at the last sync, for the trace

    def sync(self, world: World, t: float) -> int:
        """The replica count to write now (the current one when nothing changes)."""
        current = world.replica_target
        if t < WARMUP_S:
            return current  # the load's rate window is not full yet: it would read low
        raw = self._recommend(Evaluator(world.db), t, current)
        if raw is None:
            return current
        s = self.spec
        since = t - s.stabilization_s
        self.recommendations = [(u, r) for u, r in self.recommendations if u > since]
        self.recommendations.append((t, raw))
        if raw > current:
            wanted = min(raw, max(2 * current, current + 4))
        elif raw < current:
            stable = max(r for _, r in self.recommendations)
            recent = sum(n for u, n in self.scale_downs if u > t - s.scale_down_period_s)
            wanted = max(stable, current - max(0, s.scale_down_pods - recent))
        else:
            wanted = current
        wanted = min(max(wanted, s.min_replicas), s.max_replicas)
        if wanted < current:
            self.scale_downs.append((t, current - wanted))
        return wanted

    def _recommend(self, ev: Evaluator, t: float, current: int) -> int | None:
        s = self.spec
        if self.signal == "capacity":
            rate, waiting = (_value(ev, q, t) for q in LOAD)
            if rate is None:
                return None
            load = rate + (waiting or 0.0) / 60.0
            cap = self.capacity() or s.fallback_capacity_rps
            needed = load / cap
            self.last_value = needed
            usage = needed / (s.utilization * max(1, current))
            return current if abs(usage - 1.0) <= s.tolerance else math.ceil(needed / s.utilization)
        value = _value(ev, KV if self.signal == "kv" else WAITING, t)
        if value is None:
            return None
        self.last_value = value
        target = s.kv_target if self.signal == "kv" else s.waiting_target
        usage = value / target
        return current if abs(usage - 1.0) <= s.tolerance else math.ceil(current * usage)


def _value(ev: Evaluator, expr: str, t: float) -> float | None:
    vec = ev.query(expr, t)
    return float(vec[0][1]) if vec else None
