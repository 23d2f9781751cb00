"""The two numerical routines the tuner needs: an exhaustive grid argmin and a bracketed root.

Why not scipy.optimize (its `brute` and `brentq` did this job until the scale benchmark): the
operator would import all of scipy.optimize for them, and that package loads its LP solvers,
sparse and dense linear algebra and FFT on import: 38 MiB of resident memory in a process whose
goal is 256 MiB at a thousand deployments (docs/scale.md). Both routines are small, and the
tests check them against scipy's on random problems, so the operator keeps scipy's answers
without its weight. scipy stays for the benchmarks' baseline tuners (bench/tuning) and the tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np


def grid_argmin(score: Callable[[tuple[int, ...]], float], shape: Sequence[int]) -> tuple[int, ...]:
    """The index of the lowest score over the whole grid, scanned in C order.

    Ties and all-infinite grids resolve to the first index in C order (the last axis varies
    fastest) and a NaN counts as the lowest, exactly as numpy's argmin over the flattened grid
    (what scipy.optimize.brute with finish=None returns), so the search stays deterministic.
    """
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"grid_argmin needs at least one point on every axis, got {tuple(shape)}")
    points = list(itertools.product(*(range(n) for n in shape)))
    scores = np.fromiter((score(p) for p in points), dtype=float, count=len(points))
    return points[int(np.argmin(scores))]


class NoSignChange(ValueError):
    """f(lo) and f(hi) have the same sign: the interval brackets no root."""


def find_root(
    f: Callable[[float], float], lo: float, hi: float, xtol: float, max_evaluations: int = 200
) -> float:
    """A root of a continuous `f` inside [lo, hi], where f(lo) and f(hi) differ in sign.

    The Illinois variant of false position, with a bisection step whenever the bracket has not
    at least halved over two steps: superlinear on the smooth, monotone residuals the
    calibration solves (about as few evaluations as Brent's method), never slower than
    bisection on anything else. Returns a point within `xtol` of a sign change of `f`.
    """
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"find_root needs finite lo < hi, got [{lo}, {hi}]")
    if not xtol > 0:
        raise ValueError(f"find_root needs xtol > 0, got {xtol}")
    f_lo, f_hi = f(lo), f(hi)
    evaluations = 2
    if f_lo == 0:
        return lo
    if f_hi == 0:
        return hi
    if math.isnan(f_lo) or math.isnan(f_hi) or (f_lo > 0) == (f_hi > 0):
        raise NoSignChange(f"f({lo}) = {f_lo} and f({hi}) = {f_hi} do not bracket a root")
    kept_lo = kept_hi = 0  # how many steps in a row an end stayed put (Illinois)
    width_before = [math.inf, math.inf]  # the bracket's width one and two steps ago
    while hi - lo > 2 * xtol:
        if evaluations >= max_evaluations:
            raise RuntimeError(f"find_root: no convergence in {max_evaluations} evaluations")
        if hi - lo > 0.5 * width_before[0]:
            x = 0.5 * (lo + hi)  # two steps did not halve the bracket: bisect
        else:
            x = hi - f_hi * (hi - lo) / (f_hi - f_lo)
            # Keep the probe off the ends, so every step shrinks the bracket by xtol or more.
            x = min(max(x, lo + xtol), hi - xtol)
        width_before = [width_before[1], hi - lo]
        f_x = f(x)
        evaluations += 1
        if f_x == 0:
            return x
        if math.isnan(f_x):
            raise ValueError(f"find_root: f({x}) is NaN")
        if (f_x > 0) == (f_lo > 0):
            lo, f_lo = x, f_x
            kept_lo, kept_hi = 0, kept_hi + 1
            if kept_hi >= 2:
                f_hi *= 0.5
        else:
            hi, f_hi = x, f_x
            kept_hi, kept_lo = 0, kept_lo + 1
            if kept_lo >= 2:
                f_lo *= 0.5
    return 0.5 * (lo + hi)
