"""The arrivals' burstiness pooled over the recent windows (core/arrival_pool.py).

- The pool round-trips through the state and refuses nonsense.
- It starts at the first usable window, continues across knob changes, restarts when the
  pods change or the clock goes back, and lapses after long without a usable window.
- Properties: the pooled dispersion stays within what the windows said; the same window seen
  again is no news; the intervals it rests on tend to POOL_WINDOWS windows' worth whatever
  the reconcile period; its burstiness never goes below Poisson.
- decide() fits and predicts at the pooled burstiness, publishes it, and a commit keeps the
  pool.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.core.test_decide import KNOBS, NOW, _window_served, make_snapshot, ready_pods, run
from vllm_autotuner.core.arrival_pool import (
    OUTLIER,
    POOL_LAPSE,
    POOL_WINDOWS,
    ArrivalPool,
    pooled,
    stored_pool,
)
from vllm_autotuner.core.snapshot import MIN_DISPERSION_INTERVALS, Snapshot, shrunk_cv2
from vllm_autotuner.core.tuning_types import Knobs, TuningState

WINDOW_S = 300.0
T0 = 1_000_000.0


def window(d: float | None, n: int = 32, pods: int = 2) -> Snapshot:
    return replace(make_snapshot(), arrival_dispersion=d, arrival_intervals=n, num_pods=pods)


def test_the_pool_round_trips_and_refuses_nonsense() -> None:
    pool = ArrivalPool(2.1, 96.0, T0, 2, 2.4)
    assert ArrivalPool.from_dict(pool.to_dict()) == pool
    assert stored_pool({**pool.to_dict(), "compute": 0.8}) == pool.to_dict()
    assert ArrivalPool.from_dict({}) is None
    for key, bad in (
        ("arrivals_dispersion", -1.0),
        ("arrivals_intervals", 0.0),
        ("arrivals_pods", 0.0),
        ("arrivals_at", math.nan),
    ):
        assert ArrivalPool.from_dict({**pool.to_dict(), key: bad}) is None, key


def test_it_starts_continues_and_restarts() -> None:
    assert pooled({}, window(None), T0, WINDOW_S) is None
    assert pooled({}, window(2.0, n=MIN_DISPERSION_INTERVALS - 1), T0, WINDOW_S) is None
    first = pooled({}, window(2.0), T0, WINDOW_S)
    assert first == ArrivalPool(2.0, 32.0, T0, 2, 2.0)
    stored = first.to_dict()
    later = pooled(stored, window(3.0), T0 + 60.0, WINDOW_S)
    assert later is not None and 2.0 < later.dispersion < 3.0 and later.intervals > 32.0
    # No usable window: the pool stands as it was, until it lapses.
    assert pooled(stored, window(None), T0 + 60.0, WINDOW_S) == first
    lapse = T0 + POOL_LAPSE * POOL_WINDOWS * WINDOW_S + 1.0
    assert pooled(stored, window(None), lapse, WINDOW_S) is None
    assert pooled(stored, window(1.5), lapse, WINDOW_S) == ArrivalPool(1.5, 32.0, lapse, 2, 1.5)
    # Other pods spread a burst differently; a clock that went back starts over.
    assert pooled(stored, window(3.0, pods=3), T0 + 60.0, WINDOW_S) == ArrivalPool(
        3.0, 32.0, T0 + 60.0, 3, 3.0
    )
    assert pooled(stored, window(3.0), T0 - 1.0, WINDOW_S) == ArrivalPool(
        3.0, 32.0, T0 - 1.0, 2, 3.0
    )


def test_the_same_window_again_is_no_news() -> None:
    first = pooled({}, window(2.0), T0, WINDOW_S)
    assert first is not None
    assert pooled(first.to_dict(), window(2.0), T0 + 60.0, WINDOW_S) == first


dispersions = st.floats(min_value=0.0, max_value=10.0)


@given(st.lists(dispersions, min_size=1, max_size=30),
       st.floats(min_value=10.0, max_value=600.0))  # fmt: skip
def test_the_pooled_dispersion_stays_within_what_the_windows_said(
    ds: list[float], period_s: float
) -> None:
    stored: dict[str, float] = {}
    for i, d in enumerate(ds):
        pool = pooled(stored, window(d), T0 + i * period_s, WINDOW_S)
        assert pool is not None
        assert min(ds[: i + 1]) - 1e-9 <= pool.dispersion <= max(ds[: i + 1]) + 1e-9
        assert pool.cv2() >= 1.0
        stored = pool.to_dict()


@given(st.floats(min_value=15.0, max_value=WINDOW_S), st.integers(min_value=8, max_value=200))
def test_it_rests_on_about_pool_windows_of_intervals_whatever_the_period(
    period_s: float, n: int
) -> None:
    """Overlapping windows are not counted twice: a reconcile adds the share of a window that
    is new since the last one, so the reconcile period does not change how much the pool
    rests on (POOL_WINDOWS windows' intervals, within 13 % at a period of one window)."""
    stored: dict[str, float] = {}
    steps = int(12 * POOL_WINDOWS * WINDOW_S / period_s)
    for i in range(steps):
        pool = pooled(stored, window(2.0 + 1e-9 * (i % 2), n=n), T0 + i * period_s, WINDOW_S)
        assert pool is not None
        stored = pool.to_dict()
    assert POOL_WINDOWS * n * 0.99 <= pool.intervals <= POOL_WINDOWS * n * 1.14


def test_one_wild_window_cannot_hold_the_model() -> None:
    """chat-8b-h100 (Poisson): a window that began at its load step read 4.9 after the windows
    over the step were left out for six minutes. It counts at most OUTLIER of its standard
    errors from the pool, so the model stays near Poisson; counted in full it would have put
    the pool at 2.1."""
    calm = ArrivalPool(1.2, 128.0, T0, 2, 1.1)
    wild = pooled(calm.to_dict(), window(4.9), T0 + 360.0, WINDOW_S)
    assert wild is not None and wild.last == 4.9
    assert wild.dispersion <= 1.2 + OUTLIER * 1.2 * math.sqrt(2.0 / 32)
    assert wild.cv2() < 1.2
    kept = 128.0 * math.exp(-360.0 / (POOL_WINDOWS * WINDOW_S))
    assert (kept * 1.2 + 32.0 * 4.9) / (kept + 32.0) > 2.0  # what full weight would give


def test_a_real_change_of_burstiness_moves_the_pool_at_its_own_pace() -> None:
    """Traffic that turns bursty (1 to 2.5) moves the pool as fast as an unbounded mean
    would, near enough: the bound costs a real change little."""
    stored = ArrivalPool(1.0, 128.0, T0, 2, 1.0).to_dict()
    for i in range(1, 61):  # 30 minutes of reconciles every 30 s at the new burstiness
        pool = pooled(stored, window(2.5 + 1e-9 * (i % 2)), T0 + 30.0 * i, WINDOW_S)
        assert pool is not None
        stored = pool.to_dict()
    unbounded = 2.5 - 1.5 * math.exp(-1800.0 / (POOL_WINDOWS * WINDOW_S))
    assert pool.dispersion > 0.95 * unbounded


def test_pooling_shrinks_the_noise_it_must_be_discounted_by() -> None:
    """The same dispersion over a pool of windows reads burstier than one window's."""
    stored: dict[str, float] = {}
    for i in range(40):
        pool = pooled(stored, window(2.0 + 1e-9 * (i % 2)), T0 + 60.0 * i, WINDOW_S)
        assert pool is not None
        stored = pool.to_dict()
    assert pool.cv2() > shrunk_cv2(2.0, 32) + 0.2


def test_decide_fits_at_the_pooled_burstiness_and_a_commit_keeps_it() -> None:
    state = TuningState.initial(KNOBS)
    for i, d in enumerate((2.6, 2.2)):
        snap = replace(make_snapshot(), arrival_dispersion=d, arrival_intervals=40)
        state = run(state, snap, now=NOW + timedelta(seconds=60 * i)).new_state
    pool = ArrivalPool.from_dict(state.calibration)
    assert pool is not None and 2.2 < pool.dispersion < 2.6 and pool.intervals > 40
    assert state.model_check is not None
    assert state.model_check.arrival_cv2 == pytest.approx(pool.cv2())
    # A window that reads Poisson on its own still predicts at the pool's burstiness.
    calm = replace(make_snapshot(), arrival_dispersion=None, arrival_intervals=0)
    after = run(state, calm, now=NOW + timedelta(seconds=300)).new_state
    assert after.model_check is not None
    assert after.model_check.arrival_cv2 == pytest.approx(pool.cv2())
    assert after.model_check.arrival_cv2 > 1.5


def test_a_commit_keeps_the_pool() -> None:
    """A committed candidate's fit replaces the calibration; the traffic's burstiness stays."""
    cand = Knobs(8192, 1024, 0.94)
    pool = ArrivalPool(2.3, 120.0, NOW.timestamp() - 60.0, 1, 2.4)
    served = _window_served(cand)
    state = replace(served, calibration={**served.calibration, **pool.to_dict()})
    d = run(state, make_snapshot(cand), now=NOW + timedelta(seconds=1), pods=ready_pods(cand))
    assert d.action == "commit", d.reason
    assert ArrivalPool.from_dict(d.new_state.calibration) == pool
