"""The paired canary verdict: the canary pod against the baseline pods over the same window.

Windows here are built from ITL histogram counts, as the Prometheus adapter reads them: the
share of requests over the 50 ms threshold is known exactly when a bucket bound sits on the
threshold, and only within the neighbouring bounds otherwise. The invariants:

- never Promote without significant evidence (a fixed violation) or, at the end of the
  window, a capacity gain of at least minGainPct with no target significantly worse;
- Reject a canary significantly worse on a target it then misses, at any time;
- Pending before the window ends, unless the evidence is significant; Reject at the end when
  there is not enough data;
- p-values are in [0, 1]; identical windows show no difference; swapping a losing canary
  with its baseline makes a winner; a canary that misses less never gets a worse verdict.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from vllm_autotuner.core.canary import (
    EARLY_SIGNIFICANCE,
    SIGNIFICANCE,
    Misses,
    cautious_slo,
    judge_canary,
    miss_share,
    misses,
    worse_p_value,
)
from vllm_autotuner.core.snapshot import LatencySummary, Snapshot
from vllm_autotuner.core.tuning_types import SLO, SLOTarget

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
THRESHOLD = 50.0
TARGET = SLOTarget(95.0, THRESHOLD)
SLO_ITL = SLO(itl=TARGET)
MIN_REQUESTS = 30
RANK = {"Reject": 0, "Pending": 1, "Promote": 2}


def window(
    n: int, miss: float, spread: float = 0.0, pods: int = 1, tokens_per_request: int = 100
) -> Snapshot:
    """`n` requests, `miss` of their inter-token gaps over the threshold. With `spread` > 0
    no bucket bound sits on the threshold: the buckets at 25 and 100 ms leave the share
    anywhere in [miss - spread, miss + spread] (clipped to [0, 1])."""
    total = float(max(n, 0) * tokens_per_request)
    under = total * (1.0 - miss)
    if spread > 0:
        lo = total * (1.0 - min(1.0, miss + spread))
        hi = total * (1.0 - max(0.0, miss - spread))
        buckets: tuple[tuple[float, float], ...] = ((25.0, lo), (100.0, hi), (math.inf, total))
    else:
        buckets = ((25.0, under * 0.5), (THRESHOLD, under), (100.0, under), (math.inf, total))
    return Snapshot(
        time=NOW,
        window_s=300.0,
        num_pods=pods,
        request_rate=n / 300.0,
        completed_requests=n,
        itl=LatencySummary(p95_ms=THRESHOLD, buckets=buckets if n > 0 else ()),
    )


def judge(
    base: Snapshot,
    can: Snapshot,
    final: bool,
    caps: tuple[float | None, float | None] = (None, None),
    min_gain: float = 5.0,
) -> str:
    return judge_canary(base, can, SLO_ITL, MIN_REQUESTS, caps[0], caps[1], min_gain, final).verdict


def sides(base: Snapshot, can: Snapshot) -> tuple[Misses, Misses]:
    b, c = misses(base, "itl", TARGET), misses(can, "itl", TARGET)
    assert b is not None and c is not None
    return b, c


# ------------------------------------------------------------------------------------- tables


@pytest.mark.parametrize(
    ("base", "can", "final", "caps", "verdict", "why"),
    [
        # The canary misses 15% of gaps against the baseline's 2%: worse, and over the SLO.
        (window(2000, 0.02), window(1000, 0.15), False, (None, None), "Reject", "p="),
        # The baseline misses 15%, the canary 2%: a fixed violation, promoted early.
        (window(2000, 0.15), window(1000, 0.02), False, (None, None), "Promote", "fixes"),
        # Equal and within the SLO: no evidence yet.
        (window(2000, 0.02), window(1000, 0.02), False, (None, None), "Pending", "no sig"),
        # ... and at the end only a capacity gain promotes it.
        (window(2000, 0.02), window(1000, 0.02), True, (10.0, 10.4), "Reject", "no gain"),
        (window(2000, 0.02), window(1000, 0.02), True, (10.0, 10.6), "Promote", "+6.0%"),
        (window(2000, 0.02), window(1000, 0.02), True, (None, None), "Reject", "no measurable"),
        # Too few requests: wait, then give up.
        (window(2000, 0.02), window(10, 0.0), False, (None, None), "Pending", "waiting"),
        (window(2000, 0.02), window(10, 0.0), True, (10.0, 20.0), "Reject", "window ended"),
        # A canary worse but still within the SLO is not rejected for it.
        (window(5000, 0.001), window(5000, 0.03), False, (None, None), "Pending", "no sig"),
    ],
)
def test_verdict_table(
    base: Snapshot,
    can: Snapshot,
    final: bool,
    caps: tuple[float | None, float | None],
    verdict: str,
    why: str,
) -> None:
    j = judge_canary(base, can, SLO_ITL, MIN_REQUESTS, caps[0], caps[1], 5.0, final)
    assert j.verdict == verdict, j.reason
    assert why in j.reason
    assert "req/s" in j.reason  # both loads are shown


def test_a_threshold_inside_a_wide_bucket_is_judged_on_honest_bounds() -> None:
    """15% +- 14% over the threshold: the canary's best case (1%) is no worse than the
    baseline's worst (3%), so it is not rejected on a histogram that cannot tell."""
    base, can = window(2000, 0.02, spread=0.01), window(1000, 0.15, spread=0.14)
    b, c = sides(base, can)
    assert (c.low, c.high) == pytest.approx((0.01, 0.29))
    assert worse_p_value(c, b) == 1.0
    assert judge(base, can, final=False) == "Pending"


