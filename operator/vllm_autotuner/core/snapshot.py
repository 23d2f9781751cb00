"""What Prometheus showed about one deployment over one evaluation window.

The Prometheus adapter fills a `Snapshot`; the tuner only ever reads it. Conventions, so that
the adapter and the tuner agree without talking:

- Latencies are in **milliseconds**, token lengths in tokens, rates per **second**.
- Request and preemption rates are **totals over all ready pods** of the revision; gauges
  (running, waiting, KV usage) are **per pod** (mean = time-and-pod average, max = the largest
  value any pod showed). The tuner divides totals by `num_pods` to reason per pod.
- Every metric the adapter could not read is `None` (not 0): a missing metric is not a zero.
- `available=False` means "do not use this snapshot"; `reason` says why for a person
  ("Prometheus unreachable", "window mixes revisions r3 and r4", ...).
- `knobs` are the knobs the pods in the window ran with (from the revision's rendered args);
  the tuner refuses to judge a snapshot whose knobs differ from what it applied.

`histogram_quantile` and `fraction_below` are the pure maths behind percentiles and SLO
attainment from cumulative buckets, shared by the adapter and the tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import datetime

from vllm_autotuner.core.tuning_types import Knobs, PodHealth, SLOTarget


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles of one latency histogram, in ms (`None` when not computable).

    `at_slo_ms` is the value at the percentile the SLO names (e.g. p99.9 when the SLO says so),
    so that the tuner does not depend on the four fixed percentiles.
    """

    p50_ms: float | None = None
    p90_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    at_slo_ms: float | None = None
    mean_ms: float | None = None
    # The cumulative histogram itself: (upper bound in ms, observations at or under it),
    # ascending, the last bound +inf. Percentiles interpolated inside a wide bucket can be far
    # off; judgements that matter use the counts (`fraction_bounds`).
    buckets: tuple[tuple[float, float], ...] = ()

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def fraction_bounds(self, threshold_ms: float) -> tuple[float, float] | None:
        """(lowest, highest) fraction of observations at or under `threshold_ms` that the
        buckets allow: the counts at the bucket bounds on either side of the threshold."""
        total = self.count
        if total <= 0:
            return None
        below = 0.0
        above = total
        for bound, cum in self.buckets:
            if bound <= threshold_ms:
                below = max(below, cum)
            if bound >= threshold_ms:
                above = min(above, cum)
        return below / total, max(below, above) / total

    def at(self, percentile: float) -> float | None:
        """The value at `percentile` (percent), preferring the SLO's own when it matches none."""
        fixed = {50.0: self.p50_ms, 90.0: self.p90_ms, 95.0: self.p95_ms, 99.0: self.p99_ms}
        v = fixed.get(float(percentile))
        return v if v is not None else self.at_slo_ms


