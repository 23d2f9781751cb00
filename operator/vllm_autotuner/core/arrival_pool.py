"""The arrivals' burstiness, pooled over the recent windows.

One window's first-token counts give each pod's variance over mean per scrape interval
(`Snapshot.arrival_dispersion`) from a few dozen intervals: 20 per pod in a 300 s window at a
15 s scrape. That is too few to tell bursts from noise. On bursty-8b-h100 (every pod's counts
at a true 2.17), consecutive windows read anything from 0.9 to 3.4, and once shrunk by the
noise they could hold (`snapshot.shrunk_cv2`), most decisions saw Poisson arrivals. The
step-time fit then explained the bursts' longer inter-token tail as slower prefill: compute
efficiency 0.61-0.69 where the truth is 0.90, and the smaller token budgets it proposed
under-predicted by up to 28 %. With the true 2.17 the same windows fitted 0.77-0.93 after
their first four minutes.

Burstiness belongs to the traffic, not to the knobs, so the pool does not restart when they
change. It keeps an exponentially weighted mean of the windows' dispersions, each weighted by
the intervals it adds: a reconcile 60 s after the last adds 60 s of a 300 s window's
intervals, so overlapping windows are not counted twice. With a time constant of
`POOL_WINDOWS` evaluation windows, it rests on about that many windows' intervals, and the
noise it must be shrunk by halves. It restarts when the number of pods changes (a Service
spreads a burst over its pods, so each pod's burstiness depends on how many there are) or
the clock goes back, and it lapses after `POOL_LAPSE` time constants without a usable window.
One window's reading moves the pool at most `OUTLIER` of its standard errors' worth (a
winsorized mean), so a window the adapter's checks let through at a wild value cannot hold
the model for the pool's whole memory, while a real change of burstiness still moves it
within a few windows. Without a pool, the window's own reading stands, as before.

It lives in the state's calibration mapping (`arrivals_*` keys), beside the fit, never inside
a `Calibration`. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_autotuner.core.snapshot import MIN_DISPERSION_INTERVALS, Snapshot, shrunk_cv2

# The pool's time constant, in evaluation windows (20 minutes at the default 5).
POOL_WINDOWS = 4.0
# Time constants without a usable window after which the pool says nothing any more.
POOL_LAPSE = 3.0
# How far from the pool one window's reading counts, in that window's standard errors at the
# pool's level (`d sqrt(2 / n)`); beyond, it counts as this far. On chat-8b-h100 (Poisson), the
# window that began at its load step (16 to 28 req/s per pod) passed the adapter's steadiness
# check at 4.9 (most likely a scrape interval from before the step in its oldest segment;
# not checked). Pooled at full weight after the windows over the step had been left out, it
# held the model at a cv2 of 2.1 down to 1.2 for 25 minutes.
OUTLIER = 3.0

_KEYS = ("dispersion", "intervals", "at", "pods", "last")
_STORED = tuple(f"arrivals_{k}" for k in _KEYS)


@dataclass(frozen=True)
class ArrivalPool:
    """The pooled variance over mean of a pod's arrivals per scrape interval
    (`dispersion`), the intervals it rests on (`intervals`, effective), its last update (`at`,
    epoch seconds), the pods it was measured over and the last window's own dispersion
    (`last`: the same window seen again is no news)."""

    dispersion: float
    intervals: float
    at: float
    pods: int
    last: float

    @classmethod
    def from_dict(cls, d: Mapping[str, float]) -> ArrivalPool | None:
        if any(k not in d for k in _STORED):
            return None
        dispersion, intervals, at, pods, last = (float(d[k]) for k in _STORED)
        if not all(map(math.isfinite, (dispersion, intervals, at, last))):
            return None
        if dispersion < 0 or intervals <= 0 or pods < 1:
            return None
        return cls(dispersion, intervals, at, int(pods), last)

    def to_dict(self) -> dict[str, float]:
        values = (self.dispersion, self.intervals, self.at, float(self.pods), self.last)
        return dict(zip(_STORED, values, strict=True))

    def cv2(self) -> float:
        """The arrivals' burstiness the pool shows beyond its noise (`shrunk_cv2`)."""
        return shrunk_cv2(self.dispersion, self.intervals)


def stored_pool(stored: Mapping[str, float]) -> dict[str, float]:
    """The pool's keys of a calibration mapping: what a new fit's mapping carries over."""
    return {k: float(stored[k]) for k in _STORED if k in stored}


def pooled(
    stored: Mapping[str, float], snapshot: Snapshot, now_s: float, window_s: float
) -> ArrivalPool | None:
    """The pool after this window (`stored`: the state's calibration mapping from the last
    reconcile). A window without a usable dispersion adds nothing; the same window seen
    again adds nothing."""
    window_s = max(window_s, 1.0)
    prev = ArrivalPool.from_dict(stored)
    if prev is not None and (
        now_s < prev.at
        or prev.pods != snapshot.num_pods
        or now_s - prev.at > POOL_LAPSE * POOL_WINDOWS * window_s
    ):
        prev = None
    d, n = snapshot.arrival_dispersion, snapshot.arrival_intervals
    if d is None or not math.isfinite(d) or d < 0 or n < MIN_DISPERSION_INTERVALS:
        return prev
    if prev is None:
        return ArrivalPool(d, float(n), now_s, snapshot.num_pods, d)
    if d == prev.last:
        return prev
    elapsed = now_s - prev.at
    old = prev.intervals * math.exp(-elapsed / (POOL_WINDOWS * window_s))
    new = n * min(1.0, elapsed / window_s)
    if new <= 0:
        return prev
    reach = OUTLIER * prev.dispersion * math.sqrt(2.0 / n)
    counted = min(max(d, prev.dispersion - reach), prev.dispersion + reach)
    return ArrivalPool(
        dispersion=(old * prev.dispersion + new * counted) / (old + new),
        intervals=old + new,
        at=now_s,
        pods=snapshot.num_pods,
        last=d,
    )
