"""Go-style duration strings ("90s", "15m", "1h30m"), as Kubernetes users write them.

The CRD checks the shape with a pattern (and CEL's ``duration()`` where a rule needs the value);
the operator needs seconds. Both sides accept the same language: a sequence of decimal numbers,
each with a unit of ns, us, ms, s, m or h (Go's ``time.ParseDuration`` without signs and without
the micro sign, which keeps the CRD pattern ASCII).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"
DURATION_MAX_LENGTH = 64

_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|ms|s|m|h)")
_WHOLE = re.compile(DURATION_PATTERN)
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_seconds(text: str) -> float:
    """Seconds in a Go-style duration; raises ValueError on anything the CRD would reject."""
    if not _WHOLE.fullmatch(text):
        raise ValueError(f"invalid duration {text!r}: use Go syntax such as 90s, 15m or 1h30m")
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in _PART.findall(text))


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
