"""Translate the API's objects into the tuner's own types, and back into status.

The tuner (decide and friends) reasons about frozen dataclasses that know nothing of pydantic
or Kubernetes manifests; this module is the one place that maps between the two, so a rename in
the CRD never reaches the tuning logic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, time
from typing import Any

from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_autotuner.api.durations import duration_seconds
from vllm_autotuner.api.policy import VLLMTuningPolicySpec
from vllm_autotuner.core.policy import Resolution, Target
from vllm_autotuner.core.render import CONTAINER_NAME, KNOBS_ANNOTATION
from vllm_autotuner.core.snapshot import Snapshot
from vllm_autotuner.core.tuning_types import (
    SLO,
    Bounds,
    DeploymentContext,
    KnobBounds,
    Knobs,
    MaintenanceWindow,
    PodHealth,
    RolloutRules,
    RolloutSettings,
    SLOTarget,
    TuningPolicy,
)

_WEEKDAYS = {"Mon": 0, "Tue": 1, "Wed": 2, "Thu": 3, "Fri": 4, "Sat": 5, "Sun": 6}


def _slo_target(target: Target | None) -> SLOTarget | None:
    if target is None:
        return None
    return SLOTarget(percentile=target.percentile, threshold_ms=target.threshold_ms)


def _clock(text: str) -> time:
    hours, minutes = text.split(":")
    return time(int(hours), int(minutes))


def tuning_policy(resolution: Resolution, policy: VLLMTuningPolicySpec) -> TuningPolicy:
    """The effective policy: the resolved (tightened) SLO, the policy's bounds and rules."""
    assert resolution.ok and resolution.slo is not None
    b = policy.bounds
    r = policy.rollout
    windows = tuple(
        MaintenanceWindow(
            days=frozenset(_WEEKDAYS[d] for d in w.days) if w.days else frozenset(range(7)),
            start=_clock(w.start),
            end=_clock(w.end),
            tz=w.timezone,
        )
        for w in r.maintenance_windows
    )
    return TuningPolicy(
        slo=SLO(
            ttft=_slo_target(resolution.slo.ttft),
            itl=_slo_target(resolution.slo.itl),
            e2e=_slo_target(resolution.slo.e2e),
        ),
        bounds=Bounds(
            mnbt=KnobBounds(
                b.max_num_batched_tokens.min,
                b.max_num_batched_tokens.max,
                b.max_num_batched_tokens.max_step,
            ),
            mns=KnobBounds(b.max_num_seqs.min, b.max_num_seqs.max, b.max_num_seqs.max_step),
            gmu=KnobBounds(
                b.gpu_memory_utilization.min,
                b.gpu_memory_utilization.max,
                b.gpu_memory_utilization.max_step,
            ),
        ),
        rollout=RolloutRules(
            min_interval_s=duration_seconds(r.min_interval),
            max_per_day=r.max_per_day,
            maintenance_windows=windows,
            verify_window_s=duration_seconds(r.verify_window),
            ready_timeout_s=duration_seconds(r.ready_timeout),
            headroom_timeout_s=duration_seconds(r.headroom_timeout),
        ),
        min_requests_per_window=policy.min_requests_per_window,
        evaluation_window_s=duration_seconds(policy.evaluation_window),
        mode=resolution.mode,
    )


def pods_of(value: int | str, replicas: int) -> int:
    """An int-or-percent rollout limit in pods (a surge percentage rounds up, as Kubernetes
    rounds maxSurge)."""
    if isinstance(value, int):
        return value
    return math.ceil(replicas * int(value.rstrip("%")) / 100.0)


def rollout_settings(
    spec: VLLMDeploymentSpec, load_time_s: float | None = None, replicas: int | None = None
) -> RolloutSettings:
    """`replicas`: the count of the moment (an autoscaler's), spec.replicas by default. When
    an autoscaler owns the Deployment's count, a canary is one pod beyond it, so it needs
    surge; without surge trials are rolling."""
    r = spec.rollout
    defaults = RolloutSettings()
    surge = pods_of(r.max_surge, spec.replicas if replicas is None else replicas)
    return RolloutSettings(
        max_surge=surge,
        canary=r.canary and (spec.autoscaling.target != "Deployment" or surge > 0),
        shutdown_timeout_s=float(r.shutdown_timeout_seconds),
        pre_stop_s=float(r.pre_stop_seconds),
        load_time_s=defaults.load_time_s if load_time_s is None else load_time_s,
    )


def deployment_context(
    spec: VLLMDeploymentSpec, load_time_s: float | None = None, replicas: int | None = None
) -> DeploymentContext:
    """`replicas`: the replica count of the moment (core/autoscaling.replicas_now)."""
    n = spec.replicas if replicas is None else replicas
    return DeploymentContext(
        model=spec.model,
        gpu_product=spec.gpu.product,
        gpu_memory_gib=spec.gpu.memory_gib,
        tensor_parallel_size=spec.engine.tensor_parallel_size,
        max_model_len=spec.engine.max_model_len,
        kv_cache_dtype=spec.engine.kv_cache_dtype,
        enable_prefix_caching=spec.engine.enable_prefix_caching is not False,
        replicas=n,
        rollout=rollout_settings(spec, load_time_s, n),
        autoscaled=spec.autoscaling.target is not None,
    )


def parse_knob_label(label: str | None) -> Knobs | None:
    """The inverse of render.knob_label: "mnbt=4096,mns=128,gmu=0.9" → Knobs."""
    if not label:
        return None
    try:
        parts = dict(item.split("=", 1) for item in label.split(","))
        return Knobs(
            max_num_batched_tokens=int(parts["mnbt"]),
            max_num_seqs=int(parts["mns"]),
            gpu_memory_utilization=float(parts["gmu"]),
        )
    except (KeyError, ValueError):
        return None