def test_miss_share_is_the_certain_share_over_the_worst_target() -> None:
    assert miss_share(window(1000, 0.12), SLO_ITL) == pytest.approx(0.12)
    assert miss_share(window(1000, 0.12, spread=0.05), SLO_ITL) == pytest.approx(0.07)
    assert miss_share(window(1000, 0.0), SLO_ITL) == 0.0
    # Without buckets, a percentile over its threshold still says p5 at least misses.
    no_buckets = Snapshot(NOW, 300.0, completed_requests=100, itl=LatencySummary(p95_ms=80.0))
    assert miss_share(no_buckets, SLO_ITL) == pytest.approx(0.05)


# --------------------------------------------------------------------------------- properties

shares = st.floats(0.0, 0.6)
spreads = st.sampled_from([0.0, 0.0, 0.01, 0.05])
counts = st.integers(0, 6000)


@given(
    n_a=counts, n_b=counts, lo_a=shares, w_a=shares, lo_b=shares, w_b=shares
)  # fmt: skip
def test_p_values_are_probabilities(
    n_a: int, n_b: int, lo_a: float, w_a: float, lo_b: float, w_b: float
) -> None:
    a = Misses("itl", lo_a, min(1.0, lo_a + w_a), n_a)
    b = Misses("itl", lo_b, min(1.0, lo_b + w_b), n_b)
    p = worse_p_value(a, b)
    assert 0.0 <= p <= 1.0
    assert worse_p_value(a, a) == 1.0  # a window is never worse than itself
    if a.low <= b.high or a.n == 0 or b.n == 0:
        assert p == 1.0
    # Both ways cannot be significant at once.
    assert p >= SIGNIFICANCE or worse_p_value(b, a) == 1.0
    assert not (a.misses_slo(TARGET) and a.meets_slo(TARGET))


@given(
    n_b=counts,
    n_c=counts,
    miss_b=shares,
    miss_c=shares,
    spread_b=spreads,
    spread_c=spreads,
    final=st.booleans(),
    cap_b=st.one_of(st.none(), st.floats(0.1, 100.0)),
    cap_c=st.one_of(st.none(), st.floats(0.1, 100.0)),
    min_gain=st.sampled_from([0.0, 5.0, 20.0]),
)
def test_verdict_invariants(
    n_b: int,
    n_c: int,
    miss_b: float,
    miss_c: float,
    spread_b: float,
    spread_c: float,
    final: bool,
    cap_b: float | None,
    cap_c: float | None,
    min_gain: float,
) -> None:
    base, can = window(n_b, miss_b, spread_b), window(n_c, miss_c, spread_c)
    verdict = judge(base, can, final, (cap_b, cap_c), min_gain)
    assert verdict in RANK
    enough = min(n_b, n_c) >= MIN_REQUESTS
    if not enough:
        assert verdict == ("Reject" if final else "Pending")
        return
    b, c = sides(base, can)
    p_worse, p_better = worse_p_value(c, b), worse_p_value(b, c)
    worse = p_worse < SIGNIFICANCE and not c.meets_slo(TARGET)
    fixed = b.misses_slo(TARGET) and p_better < (SIGNIFICANCE if final else EARLY_SIGNIFICANCE)
    gain = cap_b is not None and cap_c is not None and (cap_c / cap_b - 1.0) * 100.0 >= min_gain
    # A significantly worse canary that misses the SLO is rejected, early or late.
    if worse:
        assert verdict == "Reject"
    if verdict == "Promote":
        # Never without significant evidence, or a capacity gain at the end of the window.
        assert not worse
        assert fixed or (final and gain)
    if not final:
        # Before the window ends, only significant evidence decides.
        assert verdict == ("Reject" if worse else "Promote" if fixed else "Pending")
    else:
        assert verdict != "Pending"
        assert verdict == ("Reject" if worse else "Promote" if fixed or gain else "Reject")


