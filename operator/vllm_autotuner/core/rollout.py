"""The rules that make a rollout safe: when one may start, how it is watched, how it is judged.

Phases of one trial: Observing → Candidate → RollingOut (new pods coming up) → Verifying
(pods ready; metrics collected for verifyWindow) → Committed or RolledBack. These helpers are
pure functions of the state, the pods and the clock; decide() strings them together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from vllm_autotuner.core.diagnosis import slo_violations
from vllm_autotuner.core.perf_model import Prediction
from vllm_autotuner.core.snapshot import Snapshot, target_value
from vllm_autotuner.core.tuning_types import (
    SLO,
    TRIAL_PHASES,
    InfeasibleKind,
    Knobs,
    Measured,
    PodHealth,
    RolloutRules,
    Trial,
    TrialOutcome,
    TuningPolicy,
    TuningState,
)

CRASH_WAITING_REASONS = frozenset({"CrashLoopBackOff", "RunContainerError", "CreateContainerError"})
OOM_REASONS = frozenset({"OOMKilled"})
# A candidate may be this much worse than the baseline (relative to the SLO threshold) before
# a violation is blamed on it: percentiles from histograms are noisy.
REGRESSION_TOLERANCE = 0.05


def utc_day(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%d")


def roll_day(state: TuningState, now: datetime) -> TuningState:
    """Reset the daily budget when the UTC day changed."""
    today = utc_day(now)
    if state.rollout_day != today:
        return replace(state, rollout_day=today, rollouts_today=0)
    return state


def rollout_blocker(state: TuningState, rules: RolloutRules, now: datetime) -> str | None:
    """Why a rollout may not start now (None when it may). `state` must be day-rolled."""
    if state.last_rollout_at is not None:
        ready_at = state.last_rollout_at + timedelta(seconds=rules.min_interval_s)
        if now < ready_at:
            left = (ready_at - now).total_seconds()
            return (
                f"cooldown: last rollout {(now - state.last_rollout_at).total_seconds() / 60:.0f}"
                f" min ago, minInterval {rules.min_interval_s / 60:.0f} min "
                f"({left / 60:.0f} min left)"
            )
    if state.rollouts_today >= rules.max_per_day:
        return f"daily budget spent: {state.rollouts_today} of {rules.max_per_day} rollouts today"
    if rules.maintenance_windows and not any(w.contains(now) for w in rules.maintenance_windows):
        return (
            f"outside the {len(rules.maintenance_windows)} maintenance window(s) "
            f"at {now.strftime('%a %H:%M')} UTC"
        )
    return None


@dataclass(frozen=True)
class PodFailure:
    outcome: TrialOutcome
    kind: InfeasibleKind
    reason: str


def pod_failure(pods: Sequence[PodHealth], knobs: Knobs) -> PodFailure | None:
    """A crash or OOM of a pod running `knobs` (or of unknown knobs: assume the new ones)."""
    for p in pods:
        if p.revision_knobs is not None and not p.revision_knobs.same_as(knobs):
            continue
        who = p.name or "a pod"
        if p.last_termination_reason in OOM_REASONS or p.waiting_reason in OOM_REASONS:
            return PodFailure(
                "OOMKilled",
                "OOMKilled",
                f"{who} was OOMKilled ({p.restarts} restarts) with {knobs.describe()}",
            )
        if p.waiting_reason in CRASH_WAITING_REASONS:
            last = f", last exit {p.last_termination_reason}" if p.last_termination_reason else ""
            return PodFailure(
                "Crashed",
                "Crashed",
                f"{who} is in {p.waiting_reason} ({p.restarts} restarts{last}) "
                f"with {knobs.describe()}",
            )
    return None


def rollout_progress(pods: Sequence[PodHealth], knobs: Knobs, replicas: int) -> tuple[int, bool]:
    """(ready pods on the new knobs, whether the rollout is complete)."""
    ready_new = sum(
        1 for p in pods if p.ready and (p.revision_knobs is None or p.revision_knobs.same_as(knobs))
    )
    old = sum(
        1 for p in pods if p.revision_knobs is not None and not p.revision_knobs.same_as(knobs)
    )
    return ready_new, ready_new >= max(1, replicas) and old == 0


def slo_attainment(snapshot: Snapshot, slo: SLO) -> float | None:
    """The worst attainment fraction among the SLO's targets (None when none measured)."""
    values = [snapshot.attainment(m) for m, _ in slo.targets()]
    known = [v for v in values if v is not None]
    return min(known) if known else None


def worst_ratio(snapshot: Snapshot, slo: SLO) -> float | None:
    """Largest measured/threshold over the SLO targets (> 1 means the SLO is missed)."""
    ratios = []
    for m, t in slo.targets():
        v = target_value(snapshot, m, t)
        if v is not None:
            ratios.append(v / t.threshold_ms)
    return max(ratios) if ratios else None


