"""A window that begins when its pods began counts the short requests and misses the long.

The window of a fresh revision starts when its last pod became ready (it never reaches back
over a rollout). A request is counted when it finishes, and a pod `A` seconds old can only
have finished requests that arrived after it started: one that takes `d` seconds is counted
only if it arrived in the first `A - d` seconds. So the window holds the short requests of
all its arrivals and the long requests of only some, and reads the outputs as shorter and
the traffic as lighter than they are. On a held-out-style reasoning workload (1,500 output
tokens on average, requests of about a minute) the window at 150 s read a mean of 1,286 and
took about seven minutes to read 1,470.

Arrivals at a steady rate from the pods' start: the window (the last `W` of those `A`
seconds, so it starts `L = A - W` in) counts a request of duration `d` with probability

    P(d) = 1                 for d <= L
         = (A - d) / W       for L < d < A
         = 0                 for d >= A

(it arrived between max(0, L - d) and A - d; Kaplan and Meier's "delayed entry" in a
different dress). Weighting each length bucket by 1 / P (Horvitz and Thompson, 1952)
gives the lengths of the arrivals, and the weights' mean scales the finished-request
rate to the arrival rate. A request's duration is taken as proportional to its output
length, at the window's seconds per output token (mean end-to-end latency over mean
output length): decode dominates where the correction matters.

Requests longer than the pods' age are never seen; nothing can restore them, so the weight
is capped (`MAX_WEIGHT`) and a window younger than its own mean request is not corrected
at all: the caller's minimum window waits it out.
"""

from __future__ import annotations

import math
from dataclasses import replace

from vllm_autotuner.core.snapshot import LengthSummary, Snapshot, histogram_quantile

MAX_WEIGHT = 4.0
"""The largest 1/P a bucket gets: P below 1/4 means the window saw few of those requests and
their count is too noisy to scale further."""


def uncensored(snap: Snapshot) -> Snapshot:
    """`snap` with its output lengths and request rate corrected for the pods' start (the
    same snapshot when the window starts long enough after it, or when the pods' age or the
    latencies are unknown)."""
    gen = snap.generation_len
    age = snap.pods_age_s
    e2e_ms = snap.e2e.mean_ms
    if age is None or e2e_ms is None or gen.mean is None or gen.mean <= 0 or not gen.buckets:
        return snap
    if e2e_ms / 1000.0 >= age:  # younger than its own mean request: nothing to scale from
        return snap
    counts = _counts(gen.buckets)
    seen = sum(n for _, n in counts)
    if seen <= 0:
        return snap
    window = min(snap.window_s, age)
    lead = age - window
    per_token_s = e2e_ms / 1000.0 / gen.mean
    mid = [_representative(lo, hi) for (lo, hi), _ in counts]
    weights = [_weight(m * per_token_s, age, window, lead) for m in mid]
    if all(w == 1.0 for w in weights):
        return snap
    weighted = sum(n * w for (_, n), w in zip(counts, weights, strict=True))
    mean_seen = sum(n * m for (_, n), m in zip(counts, mid, strict=True)) / seen
    mean_all = sum(n * m * w for (_, n), m, w in zip(counts, mid, weights, strict=True)) / weighted
    ratio = mean_all / mean_seen  # every representative length is at least 1
    cumulative, total = [], 0.0
    for ((_, hi), n), w in zip(counts, weights, strict=True):
        total += n * w
        cumulative.append((hi, total))
    lengths = LengthSummary(
        mean=gen.mean * ratio,
        p50=histogram_quantile(0.5, cumulative),
        p90=histogram_quantile(0.9, cumulative),
        buckets=tuple(cumulative),
    )
    return replace(
        snap,
        generation_len=lengths,
        request_rate=snap.request_rate * weighted / seen,
    )


def _weight(duration_s: float, age_s: float, window_s: float, lead_s: float) -> float:
    """1 / P(counted) for a request of `duration_s` (the module docstring's P)."""
    if duration_s <= lead_s:
        return 1.0
    p = (age_s - duration_s) / window_s
    return MAX_WEIGHT if p <= 1.0 / MAX_WEIGHT else 1.0 / p


def _counts(
    buckets: tuple[tuple[float, float], ...],
) -> list[tuple[tuple[float, float], float]]:
    """((lower, upper) bound, requests in it) of each bucket of a cumulative histogram."""
    out, below, lo = [], 0.0, 0.0
    for hi, cum in buckets:
        out.append(((lo, hi), max(0.0, cum - below)))
        below, lo = max(below, cum), hi
    return out


def _representative(lo: float, hi: float) -> float:
    """A bucket's typical length: the geometric middle of its bounds (vLLM's length buckets
    grow 1-2-5 a decade), the lower bound of the open last one."""
    if not math.isfinite(hi):
        return max(lo, 1.0)
    return math.sqrt(max(lo, 1.0) * hi)
