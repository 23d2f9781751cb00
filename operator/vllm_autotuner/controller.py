"""One level-triggered reconcile of a VLLMDeployment: read, render and apply, publish status.

This module sequences I/O (adapters) around pure decisions (core). kopf's handlers in
`operator.py` only gather their inputs and call `Controller.reconcile`; everything that decides
anything is in `core/` and tested without a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from pydantic import ValidationError

from vllm_autotuner import API_VERSION, DEPLOYMENT_LABEL, FIELD_MANAGER
from vllm_autotuner.adapters.kube import (
    Conflict,
    KubeClient,
    KubeError,
    object_path,
    resource_path,
)
from vllm_autotuner.adapters.metrics import OperatorMetrics
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.api.common import LabelSelector
from vllm_autotuner.api.deployment import VLLMDeploymentSpec, child_name_problem
from vllm_autotuner.api.policy import VLLMTuningPolicySpec
from vllm_autotuner.core import render
from vllm_autotuner.core.autoscaling import (
    HANDOFF_MANAGER,
    Owner,
    owns_replicas,
    published_capacity,
    replicas_manifest,
    replicas_now,
    scaling_from_status,
    scaling_to_status,
    serving_pods,
    track,
)
from vllm_autotuner.core.commands import (
    PAUSE_ANNOTATION,
    forget_latest_block,
    hold_while_paused,
    read_commands,
)
from vllm_autotuner.core.conditions import ConditionUpdate, format_time
from vllm_autotuner.core.decide import Decision, canary_command, decide
from vllm_autotuner.core.perf_model import AnalyticModel, PerformanceModel
from vllm_autotuner.core.policy import Resolution, governing_policies, resolve
from vllm_autotuner.core.rollout import adopt_unrecorded
from vllm_autotuner.core.sanitize import MAX_EVENT_TEXT, clean_status, clean_text
from vllm_autotuner.core.search_memo import SearchMemo
from vllm_autotuner.core.snapshot import (
    Observation,
    Scaling,
    Snapshot,
    defect,
    evidence_window_s,
)
from vllm_autotuner.core.starting_point import StartingPoint, starting_knobs
from vllm_autotuner.core.status import ChildState, compute_status, readiness, status_patch
from vllm_autotuner.core.topology import Topology, canary_running, topology
from vllm_autotuner.core.tuning_inputs import (
    deployment_context,
    deployment_knobs,
    observed_load_time,
    observed_summary,
    pod_health,
    ready_since,
    strip_none,
    tuning_policy,
)
from vllm_autotuner.core.tuning_types import (
    SLO,
    Commands,
    DeploymentContext,
    Knobs,
    PodHealth,
    RolloutSettings,
    TuningPolicy,
    TuningState,
)
from vllm_autotuner.core.vllm_checks import startup_refusal
from vllm_autotuner.observer import Observer

log = logging.getLogger(__name__)

NO_COMMANDS = Commands()
# How long our own apply's answer stands in for a child the watch has not delivered yet.
APPLIED_GRACE_S = 10.0
# The children a VLLMDeployment owns, by the names the reconcile gives them.
CHILD_KINDS = ("Deployment", "Service", "Canary")


def canary_key(key: tuple[str, str]) -> tuple[str, str]:
    """The observer's key for a deployment's canary pod (a name no object can have)."""
    return (key[0], key[1] + "/canary")


@dataclass(frozen=True)
class Event:
    """An Event to post about the VLLMDeployment; its note is cleaned and cut on creation
    (it may quote Prometheus, the API server or the tenant's own spec)."""

    type: str  # Normal | Warning
    reason: str
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", clean_text(self.message, MAX_EVENT_TEXT))


REFUSED_STATUSES = (400, 422)  # the API server refused the object itself: retrying cannot help
REJECTION_BACKOFF_S = (60.0, 1800.0)  # first and longest wait before re-sending a refused child


def rejection_backoff(failures: int) -> timedelta:
    """60 s after the first refusal, doubling, at most 30 minutes."""
    first, longest = REJECTION_BACKOFF_S
    return timedelta(seconds=min(longest, first * 2 ** max(0, min(failures, 20) - 1)))


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Rejection:
    """A child the API server refused: what was sent, how often, and when to try again."""

    digest: str
    failures: int
    message: str
    retry_at: datetime

    def describe(self, kind: str) -> str:
        return (
            f"the API server refused the {kind}: {self.message}; not sent again before "
            f"{format_time(self.retry_at)} unless it changes"
        )


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


def reuses(memo: SearchMemo | None, now: datetime, policy: TuningPolicy) -> bool:
    """Whether a decision will most likely reuse `memo` instead of searching: it is younger
    than the evaluation window (SearchMemo.answers also wants the evidence unchanged)."""
    if memo is None:
        return False
    age = (now - memo.time).total_seconds()
    return 0.0 <= age < policy.evaluation_window_s


class Controller:
    def __init__(
        self,
        kube: KubeClient,
        clock: Callable[[], datetime] = utcnow,
        *,
        observer: Observer | None = None,
        metrics: OperatorMetrics | None = None,
        model_factory: Callable[[DeploymentContext], PerformanceModel] | None = None,
        decide_workers: int = 1,
    ) -> None:
        self.kube = kube
        # Calibrations and searches are CPU-bound Python: they hold the GIL, so more threads
        # add no throughput and take the event loop's share. Threads of their own, not the
        # loop's default executor, where they would also queue the Prometheus reads behind
        # them (docs/scale.md). A decision that will most likely reuse its last search (a
        # few ms when the window has not moved) has a lane of its own, so that it never
        # waits behind other deployments' searches (~100 ms each, a storm of them when many
        # deployments start at once or their searches expire together).
        self._decide_pool = ThreadPoolExecutor(decide_workers, thread_name_prefix="decide")
        self._reuse_pool = ThreadPoolExecutor(1, thread_name_prefix="decide-reuse")
        self.clock = clock
        self.observer = observer or Observer(None, clock=clock)
        self.metrics = metrics
        self.model_factory = model_factory or (lambda ctx: AnalyticModel(ctx.gpu_product))
        self._models: dict[tuple[str, str], tuple[DeploymentContext, PerformanceModel]] = {}
        # The last search per deployment: decide() reuses it until there is new evidence.
        self._searches: dict[tuple[str, str], SearchMemo] = {}
        # The last usable window per deployment: its request rate sizes the next window
        # (core/snapshot.evidence_window_s).
        self._evidence: dict[tuple[str, str], Snapshot] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # What our own applies returned: fresher than the watch-fed indexes for a moment, so a
        # reconcile right after an apply does not apply (and announce) the same child again.
        self._applied: dict[tuple[str, str, str], tuple[float, Mapping[str, Any]]] = {}
        # The VLLMDeployment as our last status write returned it, until the watch catches up:
        # a reconcile from an older copy (an index or kopf body behind the watch) would decide
        # again from the state before that write, e.g. re-apply a trial it just rolled back.
        self._written: dict[tuple[str, str], Mapping[str, Any]] = {}
        # Children the API server refused, by (namespace, name, kind): not re-sent unchanged
        # before their back-off ends.
        self._rejected: dict[tuple[str, str, str], Rejection] = {}

    def close(self) -> None:
        """Stop the decision threads (decisions queued behind the running ones are dropped)."""
        for pool in (self._decide_pool, self._reuse_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """One reconcile at a time per object: the periodic one and the event handlers share it."""
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        self._locks.pop((namespace, name), None)
        for kind in CHILD_KINDS:
            self._applied.pop((namespace, name, kind), None)
            self._rejected.pop((namespace, name, kind), None)
        self._models.pop((namespace, name), None)
        self._searches.pop((namespace, name), None)
        self._evidence.pop((namespace, name), None)
        self._written.pop((namespace, name), None)
        self.observer.forget((namespace, name))
        if self.metrics is not None:
            self.metrics.forget(namespace, name)

    async def reconcile(
        self,
        body: Mapping[str, Any],
        *,
        policies: Mapping[str, Mapping[str, Any]],
        namespace_labels: Mapping[str, str],
        children: Mapping[str, Mapping[str, Any] | None],
        pods: Sequence[Mapping[str, Any]] = (),
        replicasets: Sequence[Mapping[str, Any]] = (),
    ) -> Outcome:
        """`children` maps kind ("Deployment", "Service", and "Canary" for the canary
        Deployment) to the live child, or None; `pods` are the pods carrying the deployment's
        labels and `replicasets` the ReplicaSets: only pods a ReplicaSet of our Deployments
        (stable or canary) controls count (anyone can copy labels)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        async with self.lock(namespace, name):
            body = self._freshest_self(namespace, name, body)
            fresh = self._freshest(namespace, name, children)
            deployments = [d for d in (fresh.get("Deployment"), fresh.get("Canary")) if d]
            mine = owned_pods(pods, replicasets, deployments, str(meta.get("uid")))
            return await self._reconcile(body, policies, namespace_labels, children, mine)

    def _freshest_self(
        self, namespace: str, name: str, body: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """The newer of `body` and what our last status write returned (by resourceVersion)."""
        written = self._written.get((namespace, name))
        if written is None:
            return body
        if _resource_version(body) >= _resource_version(written):
            del self._written[(namespace, name)]  # the watch has caught up
            return body
        return written

    async def _reconcile(
        self,
        body: Mapping[str, Any],
        policies: Mapping[str, Mapping[str, Any]],
        namespace_labels: Mapping[str, str],
        children: Mapping[str, Mapping[str, Any] | None],
        pods: Sequence[Mapping[str, Any]],
    ) -> Outcome:
        meta = body["metadata"]
        namespace, name = str(meta["namespace"]), str(meta["name"])
        generation = meta.get("generation")
        previous = dict(body.get("status") or {})
        outcome = Outcome()
        now = self.clock()
        children = self._freshest(namespace, name, children)
        child = ChildState.from_manifest(children.get("Deployment"))
        updates: list[ConditionUpdate] = []
        fields: dict[str, Any] = {}

        try:
            spec = VLLMDeploymentSpec.model_validate(dict(body.get("spec") or {}))
            refusal = _refusal(name, spec)
        except ValidationError as exc:
            refusal = ("InvalidSpec", f"spec is invalid: {_first_errors(exc)}")
        if refusal is not None:
            reason, message = refusal
            updates += [
                ConditionUpdate("Degraded", "True", reason, message),
                ConditionUpdate("PolicyResolved", "Unknown", reason, message),
                readiness(child),
            ]
            if previous_reason(previous, "Degraded") != reason:
                outcome.events.append(Event("Warning", reason, message))
            await self._write_status(
                namespace, name, previous, generation, now, updates, {}, outcome
            )
            return outcome

        policy_name = spec.tuning.policy_ref
        resolution = self._resolve(spec, policy_name, policies, namespace, namespace_labels)
        fields["mode"] = resolution.mode if resolution.ok else spec.tuning.mode
        fields["policy"] = resolution.policy_name
        canary_child = ChildState.from_manifest(children.get("Canary"))
        fields["replicas"] = child.replicas + canary_child.replicas  # /scale's status replicas
        fields["selector"] = f"{DEPLOYMENT_LABEL}={name}"  # every pod, canary included
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
        commands, pending = read_commands(meta.get("annotations"), previous.get("handledRequests"))
        start = starting_knobs(spec, policy_spec)
        for note in start.notes:
            if previous_tuning.get("startNote") != note:
                outcome.events.append(Event("Warning", "KnobsClamped", note))
        owner_kind: Owner = spec.autoscaling.target or "VLLMDeployment"
        tuned = await self._tune(
            (namespace, name),
            spec,
            resolution,
            policy_spec,
            start,
            previous_tuning,
            pods,
            now,
            deployment_knobs(children.get("Deployment")),
            commands,
            ReplicaView(
                replicas_now(owner_kind, spec.replicas, children.get("Deployment")),
                scaling_from_status(previous.get("scaling")),
            ),
        )
        knobs = tuned.knobs
        outcome.events.extend(tuned.events)
        outcome.events.extend(pause_transition(previous, commands))
        outcome.events.extend(metrics_transition(previous, tuned.updates))
        owner = render.Owner(name=name, namespace=namespace, uid=str(meta["uid"]))
        topo = tuned.topology or Topology(knobs, spec.replicas)
        refused = await self._roll_children(
            owner, spec, tuned, topo, children, previous, owner_kind, generation, now, outcome
        )
        fields.update(_tuned_fields(previous, commands, pending, tuned, start, topo, owner_kind))
        tuning = fields["tuning"]
        degraded = (
            refused or tuned.degraded or ConditionUpdate("Degraded", "False", "AsExpected", "")
        )
        if refused is not None and previous_reason(previous, "Degraded") != refused.reason:
            outcome.events.append(Event("Warning", refused.reason, refused.message))
        updates += [
            ConditionUpdate("PolicyResolved", "True", resolution.reason, resolution.message),
            degraded,
            *tuned.updates,
            readiness(child),
        ]
        if self.metrics is not None:
            self.metrics.set_knobs(namespace, name, dict(knobs.to_dict()))
            self.metrics.set_phase(namespace, name, str(tuning.get("phase", "Idle")))
            self.metrics.set_slo_met(namespace, name, tuned.slo_met)
        await self._write_status(
            namespace, name, previous, generation, now, updates, fields, outcome
        )
        return outcome

    async def _roll_children(
        self,
        owner: render.Owner,
        spec: VLLMDeploymentSpec,
        tuned: Tuned,
        topo: Topology,
        children: Mapping[str, Mapping[str, Any] | None],
        previous: Mapping[str, Any],
        owner_kind: Owner,
        generation: Any,
        now: datetime,
        outcome: Outcome,
    ) -> ConditionUpdate | None:
        """Render the children for the tuned knobs and topology and apply them (removing a
        canary no longer wanted, and leaving the replica count to an autoscaler that owns
        it); then tell the observer what to read next. The Degraded condition an apply the
        API server refused sets (None: none was refused)."""
        namespace, name = owner.namespace, owner.name
        knobs = tuned.knobs
        desired = {
            "Deployment": render.render_deployment(spec, knobs, owner, topo.stable_replicas),
            "Service": render.render_service(spec, owner),
        }
        if owner_kind == "Deployment":
            # An autoscaler owns the count: our applies never name it (docs/autoscaling.md).
            del desired["Deployment"]["spec"]["replicas"]
            previous_owner = (previous.get("scaling") or {}).get("owner")
            await self._release_replicas(owner, children.get("Deployment"), previous_owner)
        if topo.canary is not None:
            desired["Canary"] = render.render_canary(spec, topo.canary, owner)
        await self._remove_canary(namespace, name, children.get("Canary"), desired, owner)
        seed = spec.replicas if owner_kind == "Deployment" else None
        refused = await self._apply_children(
            (namespace, name), desired, children, now, outcome, seed
        )
        if tuned.observe is not None:
            tuned.observe()
        if "Deployment" in outcome.applied:
            outcome.events.append(
                _deployment_event(
                    name,
                    generation,
                    knobs,
                    desired["Deployment"],
                    children.get("Deployment"),
                    previous,
                )
            )
        return refused

    async def _release_replicas(
        self, owner: render.Owner, live: Mapping[str, Any] | None, previous_owner: Any
    ) -> None:
        """Before our first apply that leaves spec.replicas out of a Deployment that exists:
        if our field manager owns the field, hand it to HANDOFF_MANAGER at its live value, or
        the apply would remove it and the Deployment fall back to one replica. Never forced:
        a conflict means an autoscaler has just taken the field, which is what we want."""
        if live is None or previous_owner == "Deployment":
            return
        path = resource_path("apps/v1", "deployments", owner.namespace, owner.name)
        full = await self.kube.get(path)
        if full is None:
            return
        if not owns_replicas((full.get("metadata") or {}).get("managedFields"), FIELD_MANAGER):
            return
        count = int((full.get("spec") or {}).get("replicas", 1))
        with contextlib.suppress(Conflict):
            await self.kube.apply(
                replicas_manifest(owner.name, owner.namespace, count),
                force=False,
                field_manager=HANDOFF_MANAGER,
            )

    async def _seed_replicas(self, namespace: str, name: str, count: int) -> dict[str, Any] | None:
        """A Deployment we just created without spec.replicas starts at spec.replicas of the
        VLLMDeployment, set by HANDOFF_MANAGER (never forced: a conflict means an autoscaler
        got there first), so that the autoscaler takes it over from a manager that never
        applies it again. Returns the Deployment as the server has it then."""
        try:
            return await self.kube.apply(
                replicas_manifest(name, namespace, count),
                force=False,
                field_manager=HANDOFF_MANAGER,
            )
        except Conflict:
            return None

    async def _remove_canary(
        self,
        namespace: str,
        name: str,
        live: Mapping[str, Any] | None,
        desired: Mapping[str, Any],
        owner: render.Owner,
    ) -> None:
        """Delete a canary Deployment of ours that the tuning state no longer calls for."""
        if live is None or "Canary" in desired:
            return
        refs = (live.get("metadata") or {}).get("ownerReferences") or []
        if not any(r.get("uid") == owner.uid and r.get("controller") for r in refs):
            return
        path = resource_path("apps/v1", "deployments", namespace, render.canary_name(name))
        await self.kube.delete(path)
        self._applied.pop((namespace, name, "Canary"), None)

    async def _apply_children(
        self,
        key: tuple[str, str],
        desired: Mapping[str, Mapping[str, Any]],
        children: Mapping[str, Mapping[str, Any] | None],
        now: datetime,
        outcome: Outcome,
        seed: int | None = None,
    ) -> ConditionUpdate | None:
        """Apply each child that is missing or drifted; a Degraded update if one was refused.
        `seed`: an autoscaler owns the count, and a Deployment we create starts at `seed`
        replicas (`_seed_replicas`).

        A child the API server refuses (400/422: a value the CRD could not check) is not sent
        again, unchanged, until its back-off ends: the same PATCH would only fail again.
        """
        namespace, name = key
        conflicts = await self._foreign_children(desired, children)
        if conflicts:
            return ConditionUpdate("Degraded", "True", "NameConflict", "; ".join(conflicts))
        problems: list[str] = []
        for kind, manifest in desired.items():
            live = children.get(kind)
            if live is not None and not render.drifted(manifest, live):
                self._rejected.pop((namespace, name, kind), None)
                continue
            held = self._rejected.get((namespace, name, kind))
            digest = manifest_digest(manifest)
            if held is not None and held.digest == digest and now < held.retry_at:
                problems.append(held.describe(kind))
                continue
            try:
                result = await self.kube.apply(dict(manifest))
            except KubeError as exc:
                if exc.status not in REFUSED_STATUSES:
                    raise
                failures = held.failures + 1 if held is not None and held.digest == digest else 1
                rejection = Rejection(digest, failures, str(exc), now + rejection_backoff(failures))
                self._rejected[(namespace, name, kind)] = rejection
                problems.append(rejection.describe(kind))
                continue
            self._rejected.pop((namespace, name, kind), None)
            if live is None and kind == "Deployment" and seed is not None:
                result = await self._seed_replicas(namespace, name, seed) or result
            self._applied[(namespace, name, kind)] = (time.monotonic(), child_copy(result))
            outcome.applied.append(kind)
        if not problems:
            return None
        return ConditionUpdate("Degraded", "True", "ChildRejected", "; ".join(problems))

    async def _write_status_refused(
        self,
        path: str,
        previous: Mapping[str, Any],
        generation: int | None,
        now: datetime,
        exc: KubeError,
    ) -> dict[str, Any]:
        """After a refused status write: the conditions alone, so status is never left empty
        or silently stale; {} when they already say so."""
        log.warning("%s: the API server refused the status update: %s", path, exc)
        patch = _status_refused_patch(previous, generation, now, exc)
        if not patch:
            return {}
        return await self.kube.merge_patch(path, {"status": patch}, subresource="status")

    async def _foreign_children(
        self,
        desired: Mapping[str, Mapping[str, Any]],
        children: Mapping[str, Mapping[str, Any] | None],
    ) -> list[str]:
        """Why each child name is taken by an object this VLLMDeployment does not control.

        The indexes see only objects with our managed-by label, and anyone can set a label;
        so a child counts as ours only by its controller reference to this object's uid, and a
        name the index does not know is looked up before it is created: applying with force
        would take over a stranger's Service or Deployment, and the owner reference we add
        would let the garbage collector delete it with the VLLMDeployment.
        """
        found = []
        for kind, manifest in desired.items():
            live = children.get(kind)
            if live is None:
                live = await self.kube.get(object_path(dict(manifest)))
            owner = manifest["metadata"]["ownerReferences"][0]
            if live is not None and not controlled_by(live, owner["uid"]):
                found.append(_conflict_message(kind, manifest, live))
        return found

    def child_deleted(self, namespace: str, name: str, kind: str) -> None:
        """The watch saw our child deleted: what we applied before no longer stands."""
        self._applied.pop((namespace, name, kind), None)

    def _freshest(
        self, namespace: str, name: str, children: Mapping[str, Mapping[str, Any] | None]
    ) -> dict[str, Mapping[str, Any] | None]:
        """Each child as the newest of the index's copy and our last apply's answer."""
        merged = dict(children)
        for kind in CHILD_KINDS:
            entry = self._applied.get((namespace, name, kind))
            if entry is None:
                continue
            applied_at, ours = entry
            live = merged.get(kind)
            if live is None:
                # The index may lag our own create; past a few seconds an absent child is
                # really absent (deleted by someone) and must be re-created.
                if time.monotonic() - applied_at < APPLIED_GRACE_S:
                    merged[kind] = ours
                else:
                    del self._applied[(namespace, name, kind)]
            elif _resource_version(ours) > _resource_version(live):
                merged[kind] = ours
            else:
                # The watch has caught up: our copy has done its job (and would otherwise
                # hold a whole object per child, at a thousand deployments).
                del self._applied[(namespace, name, kind)]
        return merged

    def model_for(self, key: tuple[str, str], ctx: DeploymentContext) -> PerformanceModel:
        """One model per deployment, kept across reconciles so its caches pay off."""
        # The replica count and rollout settings are not the model's business: a scale event
        # must not throw away its caches.
        ctx = replace(ctx, replicas=1, rollout=RolloutSettings(), autoscaled=False)
        cached = self._models.get(key)
        if cached is None or cached[0] != ctx:
            cached = (ctx, self.model_factory(ctx))
            self._models[key] = cached
        return cached[1]

    async def _tune(
        self,
        key: tuple[str, str],
        spec: VLLMDeploymentSpec,
        resolution: Resolution,
        policy_spec: VLLMTuningPolicySpec | None,
        start: StartingPoint,
        previous_tuning: Mapping[str, Any],
        pods: Sequence[Mapping[str, Any]],
        now: datetime,
        live: Knobs | None = None,
        commands: Commands = NO_COMMANDS,
        view: ReplicaView | None = None,
    ) -> Tuned:
        """Run one step of the tuner (none in mode Off) and say what it means for status.

        `commands` come from the annotations (core/commands.py): a pause turns a rollout into
        a hold; a retry forgets the latest blocked configuration before deciding. promote and
        abort are passed on for the canary (not acted on here yet).
        """
        view = view or ReplicaView(spec.replicas, None)
        serving = serving_pods(pods)
        if resolution.mode == "Off" or policy_spec is None:
            self.observer.forget(key)
            return Tuned(
                scaling=track(view.scaling, view.replicas, serving, view.replicas, now),
                knobs=start.knobs,
                tuning={"phase": "Idle", "applied": start.knobs.to_dict()},
                updates=[
                    ConditionUpdate("Tuning", "False", "TuningOff", "tuning is off (mode Off)"),
                    ConditionUpdate("MetricsAvailable", "Unknown", "TuningOff", ""),
                    ConditionUpdate("SLOMet", "Unknown", "TuningOff", ""),
                ],
            )
        policy = tuning_policy(resolution, policy_spec)
        ctx = deployment_context(spec, observed_load_time(pods), view.replicas)
        state, adoption, handled = self._state_to_tune(
            key, previous_tuning, start, live, policy, now, commands
        )
        health = tuple(pod_health(p) for p in pods)
        snapshot = self.observer.latest(key, policy.evaluation_window_s)
        if snapshot.available:
            self._evidence[key] = snapshot
        canary_snapshot = (
            self.observer.latest(canary_key(key), policy.evaluation_window_s)
            if canary_running(state)
            else None
        )
        scaling = track(view.scaling, ctx.replicas, serving, topology(state, ctx).pods, now)
        observation = Observation(snapshot, health, canary_snapshot, scaling)
        by_hand = _by_hand(state, policy, now, commands)
        if by_hand is not None:
            decision, command = by_hand
            handled = (*handled, command)
        else:
            decision = await self._decide(key, state, observation, policy, ctx, now, start)
        if decision.search_memo is not None:
            self._searches[key] = decision.search_memo
        if commands.paused:
            decision = hold_while_paused(decision, state, now)
        new = decision.new_state
        knobs = new.applied
        namespace, name = key
        log_decision(namespace, name, decision, previous_tuning.get("lastDecision"))
        topo = topology(new, ctx)
        # Observed from the next cycle on only once this reconcile's applies went through: a
        # rollout the API server refused must not turn the next window into one of a revision
        # that never ran ("no ready pods").
        observe = partial(self._want_snapshots, key, spec, policy, pods, topo, new, scaling)
        self._record(namespace, name, policy, new, topo, snapshot, decision)
        in_trial = new.phase in ("RollingOut", "Verifying", "Promoting")
        snapshot, metrics_cond = _metrics_condition(snapshot, policy)
        updates = [
            ConditionUpdate(
                "Tuning",
                "True" if in_trial else "False",
                "Paused" if commands.paused else new.phase,
                decision.reason,
            ),
            metrics_cond,
            _slo_condition(snapshot, policy.slo),
        ]
        degraded = _crash_looping(health, knobs)
        met = _slo_met(snapshot, policy.slo)
        return Tuned(
            knobs=knobs,
            tuning=strip_none(new.to_dict()),
            updates=updates,
            events=[*adoption, *(Event(e.type, e.reason, e.message) for e in decision.events)],
            observed=observed_summary(snapshot, policy.slo, met) if snapshot.available else None,
            degraded=degraded,
            topology=topo,
            slo_met=met,
            handled=handled,
            scaling=scaling,
            state=new,
            observe=observe,
        )

    def _state_to_tune(
        self,
        key: tuple[str, str],
        previous_tuning: Mapping[str, Any],
        start: StartingPoint,
        live: Knobs | None,
        policy: TuningPolicy,
        now: datetime,
        commands: Commands,
    ) -> tuple[TuningState, list[Event], tuple[str, ...]]:
        """The tuner's state from status (or a fresh one at the starting point), having
        adopted a rollout that was applied but not recorded and forgotten the latest block
        on a retry request; the events that say so, and the commands handled."""
        state = _state_from_status(previous_tuning) or TuningState.initial(start.knobs)
        adopted = adopt_unrecorded(state, live, policy, now)
        events: list[Event] = []
        if adopted is not None:
            state = adopted
            events.append(
                Event(
                    "Warning",
                    "RolloutAdopted",
                    f"the Deployment runs {render.knob_label(adopted.applied)}, a rollout that "
                    f"was applied but not recorded (operator restart?); verifying it as trial "
                    f"{adopted.next_trial_id() - 1} instead of reverting it",
                )
            )
        handled: tuple[str, ...] = ()
        if commands.retry_requested:
            state, note = forget_latest_block(state)
            self._searches.pop(key, None)  # the memo's search excluded what is now allowed
            handled = ("retry",)
            events.append(Event("Normal", "RetryRequested", note))
        return state, events, handled

    async def _decide(
        self,
        key: tuple[str, str],
        state: TuningState,
        observation: Observation,
        policy: TuningPolicy,
        ctx: DeploymentContext,
        now: datetime,
        start: StartingPoint,
    ) -> Decision:
        """decide(), with the deployment's model and remembered search. A calibration and a
        search take tens to hundreds of ms of CPU (the engine model seconds): off the event
        loop, so the other deployments' reconciles are not held up."""
        model = self.model_for(key, ctx)
        memo = self._searches.get(key)
        lane = self._reuse_pool if reuses(memo, now, policy) else self._decide_pool
        return await asyncio.get_running_loop().run_in_executor(
            lane, partial(decide, state, observation, policy, ctx, now, model, start.knobs, memo)
        )

    def _record(
        self,
        namespace: str,
        name: str,
        policy: TuningPolicy,
        state: TuningState,
        topo: Topology,
        snapshot: Snapshot,
        decision: Decision,
    ) -> None:
        """The operator's metrics for one decision: SLO targets, capacity, and counts of
        decisions, rollouts and rollbacks."""
        if self.metrics is None:
            return
        self.metrics.set_slo_targets(
            namespace,
            name,
            [(m, t.percentile, t.threshold_ms) for m, t in policy.slo.targets()],
        )
        self._publish_capacity(namespace, name, state, topo, snapshot, policy.slo)
        self.metrics.decisions.labels(namespace, name, decision.action).inc()
        if decision.action == "rollout":
            self.metrics.rollouts.labels(namespace, name).inc()
        if decision.action == "rollback":
            self.metrics.rollbacks.labels(namespace, name).inc()

    def _publish_capacity(
        self,
        namespace: str,
        name: str,
        state: TuningState,
        topo: Topology,
        snapshot: Snapshot,
        slo: SLO,
    ) -> None:
        """Per replica: what status.capacity says ("predicted": the calibrated model's capacity
        for the knobs the pods run, core/autoscaling.published_capacity) and, when the window
        met the SLO, the rate one pod served in it: a measured lower bound."""
        assert self.metrics is not None
        published = published_capacity(state, topo)
        predicted = None if published is None else published.per_replica_rps
        self.metrics.set_capacity(namespace, name, "predicted", predicted)
        met = _slo_met(snapshot, slo) if snapshot.available else None
        served = snapshot.per_pod_rate() if met else None
        self.metrics.set_capacity(namespace, name, "measured", served)

    def _want_snapshots(
        self,
        key: tuple[str, str],
        spec: VLLMDeploymentSpec,
        policy: TuningPolicy,
        pods: Sequence[Mapping[str, Any]],
        topo: Topology,
        state: TuningState,
        scaling: Scaling | None = None,
    ) -> None:
        """Ask the observer for the next window of the stable pods and, while a canary runs,
        of the canary pod over the same window: from the later of the two ready times, or
        from when the canary analysis started its fair window. The window is the policy's,
        longer when the deployment serves too few requests for one (evidence_window_s)."""
        window_s = evidence_window_s(
            policy.evaluation_window_s, policy.min_requests_per_window, self._evidence.get(key)
        )

        def target(
            track_key: tuple[str, str],
            knobs: Knobs,
            since: datetime | None,
            pods_since: datetime | None,
        ) -> SnapshotTarget:
            ready = sorted(
                str(h.name)
                for h in (pod_health(p) for p in pods)
                if h.ready and knobs.same_as(h.revision_knobs) and h.name
            )
            return SnapshotTarget(
                namespace=track_key[0],
                name=track_key[1],
                pods=tuple(ready),
                since=since,
                knobs=knobs,
                revision=render.knob_label(knobs),
                window_s=window_s,
                slo=(policy.slo.ttft, policy.slo.itl, policy.slo.e2e),
                model_name=spec.served_model_name or spec.model,
                pods_since=pods_since,
            )

        # A window never reaches back over a settled change of the replica count.
        settled = scaling.settled_at if scaling is not None else None
        stable_since = ready_since(pods, topo.stable)
        since = _latest(stable_since, settled)
        if topo.canary is None:
            self.observer.forget(canary_key(key))
            self.observer.want(target(key, topo.stable, since, stable_since))
            return
        canary_since = ready_since(pods, topo.canary)
        fair = state.analysis.since if state.analysis is not None else None
        both = _latest(since, canary_since, fair)
        self.observer.want(target(key, topo.stable, both, stable_since))
        self.observer.want(target(canary_key(key), topo.canary, both, canary_since))

    def _resolve(
        self,
        spec: VLLMDeploymentSpec,
        policy_name: str,
        policies: Mapping[str, Mapping[str, Any]],
        namespace: str,
        namespace_labels: Mapping[str, str],
    ) -> Resolution:
        """The policy in force. `policies` are all the cluster's (name -> spec): which ones
        select this namespace decides which it may name (core.policy.governing_policies)."""
        raw_policy = policies.get(policy_name)
        if raw_policy is None:
            return resolve(spec, policy_name, None, namespace, namespace_labels)
        governing = governing_policies(_selectors(policies), namespace_labels)
        try:
            policy = VLLMTuningPolicySpec.model_validate(dict(raw_policy))
        except ValidationError as exc:
            if policy_name not in governing:  # not this namespace's to name, valid or not
                policy = None
            else:
                return Resolution(
                    ok=False,
                    reason="PolicyInvalid",
                    message=f"VLLMTuningPolicy {policy_name!r} is invalid: {_first_errors(exc)}",
                )
        if policy is None:
            allowed = ", ".join(governing) or "none"
            return Resolution(
                ok=False,
                reason="PolicyNotAllowed",
                message=f"namespace {namespace!r} is governed by VLLMTuningPolicy {allowed}; "
                f"spec.tuning.policyRef {policy_name!r} is not one of them",
            )
        return resolve(spec, policy_name, policy, namespace, namespace_labels, governing)

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
        new = clean_status(
            compute_status(previous, generation=generation, now=now, updates=updates, fields=fields)
        )
        patch = status_patch(previous, new)
        if not patch:
            return
        path = resource_path(API_VERSION, "vllmdeployments", namespace, name)
        key = (namespace, name, "status")
        held = self._rejected.get(key)
        digest = manifest_digest(patch)
        try:
            if held is not None and held.digest == digest and now < held.retry_at:
                raise KubeError(422, held.message)
            result = await self.kube.merge_patch(path, {"status": patch}, subresource="status")
        except KubeError as exc:
            if exc.status not in REFUSED_STATUSES:
                raise
            failures = held.failures + 1 if held is not None and held.digest == digest else 1
            self._rejected[key] = Rejection(
                digest, failures, str(exc), now + rejection_backoff(failures)
            )
            result = await self._write_status_refused(path, previous, generation, now, exc)
            if not result:
                return
        else:
            self._rejected.pop(key, None)
        outcome.status_written = True
        if isinstance(result.get("metadata"), Mapping) and "status" in result:
            self._written[(namespace, name)] = child_copy(result)


def log_decision(
    namespace: str, name: str, decision: Decision, previous: Mapping[str, Any] | None
) -> None:
    """One log line per decision: the deployment, the action, the knobs and the reason.

    A decision repeated from one reconcile to the next (the same action for the same reason,
    as a hold is) is logged once. The fields are also record attributes, so `--log-format
    json` writes them as keys.
    """
    last = previous or {}
    if (last.get("action"), last.get("reason")) == (decision.action, decision.reason):
        return
    knobs = decision.knobs_to_apply or decision.new_state.applied
    log.info(
        "%s/%s: %s %s: %s",
        namespace,
        name,
        decision.action,
        knobs.describe(),
        decision.reason,
        extra={
            "namespace": namespace,
            "deployment": name,
            "action": decision.action,
            "knobs": dict(knobs.to_dict()),
            "reason": decision.reason,
        },
    )


def _status_refused_patch(
    previous: Mapping[str, Any], generation: int | None, now: datetime, exc: KubeError
) -> dict[str, Any]:
    """A status the API server cannot refuse: only the conditions, saying why."""
    message = f"the API server refused the status update: {exc}"
    update = ConditionUpdate("Degraded", "True", "StatusRejected", message)
    new = compute_status(previous, generation=generation, now=now, updates=[update], fields={})
    return status_patch(previous, clean_status(new))


def _controller_uid(obj: Mapping[str, Any], kind: str, api_version: str) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            if ref.get("kind") == kind and ref.get("apiVersion") == api_version:
                return str(ref.get("uid"))
            return None
    return None


def owned_pods(
    pods: Sequence[Mapping[str, Any]],
    replicasets: Sequence[Mapping[str, Any]],
    deployments: Sequence[Mapping[str, Any]],
    owner_uid: str,
) -> list[Mapping[str, Any]]:
    """The pods that a ReplicaSet of our Deployments (stable, canary) controls, each Deployment
    being one this VLLMDeployment controls. A pod that only carries our labels (copied by a
    careless manifest, or on purpose) neither degrades the deployment nor feeds the tuner."""
    uids = {
        str((d.get("metadata") or {}).get("uid") or "")
        for d in deployments
        if controlled_by(d, owner_uid)
    } - {""}
    if not uids:
        return []
    sets = {
        str((rs.get("metadata") or {}).get("uid"))
        for rs in replicasets
        if _controller_uid(rs, "Deployment", "apps/v1") in uids
    }
    return [p for p in pods if _controller_uid(p, "ReplicaSet", "apps/v1") in sets]


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether `obj`'s controller reference points at the VLLMDeployment with this uid."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return bool(
                ref.get("uid") == uid
                and ref.get("kind") == "VLLMDeployment"
                and ref.get("apiVersion") == API_VERSION
            )
    return False


def _conflict_message(kind: str, manifest: Mapping[str, Any], live: Mapping[str, Any]) -> str:
    name = manifest["metadata"]["name"]
    owners = [
        f"{ref.get('kind')}/{ref.get('name')}"
        for ref in (live.get("metadata") or {}).get("ownerReferences") or ()
        if isinstance(ref, Mapping) and ref.get("controller") is True
    ]
    held = f"controlled by {owners[0]}" if owners else "not created by this VLLMDeployment"
    return (
        f"a {kind} named {name} already exists and is {held}; it was left untouched and "
        "nothing was deployed (rename the VLLMDeployment, or delete that object)"
    )


def _refusal(name: str, spec: VLLMDeploymentSpec) -> tuple[str, str] | None:
    """(reason, message) when no child may be rendered for this object; None otherwise."""
    bad_name = child_name_problem(name)
    if bad_name is not None:
        return "InvalidName", bad_name
    refused = startup_refusal(spec)
    if refused is not None:
        return "VLLMWouldRefuse", refused
    return None


def _deployment_event(
    name: str,
    generation: int | None,
    knobs: Knobs,
    desired: Mapping[str, Any],
    live: Mapping[str, Any] | None,
    previous: Mapping[str, Any],
) -> Event:
    """Say why the Deployment was written: created, updated by us, or restored after someone
    else changed or deleted it (a Warning: a hand edit that keeps being undone needs a person).

    The change is ours when the spec moved on (a generation not yet observed) or the tuner
    chose other knobs than the status says are applied; anything else is drift.
    """
    label = render.knob_label(knobs)
    observed = previous.get("observedGeneration")
    meta = (live or {}).get("metadata") or {}
    applied = _knobs_from_status((previous.get("tuning") or {}).get("applied"))
    ours = (
        observed is None or observed != generation or applied is None or not applied.same_as(knobs)
    )
    if live is None:
        if ours:
            return Event("Normal", "DeploymentCreated", f"Created Deployment {name} with {label}")
        return Event(
            "Warning",
            "DeploymentRestored",
            f"Deployment {name} was deleted by someone else; re-created with {label}",
        )
    if ours or meta.get("deletionTimestamp"):
        return Event("Normal", "DeploymentUpdated", f"Updated Deployment {name} with {label}")
    fields = render.drift_paths(dict(desired), dict(live))
    shown = ", ".join(fields[:5]) + (f" and {len(fields) - 5} more" if len(fields) > 5 else "")
    return Event(
        "Warning",
        "DeploymentRestored",
        f"Deployment {name} was changed by someone else ({shown or 'unknown fields'}); "
        f"restored to {label}",
    )


def pause_transition(previous: Mapping[str, Any], commands: Commands) -> list[Event]:
    """An Event when tuning is paused or resumed by the annotation."""
    was = bool(previous.get("paused"))
    if commands.paused and not was:
        return [
            Event(
                "Normal",
                "TuningPaused",
                f"tuning is paused by the annotation {PAUSE_ANNOTATION}: nothing is rolled out "
                "until it is removed (vllm-autotuner resume)",
            )
        ]
    if was and not commands.paused:
        return [Event("Normal", "TuningResumed", "tuning resumes: the pause annotation is gone")]
    return []


LOST_METRICS = ("MetricsUnavailable", "MetricsInvalid")


def metrics_transition(
    previous: Mapping[str, Any], updates: Sequence[ConditionUpdate]
) -> list[Event]:
    """An Event when metrics are lost or come back: the tuner holds without them, and a
    condition flip alone is easy to miss. A new revision warming up (WaitingForRevision) is
    neither: it follows every rollout."""
    before = _condition(previous, "MetricsAvailable")
    for update in updates:
        if update.type != "MetricsAvailable":
            continue
        was_true = before.get("status") == "True"
        was_lost = before.get("status") == "False" and before.get("reason") in LOST_METRICS
        if was_true and update.status == "False" and update.reason in LOST_METRICS:
            return [Event("Warning", update.reason, f"tuning holds: {update.message}")]
        if was_lost and update.status == "True":
            return [Event("Normal", "MetricsRecovered", f"tuning resumes: {update.message}")]
    return []


def _condition(status: Mapping[str, Any], cond_type: str) -> Mapping[str, Any]:
    for cond in status.get("conditions") or ():
        if cond.get("type") == cond_type:
            return dict(cond)
    return {}


def previous_reason(status: Mapping[str, Any], cond_type: str) -> str | None:
    cond = _condition(status, cond_type)
    return str(cond.get("reason")) if cond else None


def _selectors(policies: Mapping[str, Mapping[str, Any]]) -> dict[str, LabelSelector]:
    """Each policy's namespaceSelector; a policy whose selector cannot be read selects nothing
    (it is invalid, and says so on its own status)."""
    out = {}
    for name, raw in policies.items():
        try:
            out[name] = LabelSelector.model_validate(dict(raw.get("namespaceSelector") or {}))
        except (ValidationError, TypeError, ValueError):
            continue
    return out


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


@dataclass
class Tuned:
    """One tuning step's consequences for the Deployment and the status."""

    knobs: Knobs
    tuning: dict[str, Any]
    updates: list[ConditionUpdate]
    events: list[Event] = field(default_factory=list)
    observed: dict[str, Any] | None = None
    degraded: ConditionUpdate | None = None
    # The Deployments to run (stable, and a canary while one runs); None: one of `knobs`.
    topology: Topology | None = None
    slo_met: bool | None = None  # None: no usable window
    handled: tuple[str, ...] = ()  # one-shot requests acted on (core/commands.py)
    scaling: Scaling | None = None  # the replica count's motion (status.scaling)
    state: TuningState | None = None  # the tuner's state after this step (None: mode Off)
    # Tells the observer what to read next; called once the children are applied.
    observe: Callable[[], None] | None = None


@dataclass(frozen=True)
class ReplicaView:
    """The replica count of the moment (core/autoscaling.replicas_now) and its motion as
    status.scaling remembers it."""

    replicas: int
    scaling: Scaling | None


def _latest(*times: datetime | None) -> datetime | None:
    return max((t for t in times if t is not None), default=None)


def _state_from_status(raw: Mapping[str, Any]) -> TuningState | None:
    """The tuner's memory from status; a status from mode Off restarts it from the spec."""
    if not raw.get("applied") or not raw.get("lastGood"):
        return None
    try:
        return TuningState.from_dict(raw)
    except (KeyError, TypeError, ValueError):
        log.warning("status.tuning could not be read; starting the tuner afresh")
        return None


def _slo_met(snapshot: Snapshot, slo: SLO) -> bool | None:
    if not snapshot.available:
        return None
    verdicts = []
    for metric, target in slo.targets():
        value = snapshot.latency(metric).at(target.percentile)
        if value is not None:
            verdicts.append(value <= target.threshold_ms)
    return all(verdicts) if verdicts else None


def _tuned_fields(
    previous: Mapping[str, Any],
    commands: Commands,
    pending: Mapping[str, Any],
    tuned: Tuned,
    start: StartingPoint,
    topo: Topology,
    owner_kind: Owner,
) -> dict[str, Any]:
    """The status fields one tuning step sets: the pause, the requests handled, the tuner's
    state (with the time stamps of an unchanged decision and model check kept), the replica
    count's motion, the published capacity and the observed window."""
    fields: dict[str, Any] = {}
    if commands.paused or "paused" in previous:  # a null only clears a pause that was set
        fields["paused"] = True if commands.paused else None
    if tuned.handled:
        done = {name: pending[name] for name in tuned.handled}
        fields["handledRequests"] = {**(previous.get("handledRequests") or {}), **done}
    previous_tuning = dict(previous.get("tuning") or {})
    tuning = keep_stamp(tuned.tuning, previous_tuning, "lastDecision", "time")
    tuning = keep_stamp(tuning, previous_tuning, "model", "time")
    if start.notes:
        tuning["startNote"] = start.notes[-1]
    fields["tuning"] = tuning
    if tuned.scaling is not None:
        fields["scaling"] = scaling_to_status(tuned.scaling, owner_kind)
    capacity = published_capacity(tuned.state, topo) if tuned.state is not None else None
    fields["capacity"] = keep_stamp(
        {"_": None if capacity is None else capacity.to_status()},
        {"_": previous.get("capacity")},
        "_",
        "time",
    )["_"]
    if tuned.observed is not None:
        fields["observed"] = keep_stamp(
            {"_": tuned.observed}, {"_": previous.get("observed")}, "_", "time"
        )["_"]
    return fields


def _by_hand(
    state: TuningState, policy: TuningPolicy, now: datetime, commands: Commands
) -> tuple[Decision, str] | None:
    """The canary command asked for by hand (abort before promote) that applies now, in mode
    Auto, and its name; None: none does."""
    if policy.mode != "Auto":
        return None
    for command, wanted in (
        ("abort", commands.abort_requested),
        ("promote", commands.promote_requested),
    ):
        decision = canary_command(state, command, policy, now) if wanted else None
        if decision is not None:
            return decision, command
    return None


def _metrics_condition(
    snapshot: Snapshot, policy: TuningPolicy
) -> tuple[Snapshot, ConditionUpdate]:
    """The MetricsAvailable condition, and the window as the rest of status treats it:
    present but unusable data is reported, and otherwise treated, as no data."""
    invalid = defect(snapshot, policy.slo.targets())
    if invalid is not None:
        unusable = Snapshot.unavailable(snapshot.time, snapshot.window_s, invalid)
        return unusable, ConditionUpdate("MetricsAvailable", "False", "MetricsInvalid", invalid)
    if snapshot.available:
        return snapshot, ConditionUpdate(
            "MetricsAvailable", "True", "MetricsFresh", "Prometheus answers for this revision"
        )
    why = "WaitingForRevision" if snapshot.warming_up else "MetricsUnavailable"
    return snapshot, ConditionUpdate("MetricsAvailable", "False", why, snapshot.reason)


def _crash_looping(health: Sequence[PodHealth], knobs: Knobs) -> ConditionUpdate | None:
    """Degraded, when pods of the applied configuration are crash-looping."""
    looping = sorted(
        h.name
        for h in health
        if h.waiting_reason == "CrashLoopBackOff" and knobs.same_as(h.revision_knobs)
    )
    if not looping:
        return None
    return ConditionUpdate(
        "Degraded",
        "True",
        "CrashLoopBackOff",
        f"pods {', '.join(looping)} of the applied configuration "
        f"({render.knob_label(knobs)}) are crash-looping",
    )


def _slo_condition(snapshot: Snapshot, slo: SLO) -> ConditionUpdate:
    met = _slo_met(snapshot, slo)
    if met is None:
        why = snapshot.reason if not snapshot.available else "no latency data in the window"
        return ConditionUpdate("SLOMet", "Unknown", "NoData", why)
    parts = []
    for metric, target in slo.targets():
        value = snapshot.latency(metric).at(target.percentile)
        if value is not None:
            sign = "<=" if value <= target.threshold_ms else ">"
            parts.append(
                f"{metric.upper()} p{target.percentile:g} {value:.0f} ms "
                f"({sign} {target.threshold_ms:g} ms)"
            )
    return ConditionUpdate(
        "SLOMet",
        "True" if met else "False",
        "WithinSLO" if met else "SLOViolated",
        "; ".join(parts),
    )


def policy_status_patch(body: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The status a VLLMTuningPolicy should show (Valid + observedGeneration), as a patch."""
    previous = dict(body.get("status") or {})
    generation = (body.get("metadata") or {}).get("generation")
    try:
        VLLMTuningPolicySpec.model_validate(dict(body.get("spec") or {}))
        update = ConditionUpdate("Valid", "True", "Valid", "the policy can be used")
    except ValidationError as exc:
        update = ConditionUpdate("Valid", "False", "Invalid", _first_errors(exc))
    new = compute_status(previous, generation=generation, now=now, updates=[update], fields={})
    return status_patch(previous, clean_status(new))


def child_copy(body: Mapping[str, Any], *, keep_spec: bool = True) -> dict[str, Any]:
    """What is kept in memory of a child: all the controller reads, not the server's bookkeeping.

    managedFields is often as large as the object itself, and a pod's spec is never read (its
    health is in metadata and status), so dropping them is most of the per-deployment memory
    the indexes would hold at a thousand deployments (docs/scale.md).
    """
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    out = {k: v for k, v in body.items() if k != "metadata" and (keep_spec or k != "spec")}
    out["metadata"] = meta
    return out


@dataclass(frozen=True)
class PackedChild:
    """A child copy as compact JSON text, as the indexes keep it between reconciles.

    Decoded, a child is a tree of small dicts, lists, strings and floats: 47 KiB of Python
    objects per deployment for its VLLMDeployment, Deployment, Service, ReplicaSet and pod at
    a thousand deployments (tracemalloc in bench.scale), where the same objects as JSON text
    take ~12 KiB. A reconcile decodes the few it reads (~100 us), every reconcile interval.
    """

    text: str

    def unpack(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.text)
        return value


def packed_copy(body: Mapping[str, Any], *, keep_spec: bool = True) -> PackedChild:
    """child_copy(body), packed (see PackedChild)."""
    return PackedChild(json.dumps(child_copy(body, keep_spec=keep_spec), separators=(",", ":")))


def keep_stamp(
    new: Mapping[str, Any], old: Mapping[str, Any], key: str, stamp: str
) -> dict[str, Any]:
    """Keep `old[key][stamp]` when nothing else in `new[key]` changed.

    A decision or an observation repeated every cycle would otherwise rewrite status every
    cycle only to move a timestamp, waking Argo CD and every watcher for nothing.
    """
    result = dict(new)
    fresh, stale = new.get(key), old.get(key)
    if isinstance(fresh, Mapping) and isinstance(stale, Mapping) and stamp in stale:
        same = {k: v for k, v in fresh.items() if k != stamp} == {
            k: v for k, v in stale.items() if k != stamp
        }
        if same:
            result[key] = {**fresh, stamp: stale[stamp]}
    return result


def _resource_version(obj: Mapping[str, Any]) -> int:
    """resourceVersions are opaque strings, but an API server's are integers that only grow
    (the emulator's and etcd's); an unreadable one counts as oldest."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0
