"""Go-style durations: the pydantic parser and the CRD pattern accept the same language."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_autotuner.api.durations import DURATION_PATTERN, duration_seconds

UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6, "ns": 1e-9}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("15m", 900), ("1h30m", 5400), ("1.5h", 5400), ("250ms", 0.25), ("0s", 0)],
)
def test_known_durations(text: str, seconds: float) -> None:
    assert duration_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "15", "m", "15 m", "-5m", "1d", "1h 30m", "15min", "1.m"])
def test_rejected_durations(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        duration_seconds(text)
    assert re.search(DURATION_PATTERN, text) is None


@given(st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(sorted(UNITS))), min_size=1))
def test_composed_durations_add_up(parts: list[tuple[int, str]]) -> None:
    text = "".join(f"{n}{unit}" for n, unit in parts)
    assert re.search(DURATION_PATTERN, text)
    # durationpy keeps microseconds: a ns part rounds to 1e-6 at most each.
    expected = sum(n * UNITS[u] for n, u in parts)
    assert duration_seconds(text) == pytest.approx(expected, abs=1e-6 * len(parts))
