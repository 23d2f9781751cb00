"""The arrivals' burstiness from one window's first-token counts (adapters/promql.py
`_dispersion`): each pod's variance over mean per scrape interval, pooled, from pods whose load
held steady or moved as a ramp."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_autotuner.adapters.promql import (
    DISPERSION_SEGMENTS,
    PART_LABEL,
    Sample,
    _dispersion,
)

WINDOW_S = 300  # 40 subquery steps of 7 s; 21 scrapes at 15 s hold 20 intervals
SCRAPES = 21


def pod(means: Sequence[float], variances: Sequence[float]) -> list[Sample]:
    """One pod's answer: its scrape count and each segment's mean and variance of counts."""
    out = [Sample({PART_LABEL: "n"}, float(SCRAPES))]
    for j, (m, v) in enumerate(zip(means, variances, strict=True)):
        out += [Sample({PART_LABEL: f"mean{j}"}, m), Sample({PART_LABEL: f"var{j}"}, v)]
    return out


def test_a_steady_bursty_pod_reads_its_own_dispersion() -> None:
    k = DISPERSION_SEGMENTS
    d, n = _dispersion({"a": pod([200.0] * k, [400.0] * k)}, WINDOW_S)
    per_segment = (SCRAPES - 1) / k
    assert d == pytest.approx(2.0 * per_segment / (per_segment - 1))
    assert n == SCRAPES - 1 - k


@given(st.floats(min_value=-40.0, max_value=40.0))
def test_a_ramp_of_load_is_not_left_out(slope: float) -> None:
    """A pod whose load rises or falls steadily through the window (bursty-8b-h100's ramp;
    a daily cycle) keeps its dispersion, whatever the slope: its segments' means lie on a
    line. The spread about their mean would have left it out from a slope of about 12."""
    means = [300.0 + slope * j for j in range(DISPERSION_SEGMENTS)]
    d, n = _dispersion({"a": pod(means, [600.0] * DISPERSION_SEGMENTS)}, WINDOW_S)
    assert d is not None and n > 0


def test_a_step_of_load_is_left_out() -> None:
    """chat-8b-h100's step from 16 to 28 req/s per pod, inside the window: counts per 15 s
    of 240 and then 420, Poisson within each segment. A step is not a line."""
    steady, stepped = (
        pod([240.0] * 4, [240.0] * 4),
        pod([420.0, 420.0, 240.0, 240.0], [420.0, 420.0, 240.0, 240.0]),
    )
    assert _dispersion({"b": stepped}, WINDOW_S) == (None, 0)
    d, n = _dispersion({"a": steady, "b": stepped}, WINDOW_S)
    assert d == pytest.approx(240.0 / 240.0 * 5.0 / 4.0) and n == SCRAPES - 1 - 4


def test_a_step_inside_a_segment_is_left_out() -> None:
    """The step inside one segment: that segment's own variance is the step's, and the
    means bend off the line."""
    means = [420.0, 420.0, 348.0, 240.0]
    variances = [420.0, 420.0, 7776.0 + 330.0, 240.0]
    assert _dispersion({"b": pod(means, variances)}, WINDOW_S) == (None, 0)
