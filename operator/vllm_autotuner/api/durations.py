"""Go-style duration strings ("90s", "15m", "1h30m"), as Kubernetes users write them.

The one parser of the project: the CRDs, the chart's values and the command line
(`vllm-autotuner run --reconcile-interval 1m30s`) all go through `duration_seconds`. The shape
is a pattern the CRD (and the chart's values schema, with a subset of the units) checks too: a
sequence of decimal numbers, each with a unit of ns, us, ms, s, m or h (Go's
``time.ParseDuration`` without signs and without the micro sign, which keeps the pattern ASCII).
The value comes from `durationpy` (a dependency of the `kubernetes` package), which implements
Go's grammar; its resolution is a microsecond.
"""

from __future__ import annotations

import re
from typing import Annotated

import durationpy
from pydantic import AfterValidator, Field

DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"
DURATION_MAX_LENGTH = 64

_WHOLE = re.compile(DURATION_PATTERN)


def duration_seconds(text: str) -> float:
    """Seconds in a Go-style duration; raises ValueError on anything the CRD would reject."""
    if not _WHOLE.fullmatch(text):
        raise ValueError(f"invalid duration {text!r}: use Go syntax such as 90s, 15m or 1h30m")
    try:
        return float(durationpy.from_str(text).total_seconds())
    except durationpy.DurationError as exc:
        raise ValueError(f"invalid duration {text!r}: {exc}") from exc


# Nothing the operator waits for is longer than a year; beyond it, datetime arithmetic on the
# value overflows (a "100000000h" window would fail every reconcile instead of being refused).
DURATION_MAX_SECONDS = 366 * 24 * 3600.0


def _check_duration(text: str) -> str:
    if duration_seconds(text) > DURATION_MAX_SECONDS:
        raise ValueError(f"duration {text!r} is longer than a year (366d = 8784h)")
    return text


Duration = Annotated[
    str,
    Field(max_length=DURATION_MAX_LENGTH, pattern=DURATION_PATTERN),
    AfterValidator(_check_duration),
]
"""A duration kept as the user wrote it, so status and spec round-trip byte for byte."""
