"""The operator's grid argmin and root finder give scipy's answers (scipy is the oracle here)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq, brute  # type: ignore[import-untyped,unused-ignore]

from vllm_autotuner.core.numeric import NoSignChange, find_root, grid_argmin

SCORES = st.one_of(
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    st.just(math.inf),
    st.just(-1.0),  # ties
)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(min_value=2, max_value=5), min_size=3, max_size=3),
    data=st.data(),
)
def test_grid_argmin_matches_scipy_brute(shape: list[int], data: st.DataObject) -> None:
    values = data.draw(
        st.lists(SCORES, min_size=math.prod(shape), max_size=math.prod(shape)), label="scores"
    )
    grid = np.asarray(values).reshape(shape)
    ours = grid_argmin(lambda idx: float(grid[idx]), shape)
    ranges = tuple(slice(0, n, 1) for n in shape)
    theirs = brute(lambda x: float(grid[tuple(round(v) for v in x)]), ranges, finish=None)
    assert ours == tuple(round(v) for v in np.atleast_1d(theirs))


def test_grid_argmin_takes_the_first_of_equal_scores_in_c_order() -> None:
    assert grid_argmin(lambda idx: 0.0, (2, 3, 4)) == (0, 0, 0)
    assert grid_argmin(lambda idx: math.inf, (2, 2)) == (0, 0)
    assert grid_argmin(lambda idx: -1.0 if idx[1] == 2 else 0.0, (3, 3)) == (0, 2)


def test_grid_argmin_handles_a_single_point_and_evaluates_each_point_once() -> None:
    seen: list[tuple[int, ...]] = []

    def score(idx: tuple[int, ...]) -> float:
        seen.append(idx)
        return float(sum(idx))

    assert grid_argmin(score, (1, 1, 1)) == (0, 0, 0)
    seen.clear()
    grid_argmin(score, (2, 3, 2))
    assert len(seen) == len(set(seen)) == 12


def test_grid_argmin_refuses_an_empty_axis() -> None:
    with pytest.raises(ValueError, match="at least one point"):
        grid_argmin(lambda idx: 0.0, (2, 0, 1))


MONOTONE = st.tuples(
    st.floats(min_value=-5.0, max_value=5.0),  # the root
    st.floats(min_value=0.01, max_value=100.0),  # linear slope
    st.floats(min_value=0.0, max_value=10.0),  # cubic term
    st.floats(min_value=0.0, max_value=3.0),  # exponential term
)


@settings(max_examples=300, deadline=None)
@given(params=MONOTONE, xtol=st.sampled_from([1e-4, 1e-6, 1e-9]), sign=st.sampled_from([1, -1]))
def test_find_root_agrees_with_brentq(
    params: tuple[float, float, float, float], xtol: float, sign: int
) -> None:
    root, slope, cubic, expo = params

    def f(x: float) -> float:
        d = x - root
        return sign * (slope * d + cubic * d**3 + expo * (math.exp(d) - 1.0))

    lo, hi = -6.0, 6.5
    ours = find_root(f, lo, hi, xtol=xtol)
    theirs = float(brentq(f, lo, hi, xtol=xtol))
    assert abs(ours - root) <= xtol * 1.01 + 1e-12
    assert abs(ours - theirs) <= 2 * xtol * 1.01 + 1e-12


def test_find_root_needs_few_evaluations_on_smooth_residuals() -> None:
    # The calibration's residuals are smooth and monotone; bisection would need ~17 here.
    calls = 0

    def f(x: float) -> float:
        nonlocal calls
        calls += 1
        return math.exp(x) * 0.01 + 0.002 * x - 0.5

    x = find_root(f, math.log(0.02), math.log(50.0), xtol=1e-4)
    assert abs(f(x)) < 1e-3
    assert calls <= 14


def test_find_root_survives_a_step_function() -> None:
    # Not continuous: false position stalls on a step; the bisection guard still converges.
    x = find_root(lambda v: -1.0 if v < 0.3 else 1.0, 0.0, 1.0, xtol=1e-6)
    assert abs(x - 0.3) <= 1e-6


def test_find_root_returns_an_exact_end() -> None:
    assert find_root(lambda v: v, 0.0, 1.0, xtol=1e-3) == 0.0
    assert find_root(lambda v: v - 1.0, 0.0, 1.0, xtol=1e-3) == 1.0


@pytest.mark.parametrize(
    ("f", "lo", "hi", "error"),
    [
        (lambda v: v + 5.0, 0.0, 1.0, NoSignChange),
        (lambda v: math.nan, 0.0, 1.0, NoSignChange),
        (lambda v: v, 1.0, 0.0, ValueError),
        (lambda v: v, 0.0, math.inf, ValueError),
    ],
)
def test_find_root_refuses_what_brackets_no_root(f, lo, hi, error) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error):
        find_root(f, lo, hi, xtol=1e-6)