def _condition(pod: Mapping[str, Any], cond_type: str) -> Mapping[str, Any] | None:
    for cond in (pod.get("status") or {}).get("conditions") or ():
        if cond.get("type") == cond_type:
            return dict(cond)
    return None


def pod_health(pod: Mapping[str, Any]) -> PodHealth:
    """What decide() needs to know about one pod: ready, restarting, why it last died."""
    status = pod.get("status") or {}
    statuses = [
        s for s in status.get("containerStatuses") or () if s.get("name") == CONTAINER_NAME
    ] or list(status.get("containerStatuses") or ())
    container = statuses[0] if statuses else {}
    ready_cond = _condition(pod, "Ready")
    waiting = ((container.get("state") or {}).get("waiting") or {}).get("reason")
    terminated = (container.get("lastState") or {}).get("terminated") or {}
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return PodHealth(
        ready=ready_cond is not None and ready_cond.get("status") == "True",
        restarts=int(container.get("restartCount") or 0),
        waiting_reason=waiting,
        last_termination_reason=terminated.get("reason"),
        revision_knobs=parse_knob_label(annotations.get(KNOBS_ANNOTATION)),
        name=str((pod.get("metadata") or {}).get("name", "")),
    )


def deployment_knobs(deployment: Mapping[str, Any] | None) -> Knobs | None:
    """The knobs a live Deployment runs, when its pod template is one we rendered: the knob
    annotation and the container's args agree (a hand edit of the args breaks the match)."""
    if not deployment:
        return None
    template = (deployment.get("spec") or {}).get("template") or {}
    labelled = parse_knob_label(
        ((template.get("metadata") or {}).get("annotations") or {}).get(KNOBS_ANNOTATION)
    )
    if labelled is None:
        return None
    containers = (template.get("spec") or {}).get("containers") or ()
    args = next(
        (list(c.get("args") or ()) for c in containers if c.get("name") == CONTAINER_NAME), []
    )
    flags = dict(itertools.pairwise(args))
    wanted = {
        "--max-num-batched-tokens": labelled.max_num_batched_tokens,
        "--max-num-seqs": labelled.max_num_seqs,
        "--gpu-memory-utilization": labelled.gpu_memory_utilization,
    }
    try:
        same = all(float(flags[flag]) == float(value) for flag, value in wanted.items())
    except (KeyError, ValueError):
        return None
    return labelled if same else None


def ready_since(pods: Sequence[Mapping[str, Any]], knobs: Knobs) -> datetime | None:
    """When the last ready pod running `knobs` became ready (the snapshot window starts there)."""
    latest: datetime | None = None
    for pod in pods:
        health = pod_health(pod)
        if not health.ready or not knobs.same_as(health.revision_knobs):
            continue
        cond = _condition(pod, "Ready") or {}
        raw = cond.get("lastTransitionTime")
        if not raw:
            continue
        when = datetime.fromisoformat(str(raw).replace("Z", "+00:00"))
        latest = when if latest is None or when > latest else latest
    return latest


def observed_load_time(pods: Sequence[Mapping[str, Any]]) -> float | None:
    """How long the deployment's pods took from start to ready (the longest seen now): what
    a restart costs in serving time. None when no ready pod says."""
    longest: float | None = None
    for pod in pods:
        start = (pod.get("status") or {}).get("startTime")
        cond = _condition(pod, "Ready") or {}
        if not start or cond.get("status") != "True" or not cond.get("lastTransitionTime"):
            continue
        try:
            began = datetime.fromisoformat(str(start).replace("Z", "+00:00"))
            ready = datetime.fromisoformat(str(cond["lastTransitionTime"]).replace("Z", "+00:00"))
        except ValueError:
            continue
        took = (ready - began).total_seconds()
        if took > 0 and (longest is None or took > longest):
            longest = took
    return longest


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def observed_summary(snapshot: Snapshot, slo: SLO, slo_met: bool | None) -> dict[str, Any]:
    """status.observed: the latest snapshot in a few numbers (printer columns read the P95s)."""
    summary: dict[str, Any] = {
        "time": snapshot.time.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "windowSeconds": round(snapshot.window_s, 1),
        "requestRate": _round(snapshot.request_rate),
        "ttftP95Ms": _round(snapshot.ttft.p95_ms, 1),
        "itlP95Ms": _round(snapshot.itl.p95_ms, 1),
        "e2eP95Ms": _round(snapshot.e2e.p95_ms, 1),
        "ttftPercentileMs": _round(snapshot.ttft.at(slo.ttft.percentile), 1) if slo.ttft else None,
        "itlPercentileMs": _round(snapshot.itl.at(slo.itl.percentile), 1) if slo.itl else None,
        "kvCacheUsage": _round(snapshot.kv_usage_mean),
        "preemptionRate": _round(snapshot.preemption_rate),
        "running": _round(snapshot.running_mean, 2),
        "waiting": _round(snapshot.waiting_mean, 2),
        "sloMet": slo_met,
        "knobs": None if snapshot.knobs is None else snapshot.knobs.to_dict(),
    }
    return {k: v for k, v in summary.items() if v is not None}


def strip_none(value: Any) -> Any:
    """Status as the API server stores it: a null in a merge patch deletes, so never send one."""
    if isinstance(value, dict):
        return {k: strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_none(v) for v in value]
    return value
