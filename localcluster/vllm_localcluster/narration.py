"""What the demo prints while it watches a VLLMDeployment's status: every decision with its
reason as it happens, and latencies only next to the knobs they were measured on.

The status is polled every few seconds, so `status.tuning.lastDecision` alone can move from a
rollout to its verification between two polls and the rollout would never be printed. The
trials in `status.tuning.trials` are the durable record: a new trial is a rollout (its reason
is the tuner's, from lastDecision or the trial's `RolloutStarted` Event), a changed outcome a
commit or a rollback. Other decisions (hold, recommend, verify) come from `lastDecision`, once
per change of what the tuner is doing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

TRIAL_ACTIONS = ("rollout", "commit", "rollback")
OUTCOME_ACTION = {
    "Committed": "commit",
    "RolledBack": "rollback",
    "Crashed": "rollback",
    "NotReady": "rollback",
    "OOMKilled": "rollback",
}


def knob_label(knobs: Mapping[str, Any] | None) -> str | None:
    """`mnbt=..,mns=..,gmu=..` of a status knobs object, None without one."""
    if not knobs:
        return None
    return (
        f"mnbt={knobs.get('maxNumBatchedTokens')},mns={knobs.get('maxNumSeqs')},"
        f"gmu={knobs.get('gpuMemoryUtilization')}"
    )


@dataclass
class Narrator:
    """Turns successive status objects into the decisions not yet printed, in order."""

    trials: dict[Any, str | None] = field(default_factory=dict)  # id -> outcome printed
    last: tuple[str, str] | None = None  # (action, phase) of the last other decision printed
    waited: dict[Any, int] = field(default_factory=dict)  # polls a rollout waited for its Event
    patience: int = 3  # polls to wait for a rollout's Event before printing it without

    def news(
        self, status: Mapping[str, Any], events: Sequence[Mapping[str, Any]] = ()
    ) -> list[tuple[str, str]]:
        tuning = dict(status.get("tuning") or {})
        decision = dict(tuning.get("lastDecision") or {})
        out = self._trial_news(tuning, decision, events)
        action, reason = str(decision.get("action")), decision.get("reason")
        key = (action, str(tuning.get("phase")))
        if reason and action not in TRIAL_ACTIONS and key != self.last:
            self.last = key
            out.append((action, str(reason)))
        return out

    def _trial_news(
        self,
        tuning: Mapping[str, Any],
        decision: Mapping[str, Any],
        events: Sequence[Mapping[str, Any]],
    ) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for trial in tuning.get("trials") or []:
            trial_id, outcome = trial.get("id"), trial.get("outcome")
            label = knob_label(trial.get("knobs"))
            if trial_id not in self.trials:
                why = rollout_reason(trial_id, decision, events)
                waited = self.waited.get(trial_id, 0)
                if why is None and waited < self.patience and outcome == "Pending":
                    self.waited[trial_id] = waited + 1  # kopf posts Events a moment later
                    continue
                self.trials[trial_id] = "Pending"
                out.append(("rollout", why or f"trial {trial_id}: {label}"))
            if outcome != self.trials[trial_id] and outcome in OUTCOME_ACTION:
                self.trials[trial_id] = outcome
                reason = trial.get("reason") or outcome
                out.append((OUTCOME_ACTION[outcome], f"trial {trial_id} ({label}): {reason}"))
        return out


def rollout_reason(
    trial_id: Any, decision: Mapping[str, Any], events: Sequence[Mapping[str, Any]]
) -> str | None:
    """Why trial `trial_id` was rolled out: the tuner's own words, if they are still to be seen."""
    if decision.get("action") == "rollout" and f"(trial {trial_id}," in str(decision.get("reason")):
        return str(decision["reason"])
    for event in reversed(in_time_order(list(events))):
        message = str(event.get("message") or "")
        if event.get("reason") == "RolloutStarted" and f"(trial {trial_id}," in message:
            return message
    return None


def console_line(
    status: Mapping[str, Any], slo: Mapping[str, Any], failed: int | None = None
) -> str:
    """One line of the tuner's state; the latencies name the knobs they were measured on, and
    knobs just rolled out are said to be not measured yet."""
    tuning = dict(status.get("tuning") or {})
    observed = dict(status.get("observed") or {})
    applied = knob_label(tuning.get("applied")) or "-"
    measured = knob_label(observed.get("knobs"))

    def ms(value: Any) -> str:
        return "n/a" if value is None else f"{float(value):.1f}"

    line = f"phase={tuning.get('phase') or '-'} applied {applied}"
    if measured is None or not observed:
        line += "; no measurement yet"
    else:
        kv = observed.get("kvCacheUsage")
        line += (
            f"; measured on {measured}: TTFT p95 {ms(observed.get('ttftP95Ms'))} ms "
            f"(<= {slo['ttft']['thresholdMs']}), ITL p95 {ms(observed.get('itlP95Ms'))} ms "
            f"(<= {slo['itl']['thresholdMs']}), KV {'n/a' if kv is None else f'{100 * kv:.0f}%'}"
        )
        if measured != applied:
            line += "; the applied knobs are not measured yet"
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    line += f"; SLO met: {conditions.get('SLOMet') or 'Unknown'}"
    if failed is not None:
        line += f"; failed requests so far: {failed}"
    return line


def event_time(event: Mapping[str, Any]) -> datetime:
    """When an Event last happened (the oldest possible time when it says nothing)."""
    series = event.get("series") or {}
    text = (
        series.get("lastObservedTime")
        or event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or (event.get("metadata") or {}).get("creationTimestamp")
    )
    try:
        when = datetime.fromisoformat(str(text))
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def in_time_order(events: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(events, key=event_time)
