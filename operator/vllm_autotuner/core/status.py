"""Compute the status the operator should publish, from what it observed and decided.

Pure, so the rules for Ready/Degraded/PolicyResolved are tested without a cluster, and so a
status that did not change compares equal and is never written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from vllm_autotuner.core.conditions import ConditionUpdate, set_conditions


@dataclass(frozen=True)
class ChildState:
    """What the owned Deployment says about itself (from its status)."""

    exists: bool
    desired_replicas: int = 0
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    available_replicas: int = 0
    generation: int = 0
    observed_generation: int = 0
    conditions: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any] | None) -> ChildState:
        if not manifest:
            return cls(exists=False)
        spec = manifest.get("spec") or {}
        status = manifest.get("status") or {}
        meta = manifest.get("metadata") or {}
        return cls(
            exists=True,
            desired_replicas=int(spec.get("replicas", 1)),
            replicas=int(status.get("replicas", 0)),
            ready_replicas=int(status.get("readyReplicas", 0)),
            updated_replicas=int(status.get("updatedReplicas", 0)),
            available_replicas=int(status.get("availableReplicas", 0)),
            generation=int(meta.get("generation", 0)),
            observed_generation=int(status.get("observedGeneration", 0)),
            conditions=tuple(status.get("conditions") or ()),
        )

    def condition(self, cond_type: str) -> Mapping[str, Any] | None:
        for cond in self.conditions:
            if cond.get("type") == cond_type:
                return cond
        return None

    @property
    def rollout_complete(self) -> bool:
        return (
            self.exists
            and self.observed_generation >= self.generation
            and self.updated_replicas == self.desired_replicas
            and self.replicas == self.desired_replicas
            and self.available_replicas == self.desired_replicas
        )


def readiness(child: ChildState) -> ConditionUpdate:
    """Ready means the model is being served, which stays true during a rolling update.

    It follows the Deployment's own Available condition (available >= replicas - maxUnavailable),
    so background tuning rollouts do not flip an Argo CD Application to Progressing.
    """
    if not child.exists:
        return ConditionUpdate("Ready", "False", "Deploying", "waiting for the Deployment")
    counts = f"{child.available_replicas}/{child.desired_replicas} replicas available"
    if child.desired_replicas == 0:
        return ConditionUpdate("Ready", "True", "ScaledToZero", "replicas is 0")
    progressing = child.condition("Progressing")
    if progressing is not None and progressing.get("reason") == "ProgressDeadlineExceeded":
        return ConditionUpdate(
            "Ready",
            "False",
            "ProgressDeadlineExceeded",
            f"{counts}; {progressing.get('message', '')}",
        )
    available = child.condition("Available")
    serving = (
        available.get("status") == "True"
        if available is not None
        else child.available_replicas >= child.desired_replicas
    )
    if serving and child.available_replicas > 0:
        suffix = "" if child.rollout_complete else "; rollout in progress"
        return ConditionUpdate("Ready", "True", "Available", counts + suffix)
    return ConditionUpdate("Ready", "False", "Progressing", counts)


def compute_status(
    previous: Mapping[str, Any] | None,
    *,
    generation: int | None,
    now: datetime,
    updates: Sequence[ConditionUpdate],
    fields: Mapping[str, Any],
) -> dict[str, Any]:
    """The full new status: previous fields, then `fields` on top, conditions merged."""
    status: dict[str, Any] = {k: v for k, v in dict(previous or {}).items() if k != "conditions"}
    status.update(fields)
    if generation is not None:
        status["observedGeneration"] = generation
    status["conditions"] = set_conditions(
        (previous or {}).get("conditions"), updates, generation=generation, now=now
    )
    return status


def status_patch(previous: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) from previous to new, empty when nothing changed.

    A merge patch merges objects key by key, so a key that disappeared, at any depth, is set to
    None to remove it: a field the tuner no longer has (the candidate after a trial, the last
    trial's canary analysis) must not stay behind in status, where the next reconcile would
    read it back as state.
    """
    old = dict(previous or {})
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = status_patch(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or before != value:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch
