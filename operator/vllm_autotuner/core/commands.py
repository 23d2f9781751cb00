"""Requests a person makes without editing the spec: annotations on the VLLMDeployment.

- ``vllm.autotuner.io/pause: "true"`` pauses tuning while it is there: nothing new is rolled
  out. A trial already running is still verified, committed or rolled back, because that is
  what keeps the service safe. Removing the annotation resumes.
- ``vllm.autotuner.io/promote``, ``abort`` and ``retry`` are one-shot requests whose value is a
  timestamp (any new value is a new request). The operator records the value it acted on in
  ``status.handledRequests``, so a request is acted on once, and stays acted on across
  operator restarts. ``retry`` forgets the most recent blocked configuration (a candidate
  remembered as infeasible after a crash, OOM kill, readiness timeout or regression), so the
  tuner may try it again; promote and abort are for a running canary.

Annotations are not spec: they never change the generation, and a GitOps tool that does not
own them leaves them alone (docs/gitops.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime

from vllm_autotuner import GROUP
from vllm_autotuner.core.decide import Decision
from vllm_autotuner.core.tuning_types import Commands, DecisionRecord, TuningState

PAUSE_ANNOTATION = f"{GROUP}/pause"
REQUEST_ANNOTATIONS = {
    "promote": f"{GROUP}/promote",
    "abort": f"{GROUP}/abort",
    "retry": f"{GROUP}/retry",
}
_TRUE = ("true", "yes", "1")


def read_commands(
    annotations: Mapping[str, str] | None, handled: Mapping[str, str | None] | None
) -> tuple[Commands, dict[str, str]]:
    """The commands in force, and the one-shot requests not yet handled (name -> value)."""
    notes = annotations or {}
    done = handled or {}
    pending = {
        name: str(notes[key])
        for name, key in REQUEST_ANNOTATIONS.items()
        if notes.get(key) and done.get(name) != str(notes[key])
    }
    paused = str(notes.get(PAUSE_ANNOTATION, "")).strip().lower() in _TRUE
    commands = Commands(
        paused=paused,
        promote_requested="promote" in pending,
        abort_requested="abort" in pending,
        retry_requested="retry" in pending,
    )
    return commands, pending


def hold_while_paused(decision: Decision, state: TuningState, now: datetime) -> Decision:
    """A rollout becomes a hold that says so; every other decision stands (a trial running
    when the pause came is still verified, committed or rolled back)."""
    if decision.action != "rollout":
        return decision
    target = decision.knobs_to_apply or decision.new_state.applied
    reason = (
        f"paused by the annotation {PAUSE_ANNOTATION}; would roll out {target.describe()}: "
        f"{decision.reason}"
    )
    held = replace(state, last_decision=DecisionRecord(now, "hold", reason))
    return Decision("hold", reason, held, None, (), decision.diagnosis, decision.prediction)


def forget_latest_block(state: TuningState) -> tuple[TuningState, str]:
    """`state` without its most recent infeasible configuration, and what was forgotten."""
    if not state.infeasible:
        return state, "nothing to retry: no configuration is blocked"
    latest = max(state.infeasible, key=lambda entry: entry.time)
    kept = tuple(entry for entry in state.infeasible if entry is not latest)
    what = f"{latest.knobs.describe()} ({latest.kind}: {latest.reason})"
    return replace(state, infeasible=kept), f"may try again {what}"


def request_annotations(command: str, now: datetime) -> dict[str, str | None]:
    """The annotations a command writes (a merge patch: None removes one)."""
    if command == "pause":
        return {PAUSE_ANNOTATION: "true"}
    if command == "resume":
        return {PAUSE_ANNOTATION: None}
    if command in REQUEST_ANNOTATIONS:
        return {REQUEST_ANNOTATIONS[command]: now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
    raise ValueError(f"unknown command {command!r}")
