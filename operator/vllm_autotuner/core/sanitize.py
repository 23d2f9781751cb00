"""What the operator writes where people and tools read it: status, conditions and Events.

Text there can come from outside: Prometheus error messages and label values, API server
messages, a tenant's own spec. Unbounded, a 1 MB reason made the API server refuse the whole
status write (every free-text field has a maxLength in the CRD), so the status went stale;
control characters (terminal escapes, bidirectional overrides, NUL) made `kubectl describe`
lie; and a gauge of 1e308, or an infinity JSON cannot even carry, reached the printer columns.
Everything written goes through here first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

MAX_STATUS_TEXT = 4096
"""The smallest maxLength of the CRD's free-text status fields (reasons, messages)."""
MAX_EVENT_TEXT = 1024
"""Event notes longer than this are cut by kopf and refused by events.k8s.io/v1."""
MAX_STATUS_NUMBER = 1e15
"""Beyond any count, rate or latency the operator measures; also safe as a JSON double."""
ELLIPSIS = "\u2026"

# C0 and C1 controls except the separators we turn into spaces, DEL, Unicode line and
# paragraph separators, and the bidirectional embedding, override and isolate characters.
_INVISIBLE = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_SPACES = re.compile("[\t\n\x0b\x0c\r\u2028\u2029]+")


def clean_text(text: str, limit: int = MAX_STATUS_TEXT) -> str:
    """`text` on one line, without control or direction characters, at most `limit` long."""
    text = _INVISIBLE.sub("", _SPACES.sub(" ", text))
    if len(text) > limit:
        text = text[: limit - 1] + ELLIPSIS
    return text


def clean_number(value: float) -> float | None:
    """None for NaN and infinities (JSON cannot carry them); others clamped to a sane range."""
    if not math.isfinite(value):
        return None
    return max(-MAX_STATUS_NUMBER, min(MAX_STATUS_NUMBER, value))


def clean_status(value: Any) -> Any:
    """A copy of a status (or any part of it) that the API server accepts and people can read.

    Strings are cleaned and cut; floats that are not finite are dropped with their key, the
    others clamped; everything else is kept as it is.
    """
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, int):  # bool included
        return value
    if isinstance(value, float):
        return clean_number(value)
    if isinstance(value, Mapping):
        cleaned = {str(k): clean_status(v) for k, v in value.items()}
        return {k: v for k, v in cleaned.items() if v is not None or value.get(k) is None}
    if isinstance(value, list | tuple):
        return [clean_status(v) for v in value]
    return value
