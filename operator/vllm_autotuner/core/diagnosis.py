"""Name the bottleneck in a snapshot, with the numbers that show it.

The diagnosis does two jobs: it tells a person *why* the tuner wants to move (the evidence
string ends up in Events and status), and it tells the search which way each knob may move, so
a candidate never "fixes" a decode-latency problem by growing the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_autotuner.core.snapshot import Snapshot, target_value
from vllm_autotuner.core.tuning_types import SLO, Knobs

DiagnosisKind = Literal[
    "kv_bound", "decode_latency_bound", "prefill_bound", "concurrency_bound", "idle", "healthy"
]

# Thresholds, chosen from vLLM's behaviour: at ~90% KV usage admission starts to stall behind
# full-sequence reservations (vLLM scheduler.py, scheduler_reserve_full_isl), and preemptions mean
# the cache is already too small for the running set.
KV_NEAR_FULL = 0.9
RUNNING_AT_CAP = 0.95
QUEUE_MEAN = 0.5
ITL_HEADROOM = 0.8


@dataclass(frozen=True)
class Directions:
    """Allowed direction per knob: -1 lower only, +1 raise only, 0 either (no opinion)."""

    mnbt: int = 0
    mns: int = 0
    gmu: int = 0


@dataclass(frozen=True)
class Diagnosis:
    kind: DiagnosisKind
    evidence: str
    directions: Directions = Directions()
    # Metrics over their SLO threshold: (metric, measured ms, threshold ms).
    violations: tuple[tuple[str, float, float], ...] = ()

    @property
    def violates_slo(self) -> bool:
        return bool(self.violations)


def slo_violations(snapshot: Snapshot, slo: SLO) -> tuple[tuple[str, float, float], ...]:
    """The SLO targets the window confirms violated: percentile over the threshold, and the
    histogram's buckets around the threshold cannot put the attainment at the target.

    A percentile interpolated inside a wide bucket (vLLM's ITL buckets jump from 25 to 50 ms)
    can read 43 ms where the true value is 33: without the check, that phantom violation
    would be chased. With no bucket counts (older adapters) the percentile decides.
    """
    out: list[tuple[str, float, float]] = []
    for metric, target in slo.targets():
        v = target_value(snapshot, metric, target)
        if v is None or v <= target.threshold_ms:
            continue
        bounds = snapshot.latency(metric).fraction_bounds(target.threshold_ms)
        if bounds is not None and bounds[1] >= target.percentile / 100.0:
            continue  # the buckets allow the target to be met: not confirmed
        out.append((metric, v, target.threshold_ms))
    return tuple(out)


def _fmt_violation(v: tuple[str, float, float], slo: SLO) -> str:
    metric, value, thr = v
    target = getattr(slo, metric)
    return f"{metric.upper()} p{target.percentile:g} {value:.0f} ms > {thr:.0f} ms"


def diagnose(snapshot: Snapshot, slo: SLO, knobs: Knobs, min_requests: int = 1) -> Diagnosis:
    """Classify the window; the first matching bottleneck wins, in order of how much it hurts."""
    if snapshot.completed_requests < min_requests or snapshot.request_rate <= 0:
        return Diagnosis(
            "idle",
            f"too little traffic: {snapshot.completed_requests} requests in "
            f"{snapshot.window_s:.0f} s ({snapshot.request_rate:.2f} req/s)",
        )
    violations = slo_violations(snapshot, slo)
    vtext = "; ".join(_fmt_violation(v, slo) for v in violations)
    kv_max = snapshot.kv_usage_max
    pods = max(1, snapshot.num_pods)
    preempt = snapshot.preemption_rate / pods
    if kv_max is not None and kv_max >= KV_NEAR_FULL and preempt > 0:
        return Diagnosis(
            "kv_bound",
            f"KV cache {kv_max:.0%} full at peak with {preempt:.2f} preemptions/s per pod"
            + (f"; {vtext}" if vtext else ""),
            Directions(mnbt=0, mns=-1, gmu=+1),
            violations,
        )
    itl_viol = next((v for v in violations if v[0] == "itl"), None)
    if itl_viol is not None:
        return Diagnosis(
            "decode_latency_bound",
            f"{_fmt_violation(itl_viol, slo)}: steps too long at "
            f"{knobs.max_num_batched_tokens} batched tokens"
            + (
                f", {snapshot.running_mean:.0f} running on average"
                if snapshot.running_mean is not None
                else ""
            ),
            Directions(mnbt=-1, mns=-1, gmu=0),
            violations,
        )
    running_max = snapshot.running_max
    waiting = snapshot.waiting_mean
    kv_room = kv_max is None or kv_max < KV_NEAR_FULL
    if (
        running_max is not None
        and waiting is not None
        and running_max >= RUNNING_AT_CAP * knobs.max_num_seqs
        and waiting >= QUEUE_MEAN
        and kv_room
    ):
        kv_text = "unknown" if kv_max is None else f"{kv_max:.0%}"
        return Diagnosis(
            "concurrency_bound",
            f"{running_max:.0f} running at maxNumSeqs={knobs.max_num_seqs} with "
            f"{waiting:.1f} waiting on average; KV peak {kv_text}"
            + (f"; {vtext}" if vtext else ""),
            Directions(mnbt=0, mns=+1, gmu=0),
            violations,
        )
    ttft_viol = next((v for v in violations if v[0] == "ttft"), None)
    if ttft_viol is not None:
        itl_target = slo.itl
        itl_value = None if itl_target is None else target_value(snapshot, "itl", itl_target)
        headroom = (
            itl_target is None
            or itl_value is None
            or itl_value <= ITL_HEADROOM * itl_target.threshold_ms
        )
        if headroom:
            itl_text = (
                "no ITL SLO"
                if itl_target is None or itl_value is None
                else f"ITL {itl_value:.0f} ms of {itl_target.threshold_ms:.0f} ms"
            )
            return Diagnosis(
                "prefill_bound",
                f"{_fmt_violation(ttft_viol, slo)} with ITL headroom ({itl_text}): prefill "
                f"chunks of {knobs.max_num_batched_tokens} tokens too small",
                Directions(mnbt=+1, mns=0, gmu=0),
                violations,
            )
    if violations:
        return Diagnosis(
            "healthy", f"SLO missed without a clear bottleneck: {vtext}", violations=violations
        )
    return Diagnosis(
        "healthy",
        f"SLO met at {snapshot.request_rate:.2f} req/s"
        + (f", KV peak {kv_max:.0%}" if kv_max is not None else ""),
    )