@given(
    n=st.integers(MIN_REQUESTS, 6000),
    miss=shares,
    spread=spreads,
    final=st.booleans(),
    cap=st.floats(0.1, 100.0),
)
def test_identical_windows_show_no_difference(
    n: int, miss: float, spread: float, final: bool, cap: float
) -> None:
    w = window(n, miss, spread)
    verdict = judge(w, w, final, (cap, cap), min_gain=5.0)
    # Not significantly different either way: no early verdict, no promotion without a gain.
    assert verdict == ("Reject" if final else "Pending")
    assert judge(w, w, final=True, caps=(cap, cap), min_gain=0.0) == "Promote"


@given(
    n_b=st.integers(MIN_REQUESTS, 6000),
    n_c=st.integers(MIN_REQUESTS, 6000),
    miss_b=shares,
    miss_c=shares,
    final=st.booleans(),
)
def test_swapping_a_losing_canary_with_its_baseline_makes_a_winner(
    n_b: int, n_c: int, miss_b: float, miss_c: float, final: bool
) -> None:
    base, can = window(n_b, miss_b), window(n_c, miss_c)
    b, c = sides(base, can)
    p = worse_p_value(c, b)
    # A canary clearly worse (at the early threshold) that misses the SLO ...
    assume(p < EARLY_SIGNIFICANCE and c.misses_slo(TARGET))
    assert judge(base, can, final) == "Reject"
    # ... is, in the baseline's place, a violation the other side significantly fixes.
    assert judge(can, base, final) == "Promote"


@given(
    n_b=st.integers(MIN_REQUESTS, 6000),
    n_c=st.integers(MIN_REQUESTS, 6000),
    miss_b=shares,
    miss_c=shares,
    less=st.floats(0.0, 1.0),
    final=st.booleans(),
    caps=st.tuples(st.floats(0.1, 100.0), st.floats(0.1, 100.0)),
)
def test_a_canary_that_misses_less_never_gets_a_worse_verdict(
    n_b: int,
    n_c: int,
    miss_b: float,
    miss_c: float,
    less: float,
    final: bool,
    caps: tuple[float, float],
) -> None:
    base = window(n_b, miss_b)
    worse_canary = judge(base, window(n_c, miss_c), final, caps)
    better_canary = judge(base, window(n_c, miss_c * less), final, caps)
    assert RANK[better_canary] >= RANK[worse_canary]


def _at(w: Snapshot, p95_ms: float) -> Snapshot:
    """The same window with its ITL p95 (as Prometheus shows it) at `p95_ms`."""
    return replace(w, itl=LatencySummary(p95_ms=p95_ms, buckets=w.itl.buckets))


@pytest.mark.parametrize(
    ("p95_base", "p95_can", "verdict"),
    [
        (67.3, 72.7, "Reject"),  # make demo: both over 50, the canary more: no credit wins
        (72.7, 67.3, "Promote"),  # both over, the canary less: the model's credit stands
        (40.0, 45.0, "Promote"),  # both within the SLO: a latency rise is no miss
    ],
)
def test_a_canary_measured_further_over_a_target_is_not_promoted_on_credit(
    p95_base: float, p95_can: float, verdict: str
) -> None:
    """Both windows miss 8 % of gaps over the 50 ms bound (the buckets confirm a p95 miss
    wherever a percentile over the threshold is shown)."""
    base, can = _at(window(2000, 0.08), p95_base), _at(window(1000, 0.08), p95_can)
    j = judge_canary(base, can, SLO_ITL, MIN_REQUESTS, 2.01, 2.15, 5.0, True)
    assert j.verdict == verdict, j.reason
    if verdict == "Reject":
        assert "the canary measured 72.7 ms against the baseline's 67.3 ms" in j.reason


