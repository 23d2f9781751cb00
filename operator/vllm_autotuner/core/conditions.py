"""metav1.Condition bookkeeping with the API conventions' semantics.

`lastTransitionTime` moves only when a condition's status changes, so rewriting the same
condition does not produce a status write (every write wakes Argo CD and every watcher).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

ConditionStatus = Literal["True", "False", "Unknown"]

# The order in which conditions are listed in status: the summary first.
CONDITION_ORDER = ("Ready", "PolicyResolved", "Tuning", "SLOMet", "MetricsAvailable", "Degraded")


@dataclass(frozen=True)
class ConditionUpdate:
    """What a reconcile wants a condition to say; the transition time is derived, not chosen."""

    type: str
    status: ConditionStatus
    reason: str
    message: str = ""


def format_time(now: datetime) -> str:
    """RFC 3339 in UTC with second precision, as the API server writes metav1.Time."""
    utc = now.replace(tzinfo=UTC) if now.tzinfo is None else now.astimezone(UTC)
    return utc.strftime("%Y-%m-%dT%H:%M:%SZ")


def set_conditions(
    current: Sequence[Mapping[str, Any]] | None,
    updates: Iterable[ConditionUpdate],
    *,
    generation: int | None,
    now: datetime,
) -> list[dict[str, Any]]:
    """Merge `updates` into `current` and return the new list (current is not modified).

    A condition whose status is unchanged keeps its lastTransitionTime; reason, message and
    observedGeneration are refreshed. Conditions not mentioned in `updates` are kept as they are.
    """
    by_type: dict[str, dict[str, Any]] = {str(c["type"]): dict(c) for c in current or ()}
    for update in updates:
        old = by_type.get(update.type)
        transition = (
            old["lastTransitionTime"]
            if old is not None
            and old.get("status") == update.status
            and old.get("lastTransitionTime")
            else format_time(now)
        )
        new: dict[str, Any] = {
            "type": update.type,
            "status": update.status,
            "reason": update.reason,
            "message": update.message[:32768],
            "lastTransitionTime": transition,
        }
        if generation is not None:
            new["observedGeneration"] = generation
        by_type[update.type] = new

    def order(cond_type: str) -> tuple[int, str]:
        rank = CONDITION_ORDER.index(cond_type) if cond_type in CONDITION_ORDER else 99
        return (rank, cond_type)

    return [by_type[t] for t in sorted(by_type, key=order)]


def find(
    conditions: Sequence[Mapping[str, Any]] | None, cond_type: str
) -> Mapping[str, Any] | None:
    for cond in conditions or ():
        if cond.get("type") == cond_type:
            return cond
    return None


def is_true(conditions: Sequence[Mapping[str, Any]] | None, cond_type: str) -> bool:
    cond = find(conditions, cond_type)
    return cond is not None and cond.get("status") == "True"
