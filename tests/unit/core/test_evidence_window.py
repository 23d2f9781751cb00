"""How long a window the next decision reads (core/snapshot.evidence_window_s)."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st

from tests.unit.core.test_decide import make_snapshot
from vllm_autotuner.core.snapshot import MAX_WINDOW_FACTOR, Snapshot, evidence_window_s

NOW = datetime(2026, 12, 6, tzinfo=UTC)


def _window(completed: int, seconds: float) -> Snapshot:
    return replace(make_snapshot(completed=completed), window_s=seconds)


def test_no_usable_window_keeps_the_policys() -> None:
    assert evidence_window_s(300.0, 200, None) == 300.0
    assert evidence_window_s(300.0, 200, Snapshot.unavailable(NOW, 300.0, "down")) == 300.0
    assert evidence_window_s(300.0, 200, _window(0, 300.0)) == 300.0
    assert evidence_window_s(300.0, 0, _window(10, 300.0)) == 300.0


def test_a_busy_deployment_reads_the_policys_window() -> None:
    assert evidence_window_s(300.0, 200, _window(1200, 300.0)) == 300.0


def test_a_quiet_deployment_reads_back_far_enough_to_count_its_requests() -> None:
    """Three 32B pods at 0.14 req/s each: 126 requests in 5 min, 220 need 10 min."""
    assert evidence_window_s(300.0, 200, _window(126, 300.0)) == 600.0
    # The rate decides, not the count: the 10-minute window that counted 252 stays.
    assert evidence_window_s(300.0, 200, _window(252, 600.0)) == 600.0
    # A window clipped by a young revision measures the rate as well.
    assert evidence_window_s(300.0, 200, _window(21, 50.0)) == 600.0


def test_the_window_never_reads_back_more_than_its_cap() -> None:
    assert evidence_window_s(300.0, 200, _window(3, 300.0)) == MAX_WINDOW_FACTOR * 300.0


@given(
    st.floats(60.0, 3600.0),
    st.integers(1, 10_000),
    st.integers(1, 100_000),
    st.floats(10.0, 7200.0),
)
def test_the_window_is_a_whole_multiple_that_counts_enough_or_the_cap(
    window: float, min_requests: int, completed: int, seconds: float
) -> None:
    got = evidence_window_s(window, min_requests, _window(completed, seconds))
    factor = got / window
    assert math.isclose(factor, round(factor)) and 1 <= round(factor) <= MAX_WINDOW_FACTOR
    rate = completed / seconds
    if round(factor) < MAX_WINDOW_FACTOR:
        assert rate * got >= 1.1 * min_requests * (1 - 1e-9)
    if round(factor) > 1:  # no longer than needed
        assert rate * (got - window) < 1.1 * min_requests


@given(st.integers(1, 5000), st.integers(1, 5000))
def test_more_traffic_never_needs_a_longer_window(a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert evidence_window_s(300.0, 200, _window(hi, 300.0)) <= evidence_window_s(
        300.0, 200, _window(lo, 300.0)
    )
