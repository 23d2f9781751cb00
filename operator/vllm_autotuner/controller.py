"""One level-triggered reconcile of a VLLMDeployment: read, render and apply, publish status.

This module sequences I/O (adapters) around pure decisions (core). kopf's handlers in
`operator.py` only gather their inputs and call `Controller.reconcile`; everything that decides
anything is in `core/` and tested without a cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from vllm_autotuner import API_VERSION
from vllm_autotuner.adapters.kube import KubeClient, resource_path
from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_autotuner.api.policy import VLLMTuningPolicySpec
from vllm_autotuner.core import render
from vllm_autotuner.core.conditions import ConditionUpdate
from vllm_autotuner.core.policy import Resolution, resolve
from vllm_autotuner.core.starting_point import starting_knobs
from vllm_autotuner.core.status import ChildState, compute_status, readiness, status_patch
from vllm_autotuner.core.tuning_types import Knobs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Outcome:
    """What one reconcile did, for events, metrics and tests."""

    applied: list[str] = field(default_factory=list)  # kinds written
    status_written: bool = False
    events: list[Event] = field(default_factory=list)


def utcnow() -> datetime:
    return datetime.now(tz=UTC)


def _knobs_from_status(raw: Mapping[str, Any] | None) -> Knobs | None:
    if not raw:
        return None
    try:
        return Knobs.from_dict(raw)
    except (KeyError, TypeError, ValueError):
        return None


class Controller:
    def __init__(self, kube: KubeClient, clock: Callable[[], datetime] = utcnow) -> None:
        self.kube = kube
        self.clock = clock
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """One reconcile at a time per object: the timer and the event handlers share it."""
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        self._locks.pop((namespace, name), None)

    async def reconcile(
        self,
        body: Mapping[str, Any],
        *,
        policies: Mapping[str, Mapping[str, Any]],
        namespace_labels: Mapping[str, str],
        children: Mapping[str, Mapping[str, Any] | None],
    ) -> Outcome:
        """`children` maps kind ("Deployment", "Service") to the live child, or None."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        async with self.lock(namespace, name):
            return await self._reconcile(body, policies, namespace_labels, children)

    async def _reconcile(
        self,
        body: Mapping[str, Any],
        policies: Mapping[str, Mapping[str, Any]],
        namespace_labels: Mapping[str, str],
        children: Mapping[str, Mapping[str, Any] | None],
    ) -> Outcome:
        meta = body["metadata"]
        namespace, name = str(meta["namespace"]), str(meta["name"])
        generation = meta.get("generation")
        previous = dict(body.get("status") or {})
        outcome = Outcome()
        now = self.clock()
        child = ChildState.from_manifest(children.get("Deployment"))
        updates: list[ConditionUpdate] = []
        fields: dict[str, Any] = {}

        try:
            spec = VLLMDeploymentSpec.model_validate(dict(body.get("spec") or {}))
        except ValidationError as exc:
            message = f"spec is invalid: {_first_errors(exc)}"
            updates += [
                ConditionUpdate("Degraded", "True", "InvalidSpec", message),
                ConditionUpdate("PolicyResolved", "Unknown", "InvalidSpec", message),
                readiness(child),
            ]
            outcome.events.append(Event("Warning", "InvalidSpec", message))
            await self._write_status(
                namespace, name, previous, generation, now, updates, {}, outcome
            )
            return outcome

        policy_name = spec.tuning.policy_ref
        resolution = self._resolve(
            spec, policy_name, policies.get(policy_name), namespace, namespace_labels
        )
        fields["mode"] = resolution.mode if resolution.ok else spec.tuning.mode
        fields["policy"] = resolution.policy_name
        fields["replicas"] = child.replicas
        fields["readyReplicas"] = child.ready_replicas
        fields["updatedReplicas"] = child.updated_replicas

        if not resolution.ok:
            updates += [
                ConditionUpdate("PolicyResolved", "False", resolution.reason, resolution.message),
                ConditionUpdate("Degraded", "True", resolution.reason, resolution.message),
                ConditionUpdate(
                    "Tuning", "False", resolution.reason, "not tuning: no usable policy"
                ),
                readiness(child),
            ]
            if previous_reason(previous, "PolicyResolved") != resolution.reason:
                outcome.events.append(Event("Warning", resolution.reason, resolution.message))
            await self._write_status(
                namespace, name, previous, generation, now, updates, fields, outcome
            )
            return outcome

        policy_spec = _policy_spec(policies.get(policy_name)) if resolution.policy_name else None
        previous_tuning = dict(previous.get("tuning") or {})
        start = starting_knobs(spec, policy_spec)
        if resolution.mode == "Off":
            knobs = start.knobs  # Off: exactly what the spec says (or vLLM's defaults)
        else:
            knobs = _knobs_from_status(previous_tuning.get("applied")) or start.knobs
        if start.notes and knobs == start.knobs:
            for note in start.notes:
                if previous_tuning.get("startNote") != note:
                    outcome.events.append(Event("Warning", "KnobsClamped", note))

        owner = render.Owner(name=name, namespace=namespace, uid=str(meta["uid"]))
        desired = {
            "Deployment": render.render_deployment(spec, knobs, owner),
            "Service": render.render_service(spec, owner),
        }
        for kind, manifest in desired.items():
            live = children.get(kind)
            if live is None or render.drifted(manifest, live):
                await self.kube.apply(manifest)
                outcome.applied.append(kind)
        if "Deployment" in outcome.applied:
            verb = "Created" if children.get("Deployment") is None else "Updated"
            outcome.events.append(
                Event(
                    "Normal",
                    f"Deployment{verb}",
                    f"{verb} Deployment {name} with {render.knob_label(knobs)}",
                )
            )

        tuning = dict(previous_tuning)
        tuning["applied"] = knobs.to_dict()
        tuning.setdefault("phase", "Idle" if resolution.mode == "Off" else "Observing")
        if resolution.mode == "Off":
            tuning["phase"] = "Idle"
        if start.notes:
            tuning["startNote"] = start.notes[-1]
        else:
            tuning.pop("startNote", None)
        fields["tuning"] = tuning
        tuning_message = {
            "Off": "tuning is off (mode Off)",
            "Recommend": "recommending only (mode Recommend); no trial running",
            "Auto": "no trial running",
        }[resolution.mode]
        updates += [
            ConditionUpdate("PolicyResolved", "True", resolution.reason, resolution.message),
            ConditionUpdate("Degraded", "False", "AsExpected", ""),
            ConditionUpdate("Tuning", "False", "Idle", tuning_message),
            readiness(child),
        ]
        await self._write_status(
            namespace, name, previous, generation, now, updates, fields, outcome
        )
        return outcome

    def _resolve(
        self,
        spec: VLLMDeploymentSpec,
        policy_name: str,
        raw_policy: Mapping[str, Any] | None,
        namespace: str,
        namespace_labels: Mapping[str, str],
    ) -> Resolution:
        if raw_policy is None:
            return resolve(spec, policy_name, None, namespace, namespace_labels)
        try:
            policy = VLLMTuningPolicySpec.model_validate(dict(raw_policy))
        except ValidationError as exc:
            return Resolution(
                ok=False,
                reason="PolicyInvalid",
                message=f"VLLMTuningPolicy {policy_name!r} is invalid: {_first_errors(exc)}",
            )
        return resolve(spec, policy_name, policy, namespace, namespace_labels)

    async def _write_status(
        self,
        namespace: str,
        name: str,
        previous: Mapping[str, Any],
        generation: int | None,
        now: datetime,
        updates: list[ConditionUpdate],
        fields: Mapping[str, Any],
        outcome: Outcome,
    ) -> None:
        new = compute_status(
            previous, generation=generation, now=now, updates=updates, fields=fields
        )
        patch = status_patch(previous, new)
        if not patch:
            return
        path = resource_path(API_VERSION, "vllmdeployments", namespace, name)
        await self.kube.merge_patch(path, {"status": patch}, subresource="status")
        outcome.status_written = True


def previous_reason(status: Mapping[str, Any], cond_type: str) -> str | None:
    for cond in status.get("conditions") or ():
        if cond.get("type") == cond_type:
            return str(cond.get("reason"))
    return None


def _policy_spec(raw: Mapping[str, Any] | None) -> VLLMTuningPolicySpec | None:
    if raw is None:
        return None
    return VLLMTuningPolicySpec.model_validate(dict(raw))


def _first_errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    more = len(exc.errors()) - limit
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
