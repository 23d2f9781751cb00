"""Living beside a replica autoscaler (HPA, KEDA, llm-d's variant autoscaler). Pure.

An autoscaler owns the replica count; the tuner owns the engine knobs. They meet in four places:

- **Whose count.** With `autoscaling.target: VLLMDeployment` the count is the VLLMDeployment's
  `spec.replicas`, which an autoscaler writes through the scale subresource; the operator splits
  it between the stable and canary Deployments. With `target: Deployment` an autoscaler scales
  the owned Deployment and the operator never sets its `spec.replicas`: the count of the moment
  is the live Deployment's (`replicas_now`), and whether the operator's field manager still
  owns the field after a switch is read from managedFields (`owns_replicas`).
- **Motion.** A change of the count, then *settled* once the ready pods match it (`Scaling`,
  kept in `status.scaling`, so a restarted operator remembers it).
- **The tuner's hold** (`scale_wait`): no verdict and no new rollout while the count moves, and
  no judgement of a window that began before it settled: per-pod load jumps at a scale event,
  and a window across one would read the jump as a knob effect. A rollout already under way
  keeps going (its progress counts pods against the count of the moment); a pod that crashes
  or is OOM-killed is rolled back at once, whatever the count does.
- **What one replica carries** (`published_capacity`): the calibrated capacity under the SLO
  for the applied knobs, which an autoscaler divides the load by (`status.capacity`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from vllm_autotuner.core.rollout import pod_failure
from vllm_autotuner.core.snapshot import Observation, Scaling, Snapshot
from vllm_autotuner.core.topology import Topology, canary_running
from vllm_autotuner.core.tuning_types import Action, Knobs, TuningPolicy, TuningState

Owner = Literal["VLLMDeployment", "Deployment"]
# Trial phases in which pods are being replaced: their progress is counted against the count
# of the moment, and holding them would only hold the pods back.
ROLLING_PHASES = ("RollingOut", "Promoting")


def replicas_now(owner: Owner, spec_replicas: int, live: Mapping[str, Any] | None) -> int:
    """The replica count asked for now: the VLLMDeployment's, or, when an autoscaler owns the
    Deployment's, the live Deployment's (its spec.replicas before it exists)."""
    if owner == "Deployment" and live:
        value = (live.get("spec") or {}).get("replicas")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return spec_replicas


def track(
    previous: Scaling | None, replicas: int, serving: int, expected: int, now: datetime
) -> Scaling:
    """The count's motion after this look: a new count is a change (`changed_at` now, not yet
    settled); a change settles once `serving` (ready pods not terminating) equals `expected`
    (the pods the topology calls for at this count). The first look is no change."""
    if previous is None:
        return Scaling(replicas)
    s = previous
    if replicas != previous.replicas:
        s = Scaling(replicas, previous.replicas, now, previous.settled_at)
    if s.moving and serving == expected:
        s = replace(s, settled_at=now)
    return s


def _window_start(snap: Snapshot | None) -> datetime | None:
    if snap is None or not snap.available:
        return None
    return snap.time - timedelta(seconds=snap.window_s)


def spans_change(obs: Observation, scaling: Scaling) -> bool:
    """A snapshot began before the last change settled (it saw the count move)."""
    edge = scaling.settled_at
    if edge is None or scaling.moving:
        return False
    starts = [t for t in (_window_start(obs.snapshot), _window_start(obs.canary)) if t]
    return any(start < edge for start in starts)


@dataclass(frozen=True)
class ScaleWait:
    state: TuningState
    action: Action
    reason: str


def scale_wait(
    state: TuningState, obs: Observation, policy: TuningPolicy, now: datetime
) -> ScaleWait | None:
    """The tuner's one hold for a moving replica count (None: decide as usual).

    A verification window that a change cut short is extended, so that the verdict still gets
    a full evaluation window after the count settled."""
    s = obs.scaling
    if s is None or s.changed_at is None or state.phase in ROLLING_PHASES:
        return None
    watched = state.candidate if state.candidate is not None else state.applied
    if pod_failure(obs.pods, watched) is not None:
        return None  # a failing candidate (or committed configuration) goes back, never held
    if s.moving:
        why = (
            f"the replica count moves from {s.previous} to {s.replicas} (since "
            f"{s.changed_at:%H:%M:%S}); "
        )
    elif spans_change(obs, s):
        why = (
            f"the window began before the replica count settled at {s.replicas} "
            f"({s.settled_at:%H:%M:%S}); "
        )
    else:
        return None
    if state.phase == "Verifying":
        base = now if s.moving or s.settled_at is None else s.settled_at
        until = base + timedelta(seconds=policy.evaluation_window_s)
        extended = max(state.verify_until or now, until)
        cand = "none" if state.candidate is None else state.candidate.describe()
        text = (
            f"{why}the verdict on {cand} waits for a window after it "
            f"(verification runs until {extended:%H:%M:%S})"
        )
        return ScaleWait(replace(state, verify_until=extended), "verify", text)
    text = f"{why}holding: a scale event is not a knob effect, and no rollout starts meanwhile"
    return ScaleWait(replace(state, phase="Holding"), "hold", text)


# --------------------------------------------------------------------------- capacity


@dataclass(frozen=True)
class Capacity:
    per_replica_rps: float
    knobs: Knobs
    source: Literal["Model", "Verified", "Trial"]
    time: datetime | None

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "perReplicaRps": round(self.per_replica_rps, 3),
            "knobs": self.knobs.to_dict(),
            "source": self.source,
        }
        if self.time is not None:
            out["time"] = self.time.strftime("%Y-%m-%dT%H:%M:%SZ")
        return out


def published_capacity(state: TuningState, topo: Topology) -> Capacity | None:
    """Requests/s one replica of the count (the autoscaler's) serves within the SLO with the
    pods that run now (`topo`: the Deployments the state calls for at that count).

    - No trial: the last good knobs' capacity: the model's prediction for them from the latest
      judged window, or, until one is judged, what they were committed with (so the number
      changes at once when a new configuration commits).
    - A canary: the count's pods weighted. The stable pods run the last good knobs. A canary
      pod that stands in for a stable one (no surge) counts at the lower of the candidate's
      capacity and the last good's; a surge canary pod is on top of the count and leaves with
      the trial, so it adds nothing: the number stays the last good knobs'.
    - A rolling trial or a promotion (the candidate replaces every pod, and can still be
      rolled back): the lower of the last good knobs' capacity and the candidate's.

    During a trial the number never exceeds the last good knobs' (when known): a candidate
    that fails later has never been promised.
    """
    good = _last_good_capacity(state)
    if canary_running(state):
        return _canary_capacity(state, topo, good)
    if state.applied.same_as(state.last_good):
        return good
    known = [c for c in (_value(good), _candidate_capacity(state)) if c is not None]
    if not known:
        return None
    return Capacity(min(known), state.applied, "Trial", state.rollout_started_at)


def _value(cap: Capacity | None) -> float | None:
    return None if cap is None else cap.per_replica_rps


def _last_good_capacity(state: TuningState) -> Capacity | None:
    good, check = state.last_good, state.model_check
    if check is not None and check.knobs.same_as(good) and check.predicted_capacity_rps > 0:
        return Capacity(check.predicted_capacity_rps, good, "Model", check.time)
    base = state.baseline.capacity_rps if state.baseline is not None else None
    ended = [t.ended_at for t in state.trials if t.ended_at and t.knobs.same_as(good)]
    when = max(ended) if ended else None
    if base is not None and base > 0:
        return Capacity(base, good, "Verified", when)
    # Committed without a capacity of its own (a canary promoted early because it fixed the
    # baseline's violation): the lower of the replaced knobs' (the model's last number) and
    # its own prediction, until its first window is judged.
    committed = any(t.outcome == "Committed" and t.knobs.same_as(good) for t in state.trials)
    if not committed or check is None:
        return None
    known = [c for c in (check.predicted_capacity_rps, _predicted(state, good)) if c and c > 0]
    return Capacity(min(known), good, "Verified", when) if known else None


def _canary_capacity(state: TuningState, topo: Topology, good: Capacity | None) -> Capacity | None:
    if good is None:
        return None
    base = good.per_replica_rps
    cand = _candidate_capacity(state)
    stand_in = topo.canary_replicas if topo.max_surge <= 0 else 0
    count = topo.stable_replicas + stand_in
    if count <= 0:
        return good
    per_canary = base if cand is None else min(base, cand)
    # (stable * base + stand_in * per_canary) / count, exact when no canary stands in
    value = base - stand_in * (base - per_canary) / count
    return Capacity(value, state.applied, "Trial", state.rollout_started_at)


def _candidate_capacity(state: TuningState) -> float | None:
    cand = state.candidate if state.candidate is not None else state.applied
    if state.analysis is not None and state.analysis.canary is not None:
        measured = state.analysis.canary.capacity_rps
        if measured is not None and measured > 0:
            return measured
    return _predicted(state, cand)


def _predicted(state: TuningState, knobs: Knobs) -> float | None:
    """The capacity the recommendation predicted for `knobs` (None: not recommended)."""
    rec = state.recommendation
    if rec is None or rec.predicted is None or not rec.knobs.same_as(knobs):
        return None
    return rec.predicted.capacity_rps if rec.predicted.capacity_rps > 0 else None


# --------------------------------------------------------------------------- ownership


def owns_replicas(managed_fields: Sequence[Mapping[str, Any]] | None, manager: str) -> bool:
    """Whether `manager` owns a Deployment's spec.replicas (by an Apply or an Update)."""
    for entry in managed_fields or ():
        if entry.get("manager") != manager or entry.get("subresource"):
            continue
        spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if "f:replicas" in spec:
            return True
    return False


# The field manager that holds spec.replicas for a moment when the operator lets go of it: an
# apply that leaves out a field its manager owned removes the field (the Deployment would fall
# back to one replica), unless another manager owns it too (Kubernetes "Server-Side Apply:
# transferring ownership"). An autoscaler's next write takes the field from this manager.
HANDOFF_MANAGER = "vllm-autotuner-handoff"


def replicas_manifest(name: str, namespace: str, replicas: int) -> dict[str, Any]:
    """The smallest apply that sets a Deployment's spec.replicas (and nothing else)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": replicas},
    }


def serving_pods(pods: Sequence[Mapping[str, Any]]) -> int:
    """Pods that serve: Ready and not terminating (a draining pod takes no new requests)."""
    n = 0
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        conditions = (pod.get("status") or {}).get("conditions") or ()
        if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            n += 1
    return n


def _time(raw: Any) -> datetime | None:
    if not raw:
        return None
    return datetime.fromisoformat(str(raw).replace("Z", "+00:00"))


def scaling_from_status(raw: Mapping[str, Any] | None) -> Scaling | None:
    """status.scaling as the tracker's memory (None when absent or unreadable)."""
    if not raw or not isinstance(raw.get("replicas"), int):
        return None
    try:
        return Scaling(
            replicas=int(raw["replicas"]),
            previous=raw.get("previousReplicas"),
            changed_at=_time(raw.get("changedAt")),
            settled_at=_time(raw.get("settledAt")),
        )
    except (TypeError, ValueError):
        return None


def scaling_to_status(scaling: Scaling, owner: Owner) -> dict[str, Any]:
    def stamp(t: datetime | None) -> str | None:
        # Microseconds: a change and the settling of the one before must never share a stamp.
        return None if t is None else t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    out = {
        "owner": owner,
        "replicas": scaling.replicas,
        "previousReplicas": scaling.previous,
        "changedAt": stamp(scaling.changed_at),
        "settledAt": stamp(scaling.settled_at),
    }
    return {k: v for k, v in out.items() if v is not None}