@given(
    p95_b=st.floats(10.0, 200.0),
    p95_c=st.floats(10.0, 200.0),
    caps=st.tuples(st.floats(0.1, 100.0), st.floats(0.1, 100.0)),
)
def test_no_promotion_on_credit_for_a_canary_measured_further_over_the_threshold(
    p95_b: float, p95_c: float, caps: tuple[float, float]
) -> None:
    base, can = _at(window(2000, 0.08), p95_b), _at(window(1000, 0.08), p95_c)
    verdict = judge(base, can, True, caps)
    if p95_c > THRESHOLD and p95_c > p95_b:
        assert verdict == "Reject"


@given(p95_c=st.floats(THRESHOLD + 0.1, 99.0), miss=st.floats(0.0, 0.04))
def test_a_percentile_interpolated_over_the_threshold_is_no_measured_miss(
    p95_c: float, miss: float
) -> None:
    """The threshold inside the 25-100 ms bucket: the canary's p95 reads over it, higher than
    the baseline's, but its buckets leave its share over the threshold at 5 % or less, so
    they do not confirm a miss, and the model's +7.5 % credit stands."""
    base = _at(window(2000, 0.02, spread=0.01), 40.0)
    can = _at(window(1000, miss, spread=min(miss, 0.01)), p95_c)
    c = misses(can, "itl", TARGET)
    assert c is not None and not c.misses_slo(TARGET)
    j = judge_canary(base, can, SLO_ITL, MIN_REQUESTS, 2.0, 2.15, 5.0, True)
    assert j.verdict == "Promote", j.reason
    assert "the canary measured" not in j.reason


# ------------------------------------------------------------- the canary window's own noise


@given(
    percentile=st.floats(50.0, 99.5),
    requests=st.integers(1, 10**6),
    more=st.integers(1, 10**6),
)
def test_a_cautious_slo_is_stricter_and_tightens_with_more_requests(
    percentile: float, requests: int, more: int
) -> None:
    slo = SLO(ttft=SLOTarget(percentile, 500.0), itl=TARGET)
    few, many = cautious_slo(slo, requests), cautious_slo(slo, requests + more)
    for original, a, b in ((slo.ttft, few.ttft, many.ttft), (slo.itl, few.itl, many.itl)):
        assert original is not None and a is not None and b is not None
        assert a.threshold_ms == b.threshold_ms == original.threshold_ms
        assert original.percentile <= b.percentile <= a.percentile <= max(99.9, original.percentile)
    assert few.e2e is None and many.e2e is None


def test_a_cautious_slo_at_the_numbers_it_documents() -> None:
    slo = SLO(itl=TARGET)
    for n, expected in ((66, 99.41), (400, 96.79), (8000, 95.40)):
        moved = cautious_slo(slo, n).itl
        assert moved is not None and moved.percentile == pytest.approx(expected, abs=0.01)
    far = cautious_slo(slo, 10**9).itl
    assert far is not None and far.percentile == pytest.approx(95.0, abs=0.01)


@pytest.mark.parametrize(
    ("cautious", "verdict", "why"),
    [
        (9.0, "Reject", "within the canary window's noise"),  # 66 requests: p99.4 undoes it
        (10.2, "Promote", "+8.0%"),  # the gain holds at the stricter SLO
        (None, "Promote", "+8.0%"),  # no cautious capacity (the one-replica path)
    ],
)
def test_a_gain_the_canary_windows_own_noise_can_undo_is_not_credited(
    cautious: float | None, verdict: str, why: str
) -> None:
    base, can = window(2000, 0.02), window(66, 0.02)
    j = judge_canary(base, can, SLO_ITL, MIN_REQUESTS, 10.0, 10.8, 5.0, True, cautious)
    assert j.verdict == verdict, j.reason
    assert why in j.reason
