"""The real analytic model, with its answers shared by every test in the process.

`AnalyticModel` is a pure function of its inputs (common random numbers: the same inputs give
the same outputs, checked in test_calibration.py), so remembering its answers changes no
decision; it only spares the property tests from fitting the same window and predicting the
same candidates again. A decision with a search costs 0.5-1 s of model time, and decide()'s
properties re-run decisions (determinism, a remembered search, a forged memo) and walk the
same windows through many reconciles.

`CORE_PROPERTY_SCALE` multiplies the example counts of the expensive properties
(`scaled(n)`): `CORE_PROPERTY_SCALE=5 pytest tests/unit/core` runs them at five times the
default count, for a thorough run before a release.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

from vllm_autotuner.core.perf_model import AnalyticModel, Calibration, Workload
from vllm_autotuner.core.snapshot import Snapshot
from vllm_autotuner.core.tuning_types import DeploymentContext, Knobs

_LIMIT = 200_000
_CALIBRATIONS: dict[Hashable, Calibration] = {}


def scaled(examples: int) -> int:
    """An expensive property's example count, times CORE_PROPERTY_SCALE (default 1)."""
    return max(1, round(examples * float(os.environ.get("CORE_PROPERTY_SCALE", "1"))))


def _cal_key(cal: Calibration | None) -> Hashable:
    return None if cal is None else tuple(sorted(cal.to_dict().items()))


def _remember(cache: dict[Hashable, Any], key: Hashable, value: Any) -> None:
    if len(cache) >= _LIMIT:
        cache.clear()
    cache[key] = value


class SharedModel(AnalyticModel):
    """AnalyticModel whose calibrations are remembered process-wide (its predictions are
    remembered by the model itself: perf_model.PREDICT_CACHE)."""

    def calibrate(
        self,
        snapshot: Snapshot,
        knobs: Knobs,
        ctx: DeploymentContext,
        workload: Workload,
        prior: Calibration | None,
    ) -> Calibration:
        key = (snapshot, knobs, ctx, workload, _cal_key(prior))
        hit = _CALIBRATIONS.get(key)
        if hit is not None:
            self.bind(ctx)  # predictions after a calibration use that deployment's physics
            return hit
        cal = super().calibrate(snapshot, knobs, ctx, workload, prior)
        _remember(_CALIBRATIONS, key, cal)
        return cal
