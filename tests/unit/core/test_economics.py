"""Worth the restart, and headroom: the arithmetic that keeps tuning from costing users.

- cost: zero with surge; otherwise restarts x load time x (rate + overload harm), monotone in
  each; a canary costs one restart more than a rolling trial;
- gain: zero when the current knobs already carry the reference load, never negative,
  monotone in the new capacity and in the time the knobs are kept;
- worth: only a gain that exceeds the cost; a confirmed violation the candidate can carry is
  a gain whatever the model thinks of the current knobs;
- headroom: always with surge; without it, the pods that stay carry the load (one replica
  without surge never has headroom under load).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_autotuner.core.economics import (
    DAY_S,
    OVERLOAD_HARM,
    cost_requests,
    gain_requests,
    headroom,
    keep_time_s,
    restarts,
    worth_restart,
)
from vllm_autotuner.core.tuning_types import (
    DeploymentContext,
    RolloutRules,
    RolloutSettings,
    Strategy,
)

STRATEGIES: list[Strategy] = ["Rolling", "Canary"]
rates = st.floats(0.0, 1000.0)
capacities = st.floats(0.0, 1000.0)


def ctx(replicas: int = 2, surge: int = 0, load_time_s: float = 120.0) -> DeploymentContext:
    return DeploymentContext(
        model="meta-llama/Llama-3.1-8B-Instruct",
        gpu_product="H100",
        replicas=replicas,
        rollout=RolloutSettings(max_surge=surge, load_time_s=load_time_s),
    )


# ------------------------------------------------------------------------------------- tables


@pytest.mark.parametrize(
    ("replicas", "surge", "strategy", "rate", "excess", "cost"),
    [
        (2, 0, "Rolling", 10.0, 0.0, 2 * 120 * 10.0),
        (2, 0, "Canary", 10.0, 0.0, 3 * 120 * 10.0),
        (1, 0, "Rolling", 10.0, 0.0, 1 * 120 * 10.0),
        (0, 0, "Rolling", 10.0, 0.0, 1 * 120 * 10.0),  # at least one restart
        (2, 0, "Rolling", 10.0, 3.0, 2 * 120 * (10.0 + OVERLOAD_HARM * 3.0)),
        (2, 0, "Rolling", -5.0, -1.0, 0.0),  # negative inputs never make a negative cost
        (2, 1, "Canary", 10.0, 3.0, 0.0),  # surge: nothing is lost
    ],
)
def test_cost_table(
    replicas: int, surge: int, strategy: Strategy, rate: float, excess: float, cost: float
) -> None:
    assert cost_requests(ctx(replicas, surge), strategy, rate, excess) == pytest.approx(cost)


@pytest.mark.parametrize(
    ("now", "new", "rate", "replicas", "keep", "gain"),
    [
        (5.0, 8.0, 7.0, 2, 100.0, (7.0 - 5.0) * 2 * 100.0),  # the gain stops at the load
        (5.0, 8.0, 10.0, 2, 100.0, (8.0 - 5.0) * 2 * 100.0),  # and at the new capacity
        (5.0, 8.0, 4.0, 2, 100.0, 0.0),  # the current knobs carry the load: nothing to win
        (8.0, 5.0, 10.0, 2, 100.0, 0.0),  # a worse candidate is no gain (never negative)
        (5.0, 8.0, 10.0, 0, 100.0, 3.0 * 1 * 100.0),  # at least one pod
    ],
)
def test_gain_table(
    now: float, new: float, rate: float, replicas: int, keep: float, gain: float
) -> None:
    assert gain_requests(now, new, rate, replicas, keep) == pytest.approx(gain)


def test_keep_time_is_the_rollout_budgets_spacing() -> None:
    assert keep_time_s(RolloutRules(min_interval_s=1800, max_per_day=4)) == DAY_S / 4
    assert keep_time_s(RolloutRules(min_interval_s=DAY_S, max_per_day=4)) == DAY_S
    assert keep_time_s(RolloutRules(min_interval_s=0, max_per_day=0)) == DAY_S


def test_worth_text_shows_both_numbers() -> None:
    w = worth_restart(ctx(), RolloutRules(), "Canary", 5.0, 8.0, 7.0, 7.0)
    assert w.worth
    assert f"expected gain {w.gain_requests:,.0f}" in w.text
    assert f"restart cost {w.cost_requests:,.0f}" in w.text
    assert "3 pod restarts x 120 s x 7.00 req/s" in w.text
    surge = worth_restart(ctx(surge=1), RolloutRules(), "Canary", 5.0, 8.0, 7.0, 7.0)
    assert "with surge, no capacity lost" in surge.text and surge.cost_requests == 0.0


def test_headroom_table() -> None:
    assert headroom(ctx(2), 10.0, 5.0).ok  # one pod carries 10 req/s, traffic 10
    assert not headroom(ctx(2), 9.9, 5.0).ok
    assert headroom(ctx(2, surge=1), 1.0, 5.0).ok
    one = headroom(ctx(1), 100.0, 0.5)
    assert not one.ok and one.carry_rps == 0.0
    assert "0 pods that stay can serve 0.00 req/s" in one.text
    two = headroom(ctx(2), 10.0, 5.0).text
    assert "can serve 10.00 req/s within the SLO, traffic is 10.00 req/s" in two


# --------------------------------------------------------------------------------- properties


@given(
    replicas=st.integers(0, 64),
    surge=st.integers(1, 4),
    strategy=st.sampled_from(STRATEGIES),
    rate=rates,
    excess=rates,
    load_time=st.floats(0.0, 3600.0),
)
def test_cost_is_zero_with_surge(
    replicas: int, surge: int, strategy: Strategy, rate: float, excess: float, load_time: float
) -> None:
    assert cost_requests(ctx(replicas, surge, load_time), strategy, rate, excess) == 0.0


@given(
    replicas=st.integers(0, 64),
    strategy=st.sampled_from(STRATEGIES),
    rate=rates,
    more_rate=rates,
    excess=rates,
    more_excess=rates,
    load_time=st.floats(0.0, 3600.0),
    more_time=st.floats(0.0, 3600.0),
)
def test_cost_is_monotone_in_load_time_rate_and_overload(
    replicas: int,
    strategy: Strategy,
    rate: float,
    more_rate: float,
    excess: float,
    more_excess: float,
    load_time: float,
    more_time: float,
) -> None:
    base = cost_requests(ctx(replicas, 0, load_time), strategy, rate, excess)
    assert base >= 0.0
    assert cost_requests(ctx(replicas, 0, load_time + more_time), strategy, rate, excess) >= base
    assert cost_requests(ctx(replicas, 0, load_time), strategy, rate + more_rate, excess) >= base
    longer = cost_requests(ctx(replicas, 0, load_time), strategy, rate, excess + more_excess)
    assert longer >= base
    # A canary restarts one pod more than a rolling trial: it never costs less.
    rolling = cost_requests(ctx(replicas, 0, load_time), "Rolling", rate, excess)
    canary = cost_requests(ctx(replicas, 0, load_time), "Canary", rate, excess)
    assert canary >= rolling
    assert restarts(ctx(replicas), "Canary") == restarts(ctx(replicas), "Rolling") + 1


@given(
    now=capacities,
    new=capacities,
    more=capacities,
    rate=rates,
    replicas=st.integers(0, 64),
    keep=st.floats(0.0, DAY_S),
)
def test_gain_properties(
    now: float, new: float, more: float, rate: float, replicas: int, keep: float
) -> None:
    g = gain_requests(now, new, rate, replicas, keep)
    assert g >= 0.0
    if now >= rate:
        # The current knobs carry the reference load: nothing to win, whatever the candidate.
        assert g == 0.0
    if new <= now:
        assert g == 0.0
    assert gain_requests(now, new + more, rate, replicas, keep) >= g
    assert gain_requests(now, new, rate, replicas, keep * 2.0) >= g
    # Never more than the whole load over the keep time.
    assert g <= rate * max(1, replicas) * keep * (1 + 1e-9)


@given(
    replicas=st.integers(1, 16),
    surge=st.integers(0, 2),
    strategy=st.sampled_from(STRATEGIES),
    now=capacities,
    new=capacities,
    rate=rates,
    peak=rates,
    miss=st.floats(0.0, 1.0),
    per_day=st.integers(0, 24),
)
def test_worth_restart_properties(
    replicas: int,
    surge: int,
    strategy: Strategy,
    now: float,
    new: float,
    rate: float,
    peak: float,
    miss: float,
    per_day: int,
) -> None:
    c = ctx(replicas, surge)
    rules = RolloutRules(max_per_day=per_day)
    rate_ref = max(rate, peak)
    w = worth_restart(c, rules, strategy, now, new, rate, rate_ref, miss)
    assert w.cost_requests == cost_requests(c, strategy, rate)
    assert w.keep_s == keep_time_s(rules)
    # Worth it exactly when the gain is positive and exceeds the cost.
    assert w.worth == (w.gain_requests > w.cost_requests and w.gain_requests > 0)
    assert w.gain_requests >= gain_requests(now, new, rate_ref, replicas, w.keep_s)
    if miss == 0.0:
        assert w.gain_requests == gain_requests(now, new, rate_ref, replicas, w.keep_s)
        if now >= rate_ref:
            assert not w.worth  # the current knobs carry the load that matters
    elif new >= rate:
        # A confirmed violation the candidate can carry is a gain in itself.
        assert w.gain_requests >= rate * miss * replicas * w.keep_s * (1 - 1e-9)
    if surge > 0:
        assert w.worth == (w.gain_requests > 0)


@given(
    replicas=st.integers(0, 64),
    surge=st.integers(0, 3),
    capacity=capacities,
    more_capacity=capacities,
    rate=rates,
    more_rate=rates,
)
def test_headroom_properties(
    replicas: int,
    surge: int,
    capacity: float,
    more_capacity: float,
    rate: float,
    more_rate: float,
) -> None:
    c = ctx(replicas, surge)
    room = headroom(c, capacity, rate)
    n = max(1, replicas)
    assert room.load_rps == pytest.approx(rate * n)
    if surge > 0:
        assert room.ok
        return
    assert room.ok == (capacity * (n - 1) >= rate * n)
    if n == 1 and rate > 0:
        assert not room.ok  # one pod without surge: its restart leaves nobody to serve
    # More capacity never takes headroom away; more traffic never adds it.
    if room.ok:
        assert headroom(c, capacity + more_capacity, rate).ok
    else:
        assert not headroom(c, capacity, rate + more_rate).ok
