"""What the demo prints while it watches a VLLMDeployment's status: every decision with its
reason as it happens, and latencies only next to the knobs they were measured on.

The status is polled every few seconds, so `status.tuning.lastDecision` alone can move from a
rollout to its verification between two polls and the rollout would never be printed. The
trials in `status.tuning.trials` are the durable record: a new trial is a rollout or a canary
(its reason is the tuner's, from lastDecision or the trial's `RolloutStarted`/`CanaryStarted`
Event), a changed outcome a commit, a rollback or a rejected canary. A canary's promotion is
read from its `CanaryPromoted` Event, which outlives the one reconcile that decided it. Other
decisions (hold, recommend, verify) come from `lastDecision`, once per change of what the tuner
is doing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

TRIAL_ACTIONS = ("rollout", "commit", "rollback", "promote")
STARTED_REASONS = ("RolloutStarted", "CanaryStarted")
# Events that are decisions in their own right, printed once each.
EVENT_ACTIONS = {"CanaryPromoted": "promote", "WaitingForHeadroom": "wait"}
CANARY_PHASES = ("RollingOut", "Verifying")
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
    events_seen: set[str] = field(default_factory=set)  # Events already printed

    def news(
        self, status: Mapping[str, Any], events: Sequence[Mapping[str, Any]] = ()
    ) -> list[tuple[str, str]]:
        tuning = dict(status.get("tuning") or {})
        decision = dict(tuning.get("lastDecision") or {})
        out = self._trial_starts(tuning, decision, events)
        out += self._event_news(events)
        out += self._trial_outcomes(tuning)
        action, reason = str(decision.get("action")), decision.get("reason")
        key = (action, str(tuning.get("phase")))
        if reason and action not in TRIAL_ACTIONS and key != self.last:
            self.last = key
            out.append((action, str(reason)))
        return out

    def _trial_starts(
        self,
        tuning: Mapping[str, Any],
        decision: Mapping[str, Any],
        events: Sequence[Mapping[str, Any]],
    ) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for trial in tuning.get("trials") or []:
            trial_id, outcome = trial.get("id"), trial.get("outcome")
            if trial_id in self.trials:
                continue
            why = rollout_reason(trial_id, decision, events)
            waited = self.waited.get(trial_id, 0)
            if why is None and waited < self.patience and outcome == "Pending":
                self.waited[trial_id] = waited + 1  # kopf posts Events a moment later
                continue
            self.trials[trial_id] = "Pending"
            text = why or f"trial {trial_id}: {knob_label(trial.get('knobs'))}"
            out.append(("canary" if text.startswith("canary ") else "rollout", text))
        return out

    def _trial_outcomes(self, tuning: Mapping[str, Any]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for trial in tuning.get("trials") or []:
            trial_id, outcome = trial.get("id"), trial.get("outcome")
            if trial_id not in self.trials or outcome == self.trials[trial_id]:
                continue
            if outcome not in OUTCOME_ACTION:
                continue
            self.trials[trial_id] = outcome
            reason = str(trial.get("reason") or outcome)
            action = "reject" if reason.startswith("canary lost") else OUTCOME_ACTION[outcome]
            label = knob_label(trial.get("knobs"))
            out.append((action, f"trial {trial_id} ({label}): {reason}"))
        return out

    def _event_news(self, events: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for event in in_time_order(list(events)):
            action = EVENT_ACTIONS.get(str(event.get("reason")))
            key = str((event.get("metadata") or {}).get("name") or event.get("message"))
            if action is None or key in self.events_seen:
                continue
            self.events_seen.add(key)
            out.append((action, str(event.get("message") or "")))
        return out


def rollout_reason(
    trial_id: Any, decision: Mapping[str, Any], events: Sequence[Mapping[str, Any]]
) -> str | None:
    """Why trial `trial_id` was rolled out: the tuner's own words, if they are still to be seen."""
    if decision.get("action") == "rollout" and f"(trial {trial_id}," in str(decision.get("reason")):
        return str(decision["reason"])
    for event in reversed(in_time_order(list(events))):
        message = str(event.get("message") or "")
        if event.get("reason") in STARTED_REASONS and f"(trial {trial_id}," in message:
            return message
    return None


def latency(observed: Mapping[str, Any], metric: str, slo: Mapping[str, Any]) -> Any:
    """The observed latency at the SLO's own percentile (the p95 when it has no other)."""
    pct = float((slo.get(metric) or {}).get("percentile", 95))
    if pct != 95 and observed.get(f"{metric}PercentileMs") is not None:
        return observed[f"{metric}PercentileMs"]
    return observed.get(f"{metric}P95Ms")


def percentile_label(metric: str, slo: Mapping[str, Any]) -> str:
    """`ITL p99`: a metric at the SLO's percentile."""
    return f"{metric.upper()} p{float((slo.get(metric) or {}).get('percentile', 95)):g}"


def canary_running(tuning: Mapping[str, Any]) -> bool:
    return tuning.get("strategy") == "Canary" and tuning.get("phase") in CANARY_PHASES


def console_line(
    status: Mapping[str, Any], slo: Mapping[str, Any], failed: int | None = None
) -> str:
    """One line of the tuner's state; the latencies name the knobs they were measured on, and
    knobs just rolled out are said to be not measured yet. While a canary runs, the latencies
    are the baseline pods', and the canary's paired comparison follows."""
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
            f"; measured on {measured}: {percentile_label('ttft', slo)} "
            f"{ms(latency(observed, 'ttft', slo))} ms (<= {slo['ttft']['thresholdMs']}), "
            f"{percentile_label('itl', slo)} {ms(latency(observed, 'itl', slo))} ms "
            f"(<= {slo['itl']['thresholdMs']}), KV {'n/a' if kv is None else f'{100 * kv:.0f}%'}"
        )
        if measured != applied:
            line += "; the applied knobs are not measured yet"
    if canary_running(tuning):
        line += f"; {canary_line(tuning, slo)}"
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    line += f"; SLO met: {conditions.get('SLOMet') or 'Unknown'}"
    if failed is not None:
        line += f"; failed requests so far: {failed}"
    return line


def canary_line(tuning: Mapping[str, Any], slo: Mapping[str, Any]) -> str:
    """The running canary and, once its paired window has numbers, the comparison."""
    text = f"canary {knob_label(tuning.get('candidate'))} on one pod"
    analysis = dict(tuning.get("analysis") or {})
    canary, baseline = analysis.get("canary") or {}, analysis.get("baseline") or {}
    if canary.get("itlMs") is None or baseline.get("itlMs") is None:
        return text + ": not compared yet"
    return (
        f"{text}: {percentile_label('itl', slo)} {float(canary['itlMs']):.1f} ms vs the "
        f"baseline pods' {float(baseline['itlMs']):.1f} ms over the same "
        f"{float(analysis.get('windowSeconds') or 0):.0f} s ({analysis.get('verdict', 'Pending')})"
    )


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
