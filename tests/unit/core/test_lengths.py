"""Token-length spreads read from vLLM's request_*_tokens histograms (1-2-5 buckets).

The buckets a window's lengths do not reach are evidence too: without them, one split of two
buckets and the mean fit two log-normals, and the wide one put the held-out RAG window's
prompt p90 at 9,700 tokens where every prompt had 6,000 or fewer.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from hypothesis import given
from hypothesis import strategies as st

from vllm_autotuner.core.snapshot import LengthSummary, length_spread

# vLLM's length buckets up to a 10,000-token context, then +Inf.
BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def _lognormal_buckets(mean: float, sigma: float, n: float) -> tuple[tuple[float, float], ...]:
    mu = math.log(mean) - 0.5 * sigma * sigma
    cdf = NormalDist(mu, sigma).cdf
    return (*tuple((float(b), n * cdf(math.log(b))) for b in BOUNDS), (math.inf, n))


def test_a_held_out_rag_window_reads_the_narrow_spread() -> None:
    """108 prompts spread evenly over 3,000-6,000 tokens (mean 4,436): 79 under 5,000, none
    under 2,000, all under 10,000. Their p90 is about 5,700 tokens."""
    buckets = (
        *tuple((float(b), 0.0) for b in BOUNDS[:-2]),
        (5000.0, 79.0),
        (10000.0, 108.0),
        (math.inf, 108.0),
    )
    p90 = LengthSummary(mean=4436.0, buckets=buckets).lognormal_p90()
    assert p90 is not None and 5000.0 < p90 < 6500.0, p90


@given(
    mean=st.floats(50.0, 6000.0),
    sigma=st.floats(0.1, 1.2),
)
def test_a_log_normal_s_own_buckets_give_back_its_p90(mean: float, sigma: float) -> None:
    """Fractions at every bound exactly as the log-normal has them: its p90 comes back within
    3 %, however few of the bounds fall inside the spread."""
    buckets = _lognormal_buckets(mean, sigma, 1000.0)
    got = LengthSummary(mean=mean, buckets=buckets).lognormal_p90()
    want = math.exp(math.log(mean) - 0.5 * sigma * sigma + 1.2816 * sigma)
    assert got is not None
    assert abs(got / want - 1.0) <= 0.03, (got, want)


def test_a_fit_the_empty_buckets_agree_with_keeps_its_informative_points() -> None:
    """A log-normal's own buckets: the fit to the bounds with 1-99 % under them expects next
    to nothing where the window saw nothing, so those bounds are all it is given."""
    buckets = _lognormal_buckets(600.0, 0.8, 4000.0)
    spread = length_spread(buckets, math.log(600.0), 0.99)
    assert spread is not None
    points, _ = spread
    total = buckets[-1][1]
    assert points == [(math.log(b), c / total) for b, c in buckets[:-1] if 0.01 < c / total < 0.99]


def test_a_fit_that_fills_the_empty_buckets_is_given_every_bound() -> None:
    buckets = (
        *((float(b), 0.0) for b in BOUNDS[:-2]),
        (5000.0, 79.0),
        (10000.0, 108.0),
        (math.inf, 108.0),
    )
    spread = length_spread(buckets, math.log(4436.0), 0.99)
    assert spread is not None
    points, sigma = spread
    assert points == [(math.log(b), c / 108.0) for b, c in buckets[:-1]]
    assert 0.1 < sigma < 0.3, sigma  # the narrow spread: uniform 3,000-6,000 has 0.2
    assert length_spread((), 0.0, 0.99) is None
    assert length_spread(((100.0, 0.0), (math.inf, 0.0)), 0.0, 0.99) is None
    assert length_spread(((math.inf, 5.0),), 0.0, 0.99) is None
