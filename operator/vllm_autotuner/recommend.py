"""`vllm-autotuner recommend`: the tuner's advice for any vLLM fleet, no operator needed.

It reads the same Prometheus metrics the operator reads, runs the same diagnosis, model and
search in Recommend mode, and prints what it would change and why. Pods are found in
Prometheus itself, so it works on fleets that were not deployed by the operator.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import yaml
from pydantic import ValidationError

from vllm_autotuner.adapters.prometheus import PrometheusError, PrometheusSource, SnapshotTarget
from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_autotuner.api.policy import VLLMTuningPolicySpec
from vllm_autotuner.core.decide import Decision, decide
from vllm_autotuner.core.knob_defaults import default_knobs
from vllm_autotuner.core.perf_model import AnalyticModel
from vllm_autotuner.core.policy import resolve
from vllm_autotuner.core.render import knob_args
from vllm_autotuner.core.snapshot import Observation, Snapshot
from vllm_autotuner.core.tuning_inputs import deployment_context, tuning_policy
from vllm_autotuner.core.tuning_types import Knobs, TuningState


@dataclass(frozen=True)
class RecommendRequest:
    prometheus_url: str
    ttft_ms: float
    itl_ms: float
    ttft_percentile: float = 95.0
    itl_percentile: float = 95.0
    e2e_ms: float | None = None
    namespace: str | None = None
    pod_regex: str | None = None
    labels: dict[str, str] | None = None
    gpu: str | None = None
    model: str | None = None
    tensor_parallel_size: int = 1
    # The fleet's values as the user gave them; the others are vLLM's defaults on this GPU.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    window_s: float = 300.0
    min_requests: int = 100
    policy_file: Path | None = None
    timeout_s: float = 10.0
    bearer_token_file: str | None = None
    ca_file: str | None = None
    rate_scale: float = 1.0


@dataclass(frozen=True)
class Advice:
    namespace: str
    model: str
    pods: tuple[str, ...]
    snapshot: Snapshot
    decision: Decision
    current: Knobs
    guessed: tuple[str, ...] = ()  # flags of `current` taken from vLLM's per-GPU defaults
    since: datetime | None = None  # the window starts here: pods of an earlier revision left


# A pod of a Deployment is named <deployment>-<pod-template-hash>-<5 characters>: the hash is
# its ReplicaSet, i.e. its revision (kube-controller-manager's naming).
_REPLICASET_POD = re.compile(r"^(?P<revision>.+-[a-z0-9]{6,10})-[a-z0-9]{5}$")
# Pods seen this recently still serve: two scrapes at the 15-30 s intervals monitors use.
ALIVE_WINDOW_S = 60.0


class PolicyFileError(ValueError):
    """--policy names a file that cannot be used; the message is one line."""


def _policy_spec(req: RecommendRequest) -> VLLMTuningPolicySpec:
    if req.policy_file is not None:
        return load_policy_file(req.policy_file)
    slo: dict[str, Any] = {
        "ttft": {"percentile": req.ttft_percentile, "thresholdMs": req.ttft_ms},
        "itl": {"percentile": req.itl_percentile, "thresholdMs": req.itl_ms},
    }
    if req.e2e_ms is not None:
        slo["e2e"] = {"percentile": 95, "thresholdMs": req.e2e_ms}
    return VLLMTuningPolicySpec.model_validate(
        {
            "slo": slo,
            "minRequestsPerWindow": req.min_requests,
            "evaluationWindow": f"{int(req.window_s)}s",
            "rollout": {"verifyWindow": f"{int(req.window_s)}s"},
        }
    )


def load_policy_file(path: Path) -> VLLMTuningPolicySpec:
    """A VLLMTuningPolicy (or its spec) from YAML; every failure is one line naming the file."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PolicyFileError(f"--policy {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        raise PolicyFileError(f"--policy {path}: not YAML{at}") from None
    if not isinstance(raw, dict):
        raise PolicyFileError(f"--policy {path}: not a VLLMTuningPolicy (a mapping is expected)")
    kind = raw.get("kind")
    if kind not in (None, "VLLMTuningPolicy"):
        raise PolicyFileError(f"--policy {path}: kind is {kind!r}, not VLLMTuningPolicy")
    try:
        return VLLMTuningPolicySpec.model_validate(raw.get("spec", raw))
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise PolicyFileError(
            f"--policy {path}: invalid VLLMTuningPolicy: {loc}: {first.get('msg')}{more}"
        ) from None


def current_knobs(req: RecommendRequest) -> tuple[Knobs, tuple[str, ...]]:
    """The fleet's knobs: those the user gave, the rest vLLM's defaults on this GPU (guessed)."""
    base = default_knobs(req.gpu)
    given = {
        "--max-num-batched-tokens": req.max_num_batched_tokens,
        "--max-num-seqs": req.max_num_seqs,
        "--gpu-memory-utilization": req.gpu_memory_utilization,
    }
    knobs = Knobs(
        req.max_num_batched_tokens or base.max_num_batched_tokens,
        req.max_num_seqs or base.max_num_seqs,
        req.gpu_memory_utilization or base.gpu_memory_utilization,
    )
    return knobs, tuple(flag for flag, value in given.items() if value is None)


def revision_of(pod: str) -> str:
    """The pod's ReplicaSet (its revision) when it is a Deployment's pod, else ""."""
    match = _REPLICASET_POD.match(pod)
    return match["revision"] if match else ""


def one_revision(
    target: SnapshotTarget, alive: set[str]
) -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
    """(pods to judge, pods of an earlier revision that left, or why none can be judged).

    A window never mixes revisions: with pods of two revisions serving, a rollout is under way
    and nothing is judged; pods of another revision that have left are excluded, and the
    caller starts the window after the last of them was seen.
    """
    serving = sorted(p for p in target.pods if p in alive)
    if not serving:
        return (), (), f"no pod exported metrics in the last {ALIVE_WINDOW_S:.0f} s"
    revisions = Counter(revision_of(p) for p in serving)
    if len(revisions) > 1:
        shown = ", ".join(f"{rev or 'unnamed'} ({n} pods)" for rev, n in sorted(revisions.items()))
        why = f"a rollout is under way (pods of {len(revisions)} revisions serve: {shown}); "
        return (), (), why + "run again when it has finished"
    (current,) = revisions
    gone = tuple(p for p in target.pods if p not in alive and revision_of(p) != current)
    return tuple(serving), gone, None


def recommend(req: RecommendRequest, now: datetime | None = None) -> list[Advice]:
    when = now or datetime.now(tz=UTC)
    policy_spec = _policy_spec(req)
    current, guessed = current_knobs(req)
    source = PrometheusSource(
        req.prometheus_url,
        timeout_s=req.timeout_s,
        bearer_token_file=req.bearer_token_file,
        ca_file=req.ca_file,
        rate_scale=req.rate_scale,
        min_window_s=min(60.0, req.window_s),  # the user chose the window; trust it
    )
    window = req.window_s
    scope = (req.namespace, req.pod_regex, req.labels)
    targets = source.discover_targets_sync(*scope, window_s=window, now=when)
    recent = source.discover_targets_sync(*scope, window_s=min(window, ALIVE_WINDOW_S), now=when)
    alive = {pod for t in recent for pod in t.pods}
    return [
        _advise(req, source, policy_spec, target, alive, (current, guessed), when)
        for target in targets
    ]


def _advise(
    req: RecommendRequest,
    source: PrometheusSource,
    policy_spec: VLLMTuningPolicySpec,
    target: SnapshotTarget,
    alive: set[str],
    knobs: tuple[Knobs, tuple[str, ...]],
    when: datetime,
) -> Advice:
    """One target's advice, from the pods of its one serving revision."""
    current, guessed = knobs
    model = req.model or target.model_name or "unknown"
    spec = VLLMDeploymentSpec.model_validate(
        {
            "model": model,
            "gpu": {"product": req.gpu, "count": req.tensor_parallel_size},
            "engine": {"tensorParallelSize": req.tensor_parallel_size},
            "tuning": {"mode": "Recommend"},
        }
    )
    resolution = resolve(spec, "cli", policy_spec, target.namespace, {})
    if not resolution.ok:
        raise ValueError(resolution.message)
    policy = tuning_policy(resolution, policy_spec)
    pods, gone, refused = one_revision(target, alive)
    since = source.last_seen_sync(target.namespace, gone, req.window_s, when) if gone else None
    if refused is not None:
        snapshot = Snapshot.unavailable(when, policy.evaluation_window_s, refused)
    else:
        scoped = replace(
            target,
            pods=pods,
            since=since,
            knobs=current,
            window_s=policy.evaluation_window_s,
            slo=(policy.slo.ttft, policy.slo.itl, policy.slo.e2e),
        )
        snapshot = source.snapshots_sync([scoped], when)[scoped.key]
    decision = decide(
        TuningState.initial(current),
        Observation(snapshot),
        policy,
        deployment_context(spec),
        when,
        AnalyticModel(req.gpu),
    )
    shown = pods or target.pods
    return Advice(target.namespace, model, shown, snapshot, decision, current, guessed, since)


def _fmt(value: float | None, unit: str = " ms") -> str:
    return "n/a" if value is None else f"{value:.1f}{unit}"


def print_advice(advice: list[Advice], out: TextIO, as_json: bool = False) -> None:
    if as_json:
        out.write(json.dumps([advice_dict(a) for a in advice], indent=2) + "\n")
        return
    if not advice:
        out.write("No vLLM pods found in Prometheus for that scope.\n")
        return
    for a in advice:
        s = a.snapshot
        out.write(f"== {a.namespace} / {a.model} ({len(a.pods)} pods)\n")
        if not s.available:
            out.write(f"   no usable metrics: {s.reason}\n\n")
            continue
        out.write(
            f"   observed: {s.request_rate:.2f} req/s, TTFT p95 {_fmt(s.ttft.p95_ms)}, "
            f"ITL p95 {_fmt(s.itl.p95_ms)}, KV usage "
            f"{_fmt(None if s.kv_usage_mean is None else 100 * s.kv_usage_mean, '%')}, "
            f"preemptions {s.preemption_rate:.2f}/s\n"
        )
        d = a.decision
        if d.diagnosis is not None:
            out.write(f"   diagnosis: {d.diagnosis.kind}: {d.diagnosis.evidence}\n")
        rec = d.new_state.recommendation
        if rec is None:
            out.write(f"   no change recommended: {d.reason}\n\n")
            continue
        out.write(f"   current:     {' '.join(knob_args(a.current))}\n")
        if a.guessed:
            out.write(
                f"                ({', '.join(a.guessed)}: a guess, vLLM's defaults on this GPU; "
                "give the fleet's values with those flags)\n"
            )
        out.write(f"   recommended: {' '.join(knob_args(rec.knobs))}\n")
        p = rec.predicted
        gain = "no gain: the current knobs are a guess" if a.guessed else f"{rec.gain_pct:+.0f}%"
        out.write(
            f"   predicted:   capacity {p.capacity_rps:.2f} req/s per pod ({gain}), "
            f"TTFT {_fmt(p.ttft_ms)}, ITL {_fmt(p.itl_ms)}\n\n"
        )


def advice_dict(a: Advice) -> dict[str, Any]:
    rec = a.decision.new_state.recommendation
    return {
        "namespace": a.namespace,
        "model": a.model,
        "pods": list(a.pods),
        "metricsAvailable": a.snapshot.available,
        "reason": a.decision.reason,
        "diagnosis": None if a.decision.diagnosis is None else a.decision.diagnosis.kind,
        "current": a.current.to_dict(),
        "currentGuessed": list(a.guessed),
        "windowSince": None if a.since is None else a.since.isoformat(),
        "recommendation": None if rec is None else _recommendation(rec.to_dict(), a.guessed),
        "flags": None if rec is None else knob_args(rec.knobs),
    }


def _recommendation(rec: dict[str, Any], guessed: tuple[str, ...]) -> dict[str, Any]:
    """No gain against a baseline that is a guess."""
    return {**rec, "gainPct": None} if guessed else rec


__all__ = ["Advice", "PrometheusError", "RecommendRequest", "print_advice", "recommend"]
