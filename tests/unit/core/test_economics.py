"""Worth the restart, and headroom: the arithmetic that keeps tuning from costing users.

- cost: zero with surge; otherwise restarts x load time x (rate + overload harm), monotone in
  each; a canary costs one restart more than a rolling trial;
- gain: zero when the current knobs already carry the reference load, never negative,
  monotone in the new capacity and in the time the knobs are kept;
- worth: only a gain that exceeds the cost; a confirmed violation the candidate can carry is
  a gain whatever the model thinks of the current knobs;
- headroom: always with surge; without it, the pods that stay carry the load (one replica
  without surge never has headroom under load);
- the overload a restart causes: none exactly when there is headroom, never the excess the
  deployment has anyway (at most one pod's capacity), monotone in the load; the cost with it
  is never below the plain restart's;
- the wait for headroom (ski rental): never past the limit, none when going now costs no
  more, monotone in the extra cost and antitone in the gain rate, and whenever headroom
  comes (or never) at most twice the cost of the best choice in hindsight.
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
    headroom_wait_s,
    keep_time_s,
    restart_overload_rps,
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


@pytest.mark.parametrize(
    ("replicas", "surge", "capacity", "rate", "overload"),
    [
        (2, 0, 10.0, 4.0, 0.0),  # one pod carries the 8 req/s: headroom
        (2, 0, 10.0, 6.0, 2.0),  # 12 req/s on one pod of 10 while the other loads
        (2, 0, 10.0, 15.0, 10.0),  # past 20 req/s already: the restart takes one pod's 10
        (3, 0, 10.0, 12.0, 10.0),  # 36 on 30 anyway; on 20 while out: 6 + 10 -> 10 more
        (1, 0, 10.0, 4.0, 4.0),  # one pod: its restart takes all it serves
        (1, 0, 10.0, 40.0, 10.0),  # ... and no more than its capacity
        (2, 0, 0.0, 5.0, 0.0),  # pods that serve nothing within the SLO lose nothing
        (2, 1, 10.0, 15.0, 0.0),  # surge: no pod is taken out
    ],
)
def test_restart_overload_table(
    replicas: int, surge: int, capacity: float, rate: float, overload: float
) -> None:
    c = ctx(replicas, surge)
    assert restart_overload_rps(c, capacity, rate) == pytest.approx(overload)


def test_worth_text_shows_the_cost_without_headroom() -> None:
    """chat-8b-h100 without surge, past its capacity (28 req/s/pod on pods that serve 19.1):
    the overload a canary's three restarts cause is one pod's 19.1 req/s, not the 37.7 req/s
    the deployment is short of anyway."""
    w = worth_restart(ctx(), RolloutRules(max_per_day=12), "Canary", 19.1, 28.66, 28.0, 28.0)
    assert w.cost_requests == pytest.approx(3 * 120 * 28.0)
    assert w.cost_now_requests == pytest.approx(3 * 120 * (28.0 + OVERLOAD_HARM * 19.1))
    assert f"{w.cost_now_requests:,.0f} requests without headroom (19.10 req/s" in w.text
    assert w.gain_rate == pytest.approx((28.0 - 19.1) * 2)
    assert (
        "without headroom"
        not in worth_restart(ctx(), RolloutRules(), "Canary", 19.1, 28.66, 5.0, 5.0).text
    )


def test_headroom_wait_table() -> None:
    assert headroom_wait_s(3000.0, 1000.0, 10.0, 3600.0) == pytest.approx(200.0)
    assert headroom_wait_s(3000.0, 1000.0, 0.1, 3600.0) == 3600.0  # at most the limit
    assert headroom_wait_s(3000.0, 1000.0, 0.0, 3600.0) == 3600.0  # nothing lost by waiting
    assert headroom_wait_s(1000.0, 1000.0, 10.0, 3600.0) == 0.0  # going now costs no more
    assert headroom_wait_s(3000.0, 1000.0, 10.0, -5.0) == 0.0


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


@given(
    replicas=st.integers(0, 64),
    surge=st.integers(0, 2),
    strategy=st.sampled_from(STRATEGIES),
    capacity=capacities,
    rate=rates,
    more_rate=rates,
)
def test_the_cost_counts_only_the_overload_the_restart_causes(
    replicas: int,
    surge: int,
    strategy: Strategy,
    capacity: float,
    rate: float,
    more_rate: float,
) -> None:
    c = ctx(replicas, surge)
    n = max(1, replicas)

    def cost(r: float) -> float:
        return cost_requests(c, strategy, r, restart_overload_rps(c, capacity, r))

    overload = restart_overload_rps(c, capacity, rate)
    plain = cost_requests(c, strategy, rate)
    assert cost(rate) >= plain  # never below the capacity lost without surge
    assert cost(rate + more_rate) >= cost(rate) * (1 - 1e-12)  # monotone in the load
    # Never the excess the deployment has anyway: at most the one pod's capacity, and once
    # every pod is past its capacity more traffic adds nothing to the overload.
    assert 0.0 <= overload <= capacity * (1 + 1e-12)
    if surge == 0 and rate >= capacity:
        assert overload == pytest.approx(capacity)
        assert restart_overload_rps(c, capacity, rate + more_rate) == pytest.approx(overload)
    if surge > 0:
        assert overload == 0.0
    elif capacity > 0:
        # No overload exactly when the pods that stay carry the traffic.
        assert (overload == 0.0) == headroom(c, capacity, rate).ok or rate * n == 0.0


@given(
    cost_room=st.floats(0.0, 1e7),
    extra=st.floats(-1e6, 1e7),
    more_extra=st.floats(0.0, 1e7),
    gain_rate=st.floats(0.0, 1e4),
    more_rate=st.floats(0.0, 1e4),
    limit=st.floats(0.0, 1e5),
)
def test_headroom_wait_properties(
    cost_room: float,
    extra: float,
    more_extra: float,
    gain_rate: float,
    more_rate: float,
    limit: float,
) -> None:
    cost_now = cost_room + extra
    w = headroom_wait_s(cost_now, cost_room, gain_rate, limit)
    assert 0.0 <= w <= limit  # never past the limit
    if cost_now <= cost_room:
        assert w == 0.0  # going now costs no more: no reason to wait
    # Longer when going now costs more; shorter when waiting loses more.
    assert headroom_wait_s(cost_now + more_extra, cost_room, gain_rate, limit) >= w
    assert headroom_wait_s(cost_now, cost_room, gain_rate + more_rate, limit) <= w


@given(
    cost_room=st.floats(0.0, 1e6),
    extra=st.floats(0.0, 1e6),
    gain_rate=st.floats(1e-3, 1e4),
    slack=st.floats(0.0, 1e6),
    arrives=st.one_of(st.none(), st.floats(0.0, 1e7)),
)
def test_the_wait_costs_at_most_twice_the_best_choice_in_hindsight(
    cost_room: float, extra: float, gain_rate: float, slack: float, arrives: float | None
) -> None:
    """Headroom comes at `arrives` seconds (None: never). Waiting costs the gain rate per
    second; going costs the restart with the overload, or without it once headroom is here.
    The rule waits `headroom_wait_s`, then goes; the best in hindsight either goes at once
    or waits exactly until headroom comes. (A limit below the break-even trades this bound
    for a shorter wait: headroom just after the limit costs up to 1 + extra ÷ (gain rate x
    limit) times the best.)"""
    cost_now = cost_room + extra
    w = headroom_wait_s(cost_now, cost_room, gain_rate, extra / gain_rate + slack)
    if arrives is not None and arrives <= w:
        rule = gain_rate * arrives + cost_room
    else:
        rule = gain_rate * w + cost_now
    best = cost_now if arrives is None else min(cost_now, gain_rate * arrives + cost_room)
    assert rule <= 2.0 * best * (1 + 1e-9) + 1e-9
