"""`vllm-autotuner recommend`: the tuner's advice for any vLLM fleet, no operator needed.

It reads the same Prometheus metrics the operator reads, runs the same diagnosis, model and
search in Recommend mode, and prints what it would change and why. Pods are found in
Prometheus itself, so it works on fleets that were not deployed by the operator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import yaml

from vllm_autotuner.adapters.prometheus import PrometheusError, PrometheusSource
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
    current: Knobs | None = None
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


def _policy_spec(req: RecommendRequest) -> VLLMTuningPolicySpec:
    if req.policy_file is not None:
        raw = yaml.safe_load(req.policy_file.read_text())
        spec = raw.get("spec", raw) if isinstance(raw, dict) else {}
        return VLLMTuningPolicySpec.model_validate(spec)
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


def recommend(req: RecommendRequest, now: datetime | None = None) -> list[Advice]:
    when = now or datetime.now(tz=UTC)
    policy_spec = _policy_spec(req)
    source = PrometheusSource(
        req.prometheus_url,
        timeout_s=req.timeout_s,
        bearer_token_file=req.bearer_token_file,
        ca_file=req.ca_file,
        rate_scale=req.rate_scale,
        min_window_s=min(60.0, req.window_s),  # the user chose the window; trust it
    )
    window = req.window_s
    targets = source.discover_targets_sync(
        req.namespace, req.pod_regex, req.labels, window_s=window, now=when
    )
    advice: list[Advice] = []
    for target in targets:
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
        current = req.current or default_knobs(req.gpu)
        scoped = replace(
            target,
            knobs=current,
            window_s=policy.evaluation_window_s,
            slo=(policy.slo.ttft, policy.slo.itl, policy.slo.e2e),
        )
        snapshot = source.snapshots_sync([scoped], when)[scoped.key]
        ctx = deployment_context(spec)
        decision = decide(
            TuningState.initial(current),
            Observation(snapshot),
            policy,
            ctx,
            when,
            AnalyticModel(req.gpu),
        )
        advice.append(Advice(target.namespace, model, target.pods, snapshot, decision, current))
    return advice


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
        out.write(f"   recommended: {' '.join(knob_args(rec.knobs))}\n")
        p = rec.predicted
        out.write(
            f"   predicted:   capacity {p.capacity_rps:.2f} req/s per pod ({rec.gain_pct:+.0f}%), "
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
        "recommendation": None if rec is None else rec.to_dict(),
        "flags": None if rec is None else knob_args(rec.knobs),
    }


__all__ = ["Advice", "PrometheusError", "RecommendRequest", "print_advice", "recommend"]