@dataclass(frozen=True)
class LengthSummary:
    """Token-length distribution from vLLM's request_*_tokens histograms."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    # The cumulative histogram: (upper bound in tokens, requests at or under it), ascending.
    buckets: tuple[tuple[float, float], ...] = ()

    def lognormal_p90(self) -> float | None:
        """The p90 of the log-normal with this mean that best fits the bucket counts (vLLM's
        1-2-5 token buckets are too coarse to interpolate a p90 in), or None without data."""
        if self.mean is None or self.mean <= 0 or not self.buckets:
            return None
        spread = length_spread(self.buckets, math.log(self.mean), 0.99)
        if spread is None:
            return None
        _, sigma = spread
        return math.exp(math.log(self.mean) - 0.5 * sigma * sigma + 1.2816 * sigma)


@dataclass(frozen=True)
class KVCacheInfo:
    """Labels of vllm:cache_config_info (per engine; the adapter takes any one pod's)."""

    num_gpu_blocks: int | None = None
    block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None  # the label exists only in recent vLLM versions

    def capacity_tokens(self) -> int | None:
        if self.kv_cache_size_tokens is not None:
            return self.kv_cache_size_tokens
        if self.num_gpu_blocks is not None and self.block_size is not None:
            return max(0, self.num_gpu_blocks - 1) * self.block_size
        return None


@dataclass(frozen=True)
class Snapshot:
    """One window of metrics for the current revision (see the module docstring).

    Fields by group:
    - identity: `time` (end of the window), `window_s`, `available`/`reason`, `revision`,
      `knobs`, `num_pods` (ready pods of the revision that were scraped).
    - traffic: `request_rate` (finished requests/s, all pods), `completed_requests` (finished
      requests in the window, all pods), `preemption_rate` (preemptions/s, all pods).
    - latency (ms): `ttft`, `itl`, `e2e`, `queue_time`, `prefill_time` summaries; `ttft_attainment`,
      `itl_attainment`, `e2e_attainment` are the fractions of observations at or under the
      SLO threshold, from histogram buckets (`fraction_below`).
    - engine state (per pod): `kv_usage_mean`/`kv_usage_max` (0..1, vllm:kv_cache_usage_perc),
      `running_mean`/`running_max`, `waiting_mean`/`waiting_max`.
    - workload: `prompt_len`, `generation_len`, `prefix_cache_hit_rate` (0..1, hits/queries),
      `iteration_tokens_mean` (tokens per engine step), `steps_per_s` (per pod).
    - capacity: `kv_cache` (vllm:cache_config_info labels).
    - burstiness: `arrival_dispersion`, the variance over the mean of each pod's first tokens
      per scrape interval (1 for Poisson arrivals, more for bursts), pooled over pods, from
      `arrival_intervals` intervals in all.
    """

    time: datetime
    window_s: float
    available: bool = True
    reason: str = ""
    # Unavailable only because the revision is new (no ready pod yet, a window too short, the
    # first cycle): expected after every rollout, so it is not reported as a loss of metrics.
    warming_up: bool = False
    revision: str | None = None
    knobs: Knobs | None = None
    num_pods: int = 1
    request_rate: float = 0.0
    completed_requests: int = 0
    ttft: LatencySummary = field(default_factory=LatencySummary)
    itl: LatencySummary = field(default_factory=LatencySummary)
    e2e: LatencySummary = field(default_factory=LatencySummary)
    queue_time: LatencySummary = field(default_factory=LatencySummary)
    prefill_time: LatencySummary = field(default_factory=LatencySummary)
    ttft_attainment: float | None = None
    itl_attainment: float | None = None
    e2e_attainment: float | None = None
    kv_usage_mean: float | None = None
    kv_usage_max: float | None = None
    preemption_rate: float = 0.0
    running_mean: float | None = None
    running_max: float | None = None
    waiting_mean: float | None = None
    waiting_max: float | None = None
    prompt_len: LengthSummary = field(default_factory=LengthSummary)
    generation_len: LengthSummary = field(default_factory=LengthSummary)
    prefix_cache_hit_rate: float | None = None
    iteration_tokens_mean: float | None = None
    # Engine steps per second per pod (the iteration-tokens histogram's count): while the
    # engine is busy, its inverse is the mean step time.
    steps_per_s: float | None = None
    kv_cache: KVCacheInfo = field(default_factory=KVCacheInfo)
    arrival_dispersion: float | None = None
    arrival_intervals: int = 0
    # Seconds the newest of the window's pods had been ready at the window's end (None when
    # unknown): a window that starts with its pods counts short requests first
    # (core/censoring.py).
    pods_age_s: float | None = None

    @classmethod
    def unavailable(
        cls, time: datetime, window_s: float, reason: str, *, warming_up: bool = False
    ) -> Snapshot:
        return cls(
            time=time,
            window_s=window_s,
            available=False,
            reason=reason,
            num_pods=0,
            warming_up=warming_up,
        )

    def per_pod_rate(self) -> float:
        return self.request_rate / max(1, self.num_pods)

    def latency(self, metric: str) -> LatencySummary:
        s: LatencySummary = getattr(self, metric)
        return s

    def attainment(self, metric: str) -> float | None:
        v: float | None = getattr(self, f"{metric}_attainment")
        return v


@dataclass(frozen=True)
class Scaling:
    """The replica count's last change (by an autoscaler or a person) as the operator saw it:
    `changed_at` when the count became `replicas` (from `previous`), `settled_at` when the
    ready pods last reached the count (before `changed_at`: an earlier change's, so the count
    still moves). No change seen yet: both None."""

    replicas: int
    previous: int | None = None
    changed_at: datetime | None = None
    settled_at: datetime | None = None

    @property
    def moving(self) -> bool:
        if self.changed_at is None:
            return False
        return self.settled_at is None or self.settled_at < self.changed_at


@dataclass(frozen=True)
class Observation:
    """Everything decide() sees of the outside world at one reconcile."""

    snapshot: Snapshot
    pods: tuple[PodHealth, ...] = ()
    # During a canary trial: `snapshot` covers the baseline pods and `canary` the canary pod,
    # over the same window, so that the two are compared under the same traffic.
    canary: Snapshot | None = None
    # How the replica count moves (core/autoscaling.py); None: nobody tracks it.
    scaling: Scaling | None = None


MIN_DISPERSION_INTERVALS = 8
"""Fewer scrape intervals than this say nothing about burstiness."""


def arrival_cv2(snapshot: Snapshot) -> float:
    """The variability of the gaps between a pod's arrivals (squared coefficient of variation:
    1 for Poisson) that the window's counts show beyond their noise; at least 1.

    For a renewal process the variance over the mean of the counts in intervals much longer
    than a gap tends to the gaps' cv2, and it is exactly 1 for Poisson counts at any interval
    (Cox and Lewis, The Statistical Analysis of Series of Events, 1966). From `n` intervals of
    Poisson counts the estimate's standard error is about sqrt(2 / n) (a chi-square's); the
    estimate is shrunk towards 1 by two of them (soft thresholding), so that noise alone
    seldom moves the model (one window in 40 of Poisson traffic, and then a little). Less
    than 1 is taken as 1: an engine past saturation spaces its first tokens at its own pace,
    so counts of first tokens look regular whatever the arrivals (a window at the capacity of
    bursty-8b-h100 showed 0.69 for Poisson arrivals). Too few intervals, or none: 1."""
    d = snapshot.arrival_dispersion
    if d is None:
        return 1.0
    return shrunk_cv2(d, snapshot.arrival_intervals)


def shrunk_cv2(dispersion: float, intervals: float) -> float:
    """A dispersion from `intervals` scrape intervals, shrunk towards 1 by two of its
    standard errors (`arrival_cv2`); at least 1, and 1 from too few intervals."""
    if not math.isfinite(dispersion) or intervals < MIN_DISPERSION_INTERVALS:
        return 1.0
    return max(1.0, dispersion - 2.0 * math.sqrt(2.0 / intervals))


MAX_WINDOW_FACTOR = 6
"""How many evaluation windows a decision may read back at most (6 x the default 5 min: half
an hour) when the deployment serves too few requests for one window to be evidence."""


def evidence_window_s(window_s: float, min_requests: int, last: Snapshot | None) -> float:
    """The metrics window the next decision reads: the policy's evaluation window, or, when
    the last window's completion rate needs longer to count `min_requests` (plus 10 %), the
    whole multiple of it that does (at most `MAX_WINDOW_FACTOR`).

    A 32B model on two L40S at 0.14 req/s per pod, three pods, completes 126 requests in 5
    min: with the default 200 it never decided (bench/tuning, a held-out scenario, 0.85 of
    the oracle). The window still never reaches back over a new revision (`since`)."""
    if last is None or not last.available or last.window_s <= 0 or min_requests <= 0:
        return window_s
    rate = last.completed_requests / last.window_s  # the rate decides, not the count: a
    if rate <= 0:  # window that was long enough must stay so
        return window_s
    factor = math.ceil(min_requests * 1.1 / rate / window_s)
    return window_s * min(MAX_WINDOW_FACTOR, max(1, factor))


def _bad_numbers(obj: object, prefix: str = "") -> list[str]:
    """Paths of NaN, infinite or negative numbers anywhere in a snapshot's measurements."""
    found: list[str] = []
    if not is_dataclass(obj) or isinstance(obj, type):
        return found
    for f in fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            if not math.isfinite(value) or value < 0:
                found.append(f"{path}={value:g}")
        elif is_dataclass(value) and f.name not in ("knobs",):
            found += _bad_numbers(value, f"{path}.")
    return found


def defect(snapshot: Snapshot, targets: Sequence[tuple[str, SLOTarget]]) -> str | None:
    """Why an available snapshot still must not be acted on (None when it can be).

    The adapter already drops NaN samples and handles counter resets, but a snapshot can come
    from anywhere (another adapter, a benchmark): a NaN compares false with everything, and a
    negative rate from a counter reset read as a drop in traffic, so either would steer the
    tuner by garbage. An SLO series missing while requests were served (partial scrape, a
    renamed metric) would let a rollout be judged on half the SLO.
    """
    if not snapshot.available:
        return None
    bad = _bad_numbers(snapshot)
    if bad:
        return f"invalid values (NaN, infinite or negative: counter reset?): {', '.join(bad[:4])}"
    if snapshot.completed_requests > 0:
        missing = [
            f"{metric.upper()} p{target.percentile:g}"
            for metric, target in targets
            if target_value(snapshot, metric, target) is None
        ]
        if missing:
            return f"partial data: no {', '.join(missing)} in the window"
    return None


# ----------------------------------------------------------------------------- histogram maths


# A log-normal read from a length histogram's informative bounds is refitted on every bound
# when it expects at least this many of the window's lengths in the buckets the window left
# empty: the chance of seeing none there is then under 1 % (e^-4.6).
EMPTY_BUCKET_EVIDENCE = 4.6


def length_spread(
    buckets: Sequence[tuple[float, float]], log_mean: float, upper: float
) -> tuple[list[tuple[float, float]], float] | None:
    """The (log bound, fraction at or under it) points to fit a length spread to, and the
    sigma of the log-normal with mean exp(log_mean) fitted to them (None without counts).
    The points are the informative bounds (`cdf_points` up to `upper`), or every finite bound
    where there are none or the log-normal fitted to those alone contradicts the empty
    buckets.

    The buckets a window's lengths do not reach say where the spread ends. Prompts spread
    evenly over 3,000-6,000 tokens fill only vLLM's 2,000-5,000 and 5,000-10,000 buckets, and
    one split with the mean fits two log-normals: sigma 0.24 (p90 5,900 tokens) and sigma 0.99
    (p90 9,700, with 38 % of the prompts under 2,000 tokens, where there were none). Read
    from that split alone, a held-out RAG window picked the second, and its model predicted
    first tokens over the SLO at any rate. Where the informative bounds' fit agrees with the
    empty buckets it stands as it is: the step-time fit downstream can move to another basin
    on a change of the spread in its fourth digit (docs/decisions.md)."""
    from scipy.special import ndtr

    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    every = [(math.log(b), c / total) for b, c in buckets if math.isfinite(b) and b > 0]
    if not every:
        return None
    inner = [(math.log(b), f) for b, f in cdf_points(buckets, upper)]
    if inner:
        sigma = _fit_lognormal_sigma(log_mean, inner)
        mu = log_mean - 0.5 * sigma * sigma
        below = max((float(ndtr((x - mu) / sigma)) for x, f in every if f <= 0.0), default=0.0)
        above = max(
            (1.0 - float(ndtr((x - mu) / sigma)) for x, f in every if f >= 1.0), default=0.0
        )
        if total * (below + above) < EMPTY_BUCKET_EVIDENCE:
            return inner, sigma
    return every, _fit_lognormal_sigma(log_mean, every)


def cdf_points(
    buckets: Sequence[tuple[float, float]], upper: float = 0.995
) -> list[tuple[float, float]]:
    """(bound, fraction at or under it) at a cumulative histogram's informative finite
    bounds: those with more than 1 % and less than `upper` of the samples under them."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return []
    return [
        (b, c / total)
        for b, c in buckets
        if math.isfinite(b) and b > 0 and 0.01 < c / total < upper
    ]


def lognormal_misfit(log_mean: float, sigma: float, points: Sequence[tuple[float, float]]) -> float:
    """Squared distance of the log-normal with mean exp(log_mean) and this sigma from the
    (log bound, fraction at or under it) points of a histogram."""
    from scipy.special import ndtr

    mu = log_mean - 0.5 * sigma * sigma
    return float(sum((ndtr((x - mu) / sigma) - f) ** 2 for x, f in points))


def _fit_lognormal_sigma(log_mean: float, points: Sequence[tuple[float, float]]) -> float:
    """Sigma of the log-normal with mean exp(log_mean) whose CDF is closest (least squares) to
    the (log bound, fraction) points."""
    from scipy.optimize import minimize_scalar

    res = minimize_scalar(
        lambda sigma: lognormal_misfit(log_mean, sigma, points),
        bounds=(0.02, 2.5),
        method="bounded",
        options={"xatol": 1e-3},
    )
    return float(res.x)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative `(upper_bound, count)` buckets.

    Same interpolation as PromQL (linear inside a bucket, lower edge 0 for the first), so the
    tuner's tests and the Prometheus adapter read percentiles the same way. The +Inf bucket
    returns the largest finite bound.
    """
    if not buckets:
        return None
    bs = sorted(buckets)
    total = bs[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in bs:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return bs[-1][0] if not math.isinf(bs[-1][0]) else prev_bound


def fraction_below(threshold: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Fraction of observations at or under `threshold`, interpolated inside its bucket."""
    if not buckets:
        return None
    bs = sorted(buckets)
    total = bs[-1][1]
    if total <= 0:
        return None
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in bs:
        if threshold <= bound:
            if math.isinf(bound):
                return prev_count / total
            frac = (threshold - prev_bound) / (bound - prev_bound) if bound > prev_bound else 1.0
            return (prev_count + (count - prev_count) * frac) / total
        prev_bound, prev_count = bound, count
    return 1.0


def target_value(snapshot: Snapshot, metric: str, target: SLOTarget) -> float | None:
    """The snapshot's value for one SLO target (ms), or None when not measured."""
    return snapshot.latency(metric).at(target.percentile)