def measure(snapshot: Snapshot, slo: SLO, capacity_rps: float | None) -> Measured:
    def at(metric: str) -> float | None:
        t = getattr(slo, metric)
        s = snapshot.latency(metric)
        return s.at(t.percentile) if t is not None else s.p95_ms

    return Measured(
        request_rate=snapshot.per_pod_rate(),
        ttft_ms=at("ttft"),
        itl_ms=at("itl"),
        e2e_ms=at("e2e"),
        slo_attainment=slo_attainment(snapshot, slo),
        capacity_rps=capacity_rps,
    )


def _measured_ratio(m: Measured, slo: SLO) -> float | None:
    ratios = []
    for metric, t in slo.targets():
        v = getattr(m, f"{metric}_ms")
        if v is not None:
            ratios.append(v / t.threshold_ms)
    return max(ratios) if ratios else None


@dataclass(frozen=True)
class Verdict:
    keep: bool
    reason: str


def judge_before_after(
    snapshot: Snapshot,
    slo: SLO,
    candidate: Prediction,
    baseline_here: Prediction,
    min_gain_pct: float,
) -> Verdict:
    """Keep the candidate only if its window beats what the baseline knobs would do **at this
    window's load**, as the model calibrated on the baseline's own window predicts.

    `candidate` is the model calibrated on this window, `baseline_here` the baseline knobs at
    this window's workload under the baseline's calibration. Violations count only when the
    histogram confirms them (diagnosis.slo_violations); a "no worse" at another load is never
    evidence.
    """
    rate = snapshot.per_pod_rate()
    confirmed = slo_violations(snapshot, slo)
    ratio = worst_ratio(snapshot, slo)
    base_ratio = baseline_here.slo_ratio
    here = f"at {rate:.2f} req/s/pod"
    if confirmed:
        text = f"SLO missed ({_fmt_ratio(ratio)}) {here}"
        if (
            ratio is not None
            and math.isfinite(base_ratio)
            and base_ratio > ratio * (1.0 + REGRESSION_TOLERANCE)
        ):
            return Verdict(True, f"{text}, but the previous knobs would miss it by more here "
                           f"({_fmt_ratio(base_ratio)})")  # fmt: skip
        return Verdict(False, f"{text}; the previous knobs would do {_fmt_ratio(base_ratio)} here")
    if not baseline_here.meets_slo and math.isfinite(base_ratio) and base_ratio > 1.0:
        return Verdict(
            True,
            f"SLO met {here} where the previous knobs would miss it ({_fmt_ratio(base_ratio)})",
        )
    cap_c, cap_b = candidate.capacity_rps, baseline_here.capacity_rps
    gain = (cap_c / cap_b - 1.0) * 100.0 if cap_b > 0 else math.inf
    text = (
        f"SLO met {here}; calibrated on this window the candidate serves {cap_c:.2f} req/s/pod "
        f"within the SLO against {cap_b:.2f} for the previous knobs ({gain:+.1f}%)"
    )
    if gain >= min_gain_pct / 2.0:
        return Verdict(True, text)
    return Verdict(False, f"no measured gain: {text}")


def _fmt_ratio(r: float | None) -> str:
    return "unknown" if r is None else f"{r:.0%} of threshold"


def adopt_unrecorded(
    state: TuningState, live: Knobs | None, policy: TuningPolicy, now: datetime
) -> TuningState | None:
    """Take over a rollout that was applied but never recorded (the operator died between
    writing the Deployment and writing status), instead of reverting it and rolling it out
    again: two needless restarts of every GPU pod. None when `live` is not such a rollout.

    Only what the tuner itself could have chosen is adopted: mode Auto, no trial in flight,
    inside the bounds, never judged bad, and a rollout the rules allow now. Anything else
    (a hand edit, a stale read of our own rollback) is restored to `state.applied`.
    """
    if live is None or policy.mode != "Auto" or state.phase in TRIAL_PHASES:
        return None
    if live.same_as(state.applied) or not policy.bounds.contains(live):
        return None
    if any(live.same_as(i.knobs) for i in state.infeasible):
        return None
    if any(live.same_as(t.knobs) for t in state.trials if t.outcome != "Committed"):
        return None
    state = roll_day(state, now)
    if rollout_blocker(state, policy.rollout, now) is not None:
        return None
    trial = Trial(id=state.next_trial_id(), knobs=live, started_at=now)
    return replace(
        state.with_trial(trial),
        applied=live,
        candidate=live,
        phase="RollingOut",
        rollout_started_at=now,
        verify_until=None,
        last_rollout_at=now,
        rollouts_today=state.rollouts_today + 1,
    )
