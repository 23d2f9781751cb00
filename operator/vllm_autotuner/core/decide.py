"""decide(): one pure step of the tuning loop.

Given what the tuner remembers (TuningState), what it sees now (Observation), the policy and
the clock, return what to do and the state to remember. The operator applies
`knobs_to_apply` (rendering the Deployment from `new_state.applied`), patches status with
`new_state.to_dict()` and emits `events`. Everything that could make a change unsafe is checked
here, in one place, so the property tests can hold decide() to the safety rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from vllm_autotuner.core.arrival_pool import ArrivalPool, pooled, stored_pool
from vllm_autotuner.core.autoscaling import scale_wait
from vllm_autotuner.core.calibration_mean import (
    Fits,
    ParamMean,
    RobustGain,
    robust_gain,
    updated,
)
from vllm_autotuner.core.canary import cautious_slo, judge_canary, miss_share
from vllm_autotuner.core.censoring import uncensored
from vllm_autotuner.core.diagnosis import Diagnosis, diagnose
from vllm_autotuner.core.economics import (
    Headroom,
    Worth,
    headroom,
    headroom_wait_s,
    worth_restart,
)
from vllm_autotuner.core.evidence import evidence_of
from vllm_autotuner.core.memory import ProvenMemory
from vllm_autotuner.core.perf_model import (
    ADMIT_BOUND_S,
    AGREEMENT_TOLERANCE,
    Calibration,
    PerformanceModel,
    Prediction,
    Workload,
    prediction_agrees,
)
from vllm_autotuner.core.rollout import (
    PodFailure,
    Verdict,
    judge_before_after,
    measure,
    pod_failure,
    roll_day,
    rollout_blocker,
    rollout_progress,
    worst_ratio,
)
from vllm_autotuner.core.search import (
    MNBT_GRAIN,
    MNS_GRAIN,
    SearchResult,
    allowed,
    capacity_gain_pct,
    search,
)
from vllm_autotuner.core.search_memo import SearchInputs, SearchMemo
from vllm_autotuner.core.snapshot import Observation, Snapshot, defect
from vllm_autotuner.core.steady_state import shared_evaluations
from vllm_autotuner.core.tuning_types import (
    SLO,
    TRIAL_PHASES,
    Action,
    CanaryAnalysis,
    DecisionRecord,
    DeploymentContext,
    Event,
    InfeasibleConfig,
    InfeasibleKind,
    KnobBounds,
    Knobs,
    Measured,
    ModelCheck,
    Phase,
    Predicted,
    Recommendation,
    RolloutRules,
    Strategy,
    Trial,
    TrialOutcome,
    TuningPolicy,
    TuningState,
)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    new_state: TuningState
    knobs_to_apply: Knobs | None = None
    events: tuple[Event, ...] = ()
    diagnosis: Diagnosis | None = None
    prediction: Prediction | None = None
    # The search this decision ran or reused; the caller hands it back next time (`memo`).
    search_memo: SearchMemo | None = None
    # What the model predicted at this decision, per pod at the observed workload: the applied
    # knobs first, then the proposal (if any). For people (status, metrics) and benchmarks
    # that hold the model to the ground truth.
    predictions: tuple[tuple[Knobs, Prediction], ...] = ()


def decide(
    state: TuningState,
    obs: Observation,
    policy: TuningPolicy,
    ctx: DeploymentContext,
    now: datetime,
    model: PerformanceModel,
    origin: Knobs | None = None,
    memo: SearchMemo | None = None,
) -> Decision:
    """`origin` is where tuning started (spec + policy): the configuration to fall back to
    when a committed one fails later and no earlier committed one exists. `memo` is the
    previous decision's `search_memo`: reused instead of a new search while it still answers
    (core/search_memo.py)."""
    state = roll_day(state, now)
    if policy.mode == "Off":
        phase: Phase = state.phase if state.phase in TRIAL_PHASES else "Idle"
        return _done(
            replace(state, phase=phase),
            now,
            "hold",
            f"mode Off: tuning disabled; running {state.applied.describe()}",
        )
    waits = scale_wait(state, obs, policy, now)  # a moving replica count is not a knob effect
    if waits is not None:
        return _done(waits.state, now, waits.action, waits.reason)
    if state.phase in TRIAL_PHASES:
        if policy.mode != "Auto":
            return _done(
                state,
                now,
                "hold",
                f"mode {policy.mode}: trial of {_cand(state)} left as is, not supervised; "
                "switch back to Auto to verify it",
            )
        return _supervise(state, obs, policy, ctx, now, model)
    return _steady(state, obs, policy, ctx, now, model, origin, memo)


# ----------------------------------------------------------------------------------- helpers


def _cand(state: TuningState) -> str:
    return "none" if state.candidate is None else state.candidate.describe()


def _done(
    state: TuningState,
    now: datetime,
    action: Action,
    reason: str,
    knobs: Knobs | None = None,
    events: tuple[Event, ...] = (),
    diagnosis: Diagnosis | None = None,
    prediction: Prediction | None = None,
    memo: SearchMemo | None = None,
    predictions: tuple[tuple[Knobs, Prediction], ...] = (),
) -> Decision:
    new_state = replace(state, last_decision=DecisionRecord(now, action, reason))
    return Decision(
        action, reason, new_state, knobs, events, diagnosis, prediction, memo, predictions
    )


def _rollback(
    state: TuningState,
    now: datetime,
    outcome: TrialOutcome,
    kind: InfeasibleKind | None,
    reason: str,
    measured_state: TuningState | None = None,
) -> Decision:
    cand = state.candidate
    s = measured_state or state
    trial = s.current_trial()  # with what the trial measured, when it was judged
    if trial is not None:
        s = s.with_trial(replace(trial, ended_at=now, outcome=outcome, reason=reason))
    if kind is not None and cand is not None:
        s = s.with_infeasible(InfeasibleConfig(cand, reason, now, kind))
    s = replace(
        s,
        applied=state.last_good,
        candidate=None,
        phase="RolledBack",
        strategy="Rolling",
        rollout_started_at=None,
        verify_until=None,
        # The proposal just failed its trial: status must not keep recommending it.
        recommendation=None,
    )
    if state.strategy == "Canary" and state.phase != "Promoting":
        keeps = state.last_good.describe()
        text = f"canary {_cand(state)} removed; every pod keeps {keeps}: {reason}"
    else:
        text = f"rolled back to {state.last_good.describe()}: {reason}"
    event = Event("Warning", "TuningRolledBack", text)
    return _done(s, now, "rollback", text, state.last_good, (event,))


# ------------------------------------------------------------------------------ supervision


def _supervise(
    state: TuningState,
    obs: Observation,
    policy: TuningPolicy,
    ctx: DeploymentContext,
    now: datetime,
    model: PerformanceModel,
) -> Decision:
    cand = state.candidate
    if cand is None:
        return _done(
            replace(state, phase="Observing", applied=state.last_good, strategy="Rolling"),
            now,
            "hold",
            f"{state.phase} without a candidate; back to observing {state.last_good.describe()}",
        )
    failure: PodFailure | None = pod_failure(obs.pods, cand)
    if failure is not None:
        # A crashing or OOM-killed candidate goes back at once: no wait, no headroom check.
        return _rollback(state, now, failure.outcome, failure.kind, failure.reason)
    if not policy.bounds.contains(cand):
        # The policy was tightened mid-trial: the candidate is no longer allowed. Not the
        # candidate's fault, so it is not remembered as infeasible.
        return _rollback(
            state,
            now,
            "RolledBack",
            None,
            f"the policy changed: {cand.describe()} is outside its bounds now",
        )
    if state.strategy == "Canary":
        if state.phase == "RollingOut":
            return _canary_starting(state, obs, policy, now, cand)
        if state.phase == "Verifying":
            return _canary_analysis(state, obs, policy, ctx, now, model, cand)
        return _promoting(state, obs, policy, ctx, now, cand)
    if state.phase == "RollingOut":
        return _rolling_out(state, obs, policy, ctx, now, cand)
    return _verify_rolling(state, obs, policy, ctx, now, model, cand)


def _rolling_out(
    state: TuningState,
    obs: Observation,
    policy: TuningPolicy,
    ctx: DeploymentContext,
    now: datetime,
    cand: Knobs,
) -> Decision:
    rules = policy.rollout
    elapsed = _elapsed(state, now)
    ready, complete = rollout_progress(obs.pods, cand, ctx.replicas)
    pods = f"{ready}/{ctx.replicas} pods ready"
    timeout = f"(readyTimeout {rules.ready_timeout_s:.0f} s)"
    return _await_ready(
        state,
        now,
        rules,
        complete,
        "RolloutReady",
        f"rollout of {cand.describe()} complete: {pods} after {elapsed:.0f} s; "
        f"verifying for {rules.verify_window_s:.0f} s",
        f"{pods} after {elapsed:.0f} s {timeout}",
        f"rolling out {cand.describe()}: {pods} after {elapsed:.0f} s {timeout}",
    )


def _elapsed(state: TuningState, now: datetime) -> float:
    """Seconds since the rollout (or the canary) started."""
    return (now - (state.rollout_started_at or now)).total_seconds()


def _await_ready(
    state: TuningState,
    now: datetime,
    rules: RolloutRules,
    ready: bool,
    reason: str,
    ready_text: str,
    timed_out: str,
    waiting: str,
) -> Decision:
    """The new pods are ready: verify (an Event `reason`); past readyTimeout: roll back;
    otherwise hold."""
    if ready:
        until = now + timedelta(seconds=rules.verify_window_s)
        return _done(
            replace(state, phase="Verifying", verify_until=until),
            now,
            "verify",
            ready_text,
            events=(Event("Normal", reason, ready_text),),
        )
    if _elapsed(state, now) > rules.ready_timeout_s:
        return _rollback(state, now, "NotReady", "NotReady", timed_out)
    return _done(state, now, "hold", waiting)


def _waits_for_data(
    state: TuningState, now: datetime, policy: TuningPolicy, cand: Knobs, problem: str
) -> Decision:
    """The window cannot be judged yet: wait one more verify window, then give up."""
    until = state.verify_until or now
    grace_end = until + timedelta(seconds=policy.rollout.verify_window_s)
    if now < grace_end:
        return _done(
            state,
            now,
            "verify",
            f"verification of {cand.describe()} waits for data: {problem} "
            f"(gives up in {(grace_end - now).total_seconds():.0f} s)",
        )
    return _rollback(
        state, now, "RolledBack", None, f"could not verify {cand.describe()}: {problem}"
    )


def _verify_rolling(
    state: TuningState,
    obs: Observation,
    policy: TuningPolicy,
    ctx: DeploymentContext,
    now: datetime,
    model: PerformanceModel,
    cand: Knobs,
) -> Decision:
    """One replica (or no canary): the candidate's window against what the baseline knobs
    would do at the same load, from the model calibrated on the baseline's window."""
    rules = policy.rollout
    until = state.verify_until or now
    if now < until:
        return _done(
            state,
            now,
            "verify",
            f"verifying {cand.describe()}: {(until - now).total_seconds():.0f} s of "
            f"{rules.verify_window_s:.0f} s left",
        )
    snap = obs.snapshot
    problem = _unusable(snap, cand, policy)
    if problem is not None:
        return _waits_for_data(state, now, policy, cand, problem)
    workload = _workload(snap, policy, policy.safety_margin, _pool(state))
    raw = replace(workload, safety_margin=1.0)
    base_cal = _prior(state)
    cal = model.calibrate(snap, cand, ctx, workload, base_cal)
    pred = model.predict(cand, raw, cal)
    measured = measure(snap, policy.slo, pred.capacity_rps)
    base_pred = model.predict(state.last_good, raw, base_cal or cal)
    verdict = judge_before_after(snap, policy.slo, pred, base_pred, policy.min_gain_pct)
    return _conclude_trial(
        state, now, cand, _into_bounds_kept(state, policy, verdict), measured, cal
    )


def _into_bounds_kept(state: TuningState, policy: TuningPolicy, verdict: Verdict) -> Verdict:
    """A candidate that replaced knobs the policy no longer allows is kept whatever the
    comparison says: going back would run what the platform team forbade (and move into the
    bounds again at the next reconcile, one restart per round, until the budget is spent).
    Its pods' failures still roll it back, before verification."""
    if verdict.keep or policy.bounds.contains(state.last_good):
        return verdict
    return Verdict(
        True,
        f"kept: {state.last_good.describe()} is outside the policy's bounds, so there is "
        f"nothing allowed to go back to ({verdict.reason})",
    )


def _conclude_trial(
    state: TuningState,
    now: datetime,
    cand: Knobs,
    verdict: Verdict,
    measured: Measured,
    cal: Calibration | None,
    analysis: CanaryAnalysis | None = None,
) -> Decision:
    trial = state.current_trial()
    if trial is not None and analysis is not None:
        # The canary's verdict compared it with the baseline pods over the same window: keep
        # that pair, the evidence later predictions answer to (core/evidence.py).
        trial = replace(trial, baseline=analysis.baseline, baseline_knobs=state.last_good)
    if not verdict.keep:
        measured_state = state if analysis is None else replace(state, analysis=analysis)
        if trial is not None:
            measured_state = measured_state.with_trial(replace(trial, measured=measured))
        if _served_its_window(state, now):
            measured_state = replace(measured_state, proven_memory=_proven(state, cand))
        return _rollback(state, now, "RolledBack", "Regression", verdict.reason, measured_state)
    s = state
    if trial is not None:
        s = s.with_trial(
            replace(
                trial, ended_at=now, outcome="Committed", reason=verdict.reason, measured=measured
            )
        )
    s = replace(
        s,
        applied=cand,
        last_good=cand,
        candidate=None,
        phase="Committed",
        strategy="Rolling",
        rollout_started_at=None,
        verify_until=None,
        proven_memory=_proven(state, cand),
        baseline=measured,
        calibration=state.calibration
        if cal is None
        else {**cal.to_dict(), **stored_pool(state.calibration)},
        analysis=analysis,
    )
    text = f"committed {cand.describe()}: {verdict.reason}"
    return _done(s, now, "commit", text, events=(Event("Normal", "TuningCommitted", text),))


def _served_its_window(state: TuningState, now: datetime) -> bool:
    """The candidate ran its whole verify window (a verdict at its end, not an early one)."""
    return state.verify_until is not None and now >= state.verify_until


def _proven(state: TuningState, cand: Knobs) -> ProvenMemory:
    """The memory proven stable once `cand` served a whole verify window without a crash or
    an OOM kill: what a commit proves, and what a candidate rejected at the end of its window
    for too small a gain proves as well (it ran as long, on the same traffic). Counting only
    commits kept kv-bound-8b-a100-40gb at 0.94 after three trials there, two of which had run
    0.94 for their whole windows, where the oracle's 0.97 serves 4 % more. The proof holds at
    `cand`'s token budget (core/memory.py)."""
    return state.memory().with_proof(cand)


# ------------------------------------------------------------------------------------ canary


def _canary_min_requests(policy: TuningPolicy, ctx: DeploymentContext) -> int:
    """Requests one pod must have served before the paired comparison counts."""
    return max(30, policy.min_requests_per_window // max(1, ctx.replicas))


def _canary_starting(
    state: TuningState, obs: Observation, policy: TuningPolicy, now: datetime, cand: Knobs
) -> Decision:
    rules = policy.rollout
    elapsed = _elapsed(state, now)
    ready = any(p.ready and cand.same_as(p.revision_knobs) for p in obs.pods)
    timeout = f"(readyTimeout {rules.ready_timeout_s:.0f} s)"
    return _await_ready(
        state,
        now,
        rules,
        ready,
        "CanaryReady",
        f"canary of {cand.describe()} ready after {elapsed:.0f} s; comparing it with the "
        f"baseline pods for up to {rules.verify_window_s:.0f} s",
        f"the canary pod was not ready after {elapsed:.0f} s {timeout}",
        f"canary of {cand.describe()} starting: not ready after {elapsed:.0f} s {timeout}",
    )


def _canary_analysis(
    state: TuningState,
    obs: Observation,
    policy: TuningPolicy,
    ctx: DeploymentContext,
    now: datetime,
    model: PerformanceModel,
    cand: Knobs,
) -> Decision:
    base, can = obs.snapshot, obs.canary
    if state.analysis is None:
        return _canary_window_start(state, base, policy, now, cand)
    until = state.verify_until or now
    final = now >= until
    if can is None or not can.available or not base.available:
        why = "no canary window" if can is None else (base.reason if can.available else can.reason)
        if not final:
            return _done(state, now, "verify", f"canary analysis waits for data: {why}")
        return _waits_for_data(state, now, policy, cand, why)
    until = _canary_deadline(until, policy, ctx, base, can)
    final = now >= until
    cap_base = cap_can = cautious = None
    if final:
        prior, pool = _prior(state), _pool(state)
        cap_base, _ = _own_capacity(model, base, state.applied, policy, ctx, prior, pool)
        cap_can, cautious = _own_capacity(model, can, cand, policy, ctx, prior, pool, True)
    j = judge_canary(
        base,
        can,
        policy.slo,
        _canary_min_requests(policy, ctx),
        cap_base,
        cap_can,
        policy.min_gain_pct,
        final,
        cautious,
    )
    analysis = CanaryAnalysis(
        since=state.analysis.since,
        window_s=can.window_s,
        baseline=measure(base, policy.slo, cap_base),
        canary=measure(can, policy.slo, cap_can),
        verdict=j.verdict,
        reason=j.reason,
    )
    if j.verdict == "Pending":
        left = max(0.0, (until - now).total_seconds())
        return _done(
            replace(state, analysis=analysis),
            now,
            "verify",
            f"canary analysis of {cand.describe()}: {j.reason}; {left:.0f} s left",
        )
    if j.verdict == "Reject":
        return _conclude_trial(
            state, now, cand, Verdict(False, f"canary lost: {j.reason}"), analysis.canary, None,
            analysis,
        )  # fmt: skip
    s = replace(
        state,
        applied=cand,
        phase="Promoting",
        rollout_started_at=now,
        verify_until=None,
        analysis=analysis,
    )
    text = f"canary {cand.describe()} won; promoting it to every pod: {j.reason}"
    return _done(s, now, "promote", text, cand, (Event("Normal", "CanaryPromoted", text),))


# How long a canary's paired window may run, in verify windows, while either side has served
# too few requests for the comparison (`_canary_min_requests`).
CANARY_WINDOW_FACTOR = 3


def _canary_deadline(
    until: datetime, policy: TuningPolicy, ctx: DeploymentContext, base: Snapshot, can: Snapshot
) -> datetime:
    """When the paired comparison ends: at `until`, the verify window's end, or, while the
    canary or the baseline pods have served too few requests to compare, when they have,
    up to CANARY_WINDOW_FACTOR verify windows from the start.

    A pod at a low rate fills a fixed window only by luck: a held-out 32B RAG deployment at
    0.09-0.11 req/s per pod counted 53-65 canary requests of the 66 it needs in 600 s, and
    three of its four canaries were lost for it, each a restart spent for nothing."""
    need = _canary_min_requests(policy, ctx)
    if can.completed_requests >= need and base.completed_requests >= need:
        return until
    extra = (CANARY_WINDOW_FACTOR - 1) * policy.rollout.verify_window_s
    return until + timedelta(seconds=extra)


def _canary_window_start(
    state: TuningState, base: Snapshot, policy: TuningPolicy, now: datetime, cand: Knobs
) -> Decision:
    """Start the paired window once the baseline pods have worked off the queue that the
    canary's start left them (without surge they carried its share while it loaded): a queue
    from the restart is not the knobs' doing, and would hand the fresh canary a false win.
    Waits at most half the verify window: a queue that stays is the knobs' own."""
    started = state.verify_until - timedelta(seconds=policy.rollout.verify_window_s) if (
        state.verify_until is not None
    ) else now  # fmt: skip
    settling = (now - started).total_seconds()
    if _queued(base) and settling < policy.rollout.verify_window_s / 2:
        return _done(
            state,
            now,
            "verify",
            f"canary {cand.describe()} ready; the baseline pods still work off the queue its "
            f"start left ({base.waiting_mean or 0:.0f} waiting per pod); the comparison "
            "starts when it is gone",
        )
    analysis = CanaryAnalysis(now, 0.0, Measured(0.0), Measured(0.0), "Pending", "window starts")
    until = now + timedelta(seconds=policy.rollout.verify_window_s)
    text = (
        f"canary {cand.describe()}: comparing it with the baseline pods over the same "
        f"traffic from now, for up to {policy.rollout.verify_window_s:.0f} s"
    )
    return _done(replace(state, analysis=analysis, verify_until=until), now, "verify", text)


def _queued(snap: Snapshot) -> bool:
    """The window shows a standing queue: requests waiting beyond a few per pod."""
    waiting = snap.waiting_mean or 0.0
    return snap.available and waiting >= max(2.0, 0.1 * (snap.running_mean or 0.0))


def _own_capacity(
    model: PerformanceModel,
    snap: Snapshot,
    knobs: Knobs,
    policy: TuningPolicy,
    ctx: DeploymentContext,
    prior: Calibration | None,
    pool: ArrivalPool | None,
    cautious: bool = False,
) -> tuple[float | None, float | None]:
    """Capacity per pod of `knobs`, from the model calibrated on these pods' own window (at
    the deployment's pooled burstiness, the same for both sides of a canary), and with
    `cautious` the same at the SLO a window of this many requests cannot rule out
    (`cautious_slo`; None without)."""
    if snap.completed_requests <= 0:
        return None, None
    w = _workload(snap, policy, 1.0, pool)
    cal = model.calibrate(snap, knobs, ctx, w, prior)
    central = model.predict(knobs, w, cal).capacity_rps
    if not cautious:
        return central, None
    return central, _cautious_capacity(model, knobs, w, cal, snap.completed_requests)


def _cautious_capacity(
    model: PerformanceModel, knobs: Knobs, workload: Workload, cal: Calibration, requests: int
) -> float:
    """Capacity per pod of `knobs` at the SLO a window of `requests` cannot rule out
    (`canary.cautious_slo`): what a canary's verdict credits, and what the check before a
    canary expects it to."""
    strict = replace(workload, slo=cautious_slo(workload.slo, requests))
    return model.predict(knobs, strict, cal).capacity_rps


def _promoting(
    state: TuningState,
    obs: Observation,
    policy: TuningPolicy,
    ctx: DeploymentContext,
    now: datetime,
    cand: Knobs,
) -> Decision:
    rules = policy.rollout
    started = state.rollout_started_at or now
    elapsed = (now - started).total_seconds()
    ready, complete = rollout_progress(obs.pods, cand, ctx.replicas)
    if complete:
        measured = state.analysis.canary if state.analysis is not None else Measured(0.0)
        reason = "promoted to every pod" + (
            f" after its canary won: {state.analysis.reason}" if state.analysis else ""
        )
        verdict = Verdict(True, reason)
        return _conclude_trial(state, now, cand, verdict, measured, None, state.analysis)
    if elapsed > rules.ready_timeout_s:
        return _rollback(
            state,
            now,
            "NotReady",
            "NotReady",
            f"promotion: {ready}/{ctx.replicas} pods ready after {elapsed:.0f} s "
            f"(readyTimeout {rules.ready_timeout_s:.0f} s)",
        )
    return _done(
        state,
        now,
        "hold",
        f"promoting {cand.describe()}: {ready}/{ctx.replicas} pods ready after {elapsed:.0f} s",
    )


def _prior(state: TuningState) -> Calibration | None:
    """The last fit; None before any (the arrivals' pool alone is no fit)."""
    pool = stored_pool(state.calibration)
    fit = {k: v for k, v in state.calibration.items() if k not in pool}
    return Calibration.from_dict(fit) if fit else None


def _pool(state: TuningState) -> ArrivalPool | None:
    return ArrivalPool.from_dict(state.calibration)


def _workload(
    snap: Snapshot, policy: TuningPolicy, margin: float, pool: ArrivalPool | None
) -> Workload:
    """The window's traffic, at the recent windows' pooled burstiness where there is one
    (core/arrival_pool.py): one window's counts are too few to tell bursts from noise; with
    the lengths and rate of its arrivals, not only of the requests that finished since its
    pods started (core/censoring.py)."""
    w = Workload.from_snapshot(uncensored(snap), policy.slo, margin)
    return w if pool is None else replace(w, arrival_cv2=pool.cv2())


def _unusable(snap: Snapshot, knobs: Knobs, policy: TuningPolicy) -> str | None:
    """Why this snapshot cannot be judged (None when it can)."""
    if not snap.available:
        return (
            f"metrics unavailable for the last {snap.window_s:.0f} s: "
            f"{snap.reason or 'no reason given'}"
        )
    invalid = defect(snap, policy.slo.targets())
    if invalid is not None and not invalid.startswith("partial"):
        return f"metrics unusable: {invalid}"
    if snap.knobs is None or not snap.knobs.same_as(knobs):
        seen = "unknown knobs" if snap.knobs is None else snap.knobs.describe()
        return f"window observed under {seen}, not the applied {knobs.describe()} (mixed revisions)"
    if snap.completed_requests < policy.min_requests_per_window:
        return (
            f"not enough data: {snap.completed_requests} of {policy.min_requests_per_window} "
            f"requests in {snap.window_s:.0f} s"
        )
    if invalid is not None:
        return f"metrics unusable: {invalid}"
    return None


# ---------------------------------------------------------------------------- steady state


def _no_search(snap: Snapshot, policy: TuningPolicy, diag: Diagnosis) -> tuple[Phase, str] | None:
    """The phase and the reason to hold without searching: idle traffic, or a young window
    while the SLO is met (`_young_window`); None when the search should run."""
    if diag.kind == "idle":
        return "Idle", f"idle: {diag.evidence}"
    young = _young_window(snap, policy, diag)
    if young is not None:
        return "Observing", f"{diag.kind}: {diag.evidence}; {young}"
    return None


# A window this much shorter than the evaluation window is a whole one (the adapter rounds a
# clipped window down to its query grid).
_WHOLE_WINDOW = 0.95


def _young_window(snap: Snapshot, policy: TuningPolicy, diag: Diagnosis) -> str | None:
    """With the SLO met there is no hurry: a change waits until the pods have filled one
    evaluation window, instead of resting on the minute or two a fresh revision has shown.

    Both public predictions over 25 % in the benchmark run that corrected young windows'
    lengths (core/censoring.py) came from such windows, each a proposal while the SLO was
    met: bursty-8b-h100's 832/728 at 60 s (-26 %), and code-70b-h200-tp4's 512/512 at 150 s,
    where one window's fit jumped to a compute efficiency of 0.98 (0.74-0.89 in the windows
    around it) and put it at +129 %. A violated SLO still acts on the short window."""
    if diag.violates_slo or snap.window_s >= _WHOLE_WINDOW * policy.evaluation_window_s:
        return None
    return (
        f"a change while the SLO is met waits for a whole evaluation window of the pods: "
        f"{snap.window_s:.0f} of {policy.evaluation_window_s:.0f} s so far"
    )


def _recovering(
    state: TuningState, snap: Snapshot, policy: TuningPolicy, now: datetime
) -> str | None:
    """A queue in the first windows after a trial ended is the restart's, not the knobs':
    judging it would blame the knobs (and roll again). Hold until it drains, at most two
    evaluation windows."""
    ended = max((t.ended_at for t in state.trials if t.ended_at is not None), default=None)
    if ended is None or not _queued(snap):
        return None
    since = (now - ended).total_seconds()
    if since >= 2 * policy.evaluation_window_s:
        return None
    return (
        f"recovering from the last rollout ({since / 60:.0f} min ago): "
        f"{snap.waiting_mean or 0:.0f} requests waiting per pod; judging when the queue is gone"
    )


def _previous_good(state: TuningState, origin: Knobs | None) -> Knobs | None:
    """The configuration that was good before the applied one (None when there is none)."""
    bad = [i.knobs for i in state.infeasible]
    committed = [t.knobs for t in state.trials if t.outcome == "Committed"]
    for k in reversed([*([origin] if origin is not None else []), *committed]):
        if not k.same_as(state.applied) and not any(k.same_as(b) for b in bad):
            return k
    return None


def _late_failure(
    state: TuningState, now: datetime, failing: PodFailure, fallback: Knobs
) -> Decision:
    """A committed configuration crashed or OOM-ed later (a hidden constraint that only showed
    under some traffic): go back to the one before it and never try this one again."""
    applied = state.applied
    s = state.with_infeasible(InfeasibleConfig(applied, failing.reason, now, failing.kind))
    # What was "proven stable" was not: an OOM kill, or a crash loop, which is how a CUDA
    # out-of-memory error inside the engine shows (vLLM exits; kv-bound's hazard, seed 205).
    memory = s.memory()
    if failing.kind in ("OOMKilled", "Crashed"):
        memory = memory.without_claims_on(applied)
    s = replace(
        s,
        applied=fallback,
        last_good=fallback,
        candidate=None,
        phase="RolledBack",
        rollout_started_at=None,
        verify_until=None,
        baseline=None,
        recommendation=None,
        proven_memory=memory,
    )
    text = (
        f"rolled back to {fallback.describe()}: the committed {applied.describe()} failed "
        f"later: {failing.reason}"
    )
    return _done(s, now, "rollback", text, fallback, (Event("Warning", "TuningRolledBack", text),))


def _clamp(k: Knobs, policy: TuningPolicy) -> Knobs:
    b = policy.bounds
    return Knobs(
        max_num_batched_tokens=int(min(max(k.max_num_batched_tokens, b.mnbt.min), b.mnbt.max)),
        max_num_seqs=int(min(max(k.max_num_seqs, b.mns.min), b.mns.max)),
        gpu_memory_utilization=float(min(max(k.gpu_memory_utilization, b.gmu.min), b.gmu.max)),
    )


def _into_bounds(state: TuningState, policy: TuningPolicy, now: datetime) -> Decision:
    """The policy no longer allows what runs: roll out the nearest allowed configuration, as
    a trial like any other (verified, rolled back if it fails), when the rules allow one."""
    applied = state.applied
    target = _clamp(applied, policy)
    why = f"{applied.describe()} is outside the policy's bounds"
    blocker = rollout_blocker(state, policy.rollout, now)
    if blocker is not None:
        text = f"{why}; moving to {target.describe()} waits: {blocker}"
        return _done(replace(state, phase="Holding"), now, "hold", text)
    s, trial = _start_trial(state, target, now)
    s = replace(s, recommendation=None)
    text = f"rollout {target.describe()} (trial {trial.id}, from {applied.describe()}): {why}"
    return _done(s, now, "rollout", text, target, (Event("Normal", "RolloutStarted", text),))


def _steady(
    state: TuningState,
    obs: Observation,
    policy: TuningPolicy,
    ctx: DeploymentContext,
    now: datetime,
    model: PerformanceModel,
    origin: Knobs | None = None,
    memo: SearchMemo | None = None,
) -> Decision:
    """No trial runs: read the window, and propose, recommend or roll out what it supports."""
    stop = _cannot_tune(state, obs, policy, now, origin)
    if stop is not None:
        return stop
    w = _assess(state, obs.snapshot, policy, ctx, now, model)
    early = _no_search(w.snap, policy, w.diag)
    if early is not None:
        phase, text = early
        return _done(
            replace(w.state, phase=phase, recommendation=None, headroom_wait_since=None),
            now,
            "hold",
            text,
            diagnosis=w.diag,
            prediction=w.current,
            predictions=w.seen(),
        )
    inputs = SearchInputs.of(state.applied, policy, w.diag, state)
    lead = w.fits.lead
    if memo is not None and _memo_answers(memo, inputs, w.workload, lead, now, policy):
        res, conclusion = memo.result, memo.conclusion
    else:
        res, conclusion = _conclude(state, policy, w.diag, model, w.workload, lead, w.check.trusted)
        memo = SearchMemo(now, inputs, w.workload, lead, res, conclusion)
    summary = f"{w.diag.kind}: {w.diag.evidence}; {conclusion}"
    if not res.worth_rollout or res.best is None or res.prediction is None:
        return _done(
            replace(
                w.state,
                phase="Observing",
                recommendation=None,
                headroom_wait_since=_wait(w.state, w.diag),
            ),
            now,
            "hold",
            summary,
            diagnosis=w.diag,
            prediction=res.prediction or w.current,
            memo=memo,
            predictions=w.seen(),
        )
    prop, memo = _robust_proposal(w, res.best, res.prediction, summary, state, policy, model, memo)
    seen = w.seen(prop)
    if prop.robust.binds and prop.pred.capacity_rps <= w.current.capacity_rps:
        holder = (
            w.fits.second_name()
            if prop.robust.second_binds
            else f"the fit at a {ADMIT_BOUND_S * 1000:.0f} ms admission cost"
        )
        text = f"{prop.summary}; not rolled out: no gain that holds at {holder}"
        s = replace(w.state, recommendation=None)
        return _hold_observing(s, now, text, w.diag, prop.pred, memo, seen)
    return _act(w, prop, res.gain_pct, policy, ctx, now, model, memo)


@dataclass(frozen=True)
class _Window:
    """What one evaluation window says about the applied knobs, for `_steady`: the state that
    remembers it (calibration, model check, peak rate, baseline), the workload, both fits
    (`Fits`), the applied knobs' prediction at the lead fit, the model check and the diagnosis
    with the model's violations, and the per-pod rate."""

    state: TuningState
    snap: Snapshot
    workload: Workload
    fits: Fits
    current: Prediction
    check: ModelCheck
    diag: Diagnosis
    rate: float

    def seen(self, proposal: _Proposal | None = None) -> tuple[tuple[Knobs, Prediction], ...]:
        """The predictions a decision publishes: the applied knobs', then the proposal's."""
        applied = ((self.state.applied, self.current),)
        return applied if proposal is None else (*applied, (proposal.best, proposal.pred))


@dataclass(frozen=True)
class _Proposal:
    """The candidate a search chose, at the capacity every fit predicts for it (`pred`, by
    its `robust` gain), and the reason that says so."""

    best: Knobs
    pred: Prediction
    robust: RobustGain
    summary: str


def _cannot_tune(
    state: TuningState,
    obs: Observation,
    policy: TuningPolicy,
    now: datetime,
    origin: Knobs | None,
) -> Decision | None:
    """The decision when the applied knobs cannot be tuned from this window: their pods
    fail (fall back to the previous good configuration, or hold), they are outside the
    policy's bounds (move into them), or the window cannot be used; None: tune."""
    applied = state.applied
    failing = pod_failure(obs.pods, applied)
    fallback = _previous_good(state, origin) if policy.mode == "Auto" else None
    if failing is not None and fallback is not None:
        return _late_failure(state, now, failing, fallback)
    if failing is not None:
        text = f"pods of the applied configuration are failing: {failing.reason}; holding"
        return _done(
            replace(state, phase="Holding"),
            now,
            "hold",
            text,
            events=(Event("Warning", "TunedPodsFailing", text),),
        )
    if policy.mode == "Auto" and not policy.bounds.contains(applied):
        return _into_bounds(state, policy, now)
    snap = obs.snapshot
    problem = _unusable(snap, applied, policy) or _recovering(state, snap, policy, now)
    if problem is not None:
        return _done(replace(state, phase="Holding"), now, "hold", problem)
    return None


def _assess(
    state: TuningState,
    snap: Snapshot,
    policy: TuningPolicy,
    ctx: DeploymentContext,
    now: datetime,
    model: PerformanceModel,
) -> _Window:
    """Fit the model to the window, check its prediction for the applied knobs against what
    was measured, diagnose, and remember the fits, the check and the peak rate (and the
    baseline, on the last good knobs)."""
    applied = state.applied
    pool = pooled(state.calibration, snap, now.timestamp(), policy.evaluation_window_s)
    workload = _workload(snap, policy, policy.safety_margin, pool)
    cal = model.calibrate(snap, applied, ctx, workload, _prior(state))
    mean = updated(state.calibration, cal, now.timestamp(), policy.evaluation_window_s)
    fits, current, second = _fits(model, snap, applied, workload, cal, mean, policy)
    rate = snap.per_pod_rate()
    check = ModelCheck(
        time=now,
        knobs=applied,
        measured_rate_rps=rate,
        predicted_capacity_rps=current.capacity_rps,
        predicted_slo_ratio=current.slo_ratio,
        measured_slo_ratio=worst_ratio(snap, policy.slo),
        fit_error=cal.fit_error,
        agrees=prediction_agrees(snap, policy.slo, current),
        arrival_cv2=workload.arrival_cv2,
    )
    diag = _with_model_violations(
        diagnose(snap, policy.slo, applied, policy.min_requests_per_window),
        check,
        current,
        policy,
        second,
    )
    stored = {
        **cal.to_dict(),
        **(mean.to_dict() if mean is not None else {}),
        **(pool.to_dict() if pool is not None else {}),
    }
    s = _with_peak(replace(state, calibration=stored, model_check=check), rate, now)
    if applied.same_as(state.last_good):
        s = replace(s, baseline=measure(snap, policy.slo, current.capacity_rps))
    return _Window(s, snap, workload, fits, current, check, diag, rate)


def _robust_proposal(
    w: _Window,
    best: Knobs,
    pred: Prediction,
    summary: str,
    state: TuningState,
    policy: TuningPolicy,
    model: PerformanceModel,
    memo: SearchMemo,
) -> tuple[_Proposal, SearchMemo]:
    """The search's candidate at the gain that every fit predicts (`robust_gain`). Where
    another fit's gain binds, that fit's own best, and the knobs between the two, are
    weighed too (`_other_best`, `_best_at`); the reason names the fits."""
    judged = _judged_by(w.fits.lead, w.diag)
    current_rps = w.current.capacity_rps
    serves = not w.diag.violates_slo
    robust = robust_gain(
        model, state.applied, best, w.workload, judged, w.fits.second, current_rps,
        pred.capacity_rps, applied_serves=serves,
    )  # fmt: skip
    binding = _binding_fit(robust, w.fits, judged)
    if binding is None:
        return _Proposal(best, pred, robust, summary), memo
    fit, at = binding
    found, memo = _other_best(state, policy, w.diag, model, w.workload, at, w.check, memo, fit)
    other = _best_at(
        state, policy, model, w.workload, judged, w.fits.second, found, current_rps, best,
        robust, serves,
    )  # fmt: skip
    if other is not None:
        chosen, pred, robust = other
        summary = (
            f"{w.diag.kind}: {w.diag.evidence}; {chosen.describe()}: predicted capacity "
            f"{pred.capacity_rps:.2f} req/s/pod vs {current_rps:.2f} now, the "
            f"most that {_fits_named(robust, w.fits)} ({w.fits.lead_name()} alone chose "
            f"{best.describe()})"
        )
        best = chosen
    pred = replace(pred, capacity_rps=robust.best_rps)
    if robust.binds:
        summary = f"{summary}; {_others_say(robust, w.fits)}"
    return _Proposal(best, pred, robust, summary), memo


def _act(
    w: _Window,
    prop: _Proposal,
    search_gain_pct: float,
    policy: TuningPolicy,
    ctx: DeploymentContext,
    now: datetime,
    model: PerformanceModel,
    memo: SearchMemo,
) -> Decision:
    """Recommend the proposal, and in Auto mode start its trial (a canary where the
    deployment has one) unless a rule holds it: the rollout budget, the busiest load seen
    lately, the restart's worth, a canary that could not credit the gain, or the wait for
    headroom."""
    s, changed = _recommended(w, prop, search_gain_pct, now)
    seen, pred, diag = w.seen(prop), prop.pred, w.diag
    summary = prop.summary
    if policy.mode == "Recommend":
        text = f"recommend {summary}"
        events = (Event("Normal", "TuningRecommendation", text),) if changed else ()
        return _done(s, now, "recommend", text, None, events, diag, pred, memo, seen)
    blocker = rollout_blocker(s, policy.rollout, now)
    if blocker is not None:
        waits = f"{summary}; rollout waits: {blocker}"
        return _done(s, now, "hold", waits, None, (), diag, pred, memo, seen)
    strategy: Strategy = "Canary" if ctx.replicas >= 2 and ctx.rollout.canary else "Rolling"
    current_rps, rate = w.current.capacity_rps, w.rate
    rate_ref = max(rate, s.peak_rate or 0.0)
    if not diag.violates_slo and current_rps >= rate_ref > pred.capacity_rps:
        # Healthy now, and the current knobs carry the busiest window seen lately: a change
        # judged at today's load must not give that up (a trough hides the cliff).
        text = (
            f"{summary}; not rolled out: it would carry {pred.capacity_rps:.2f} req/s/pod, "
            f"below the {rate_ref:.2f} req/s/pod seen lately that the current knobs carry"
        )
        return _hold_observing(s, now, text, diag, pred, memo, seen)
    room = headroom(ctx, current_rps, rate)
    worth = worth_restart(
        ctx,
        policy.rollout,
        strategy,
        current_rps,
        pred.capacity_rps,
        rate,
        rate_ref,
        miss_share(w.snap, policy.slo) if diag.violates_slo else 0.0,
    )
    if not worth.worth:
        text = f"{summary}; not worth the restart: {worth.text}"
        return _hold_observing(s, now, text, diag, pred, memo, seen)
    unprovable = (
        _canary_cannot_credit(model, prop.best, w.workload, w.fits.lead, current_rps, policy, rate)
        if strategy == "Canary" and not diag.violates_slo
        else None
    )
    if unprovable is not None:
        text = f"{summary}; not rolled out: {unprovable}"
        return _hold_observing(s, now, text, diag, pred, memo, seen)
    waited = _headroom_wait(s, policy, now, room, diag.violates_slo, summary, worth)
    if waited is not None:
        return replace(waited, diagnosis=diag, prediction=pred, search_memo=memo, predictions=seen)
    without = "" if room.ok else f"; {_without_headroom(s, policy, now, room, worth)}"
    s, trial = _start_trial(s, prop.best, now, strategy)
    how = "canary" if strategy == "Canary" else "rollout"
    text = (
        f"{how} {prop.best.describe()} (trial {trial.id}, from {w.state.applied.describe()}): "
        f"{summary}; worth it: {worth.text}" + without
    )
    reason = "CanaryStarted" if strategy == "Canary" else "RolloutStarted"
    knobs = None if strategy == "Canary" else prop.best
    return _done(
        s, now, "rollout", text, knobs, (Event("Normal", reason, text),), diag, pred,
        predictions=seen,
    )  # fmt: skip


def _recommended(
    w: _Window, prop: _Proposal, search_gain_pct: float, now: datetime
) -> tuple[TuningState, bool]:
    """The state with the proposal as its recommendation (phase Candidate), and whether the
    recommendation changed. A repeated recommendation keeps its time, so an unchanged
    conclusion does not rewrite status every reconcile."""
    previous = w.state.recommendation
    changed = previous is None or not previous.knobs.same_as(prop.best)
    pred = prop.pred
    rec = Recommendation(
        knobs=prop.best,
        reason=prop.summary,
        predicted=Predicted(pred.capacity_rps, pred.ttft_ms, pred.itl_ms),
        gain_pct=min(
            search_gain_pct, capacity_gain_pct(w.current.capacity_rps, pred.capacity_rps), 1e6
        ),
        time=now if previous is None or changed else previous.time,
    )
    return replace(w.state, phase="Candidate", recommendation=rec), changed


def _hold_observing(
    s: TuningState,
    now: datetime,
    text: str,
    diag: Diagnosis,
    pred: Prediction,
    memo: SearchMemo | None,
    seen: tuple[tuple[Knobs, Prediction], ...],
) -> Decision:
    """Hold a candidate back and keep observing (the headroom wait kept only while the SLO
    is violated, `_wait`)."""
    held = replace(s, phase="Observing", headroom_wait_since=_wait(s, diag))
    return _done(held, now, "hold", text, None, (), diag, pred, memo, seen)


def _fits(
    model: PerformanceModel,
    snap: Snapshot,
    applied: Knobs,
    workload: Workload,
    cal: Calibration,
    mean: ParamMean | None,
    policy: TuningPolicy,
) -> tuple[Fits, Prediction, Prediction | None]:
    """This window's fit (`cal`) and the recent windows' mean, and the applied knobs'
    predictions at the lead of the two (`Fits`) and at the second (None: none). The mean
    has a word once it spans an evaluation window. It leads when this window's fit strays
    from it, predicting the applied knobs' capacity more than the model's agreement
    tolerance away from the mean's, and the mean still explains this window
    (`prediction_agrees`): windows at the same knobs measure the same engine, and one
    window's fit can stray far from it where the window holds few requests
    (`calibration_mean`). Otherwise this window's fit leads: the mean follows a trend of the
    fits (on bursty-8b-h100 the first windows of the run fit a slower engine than the later
    ones) a window behind."""
    by_window = model.predict(applied, workload, cal)
    if mean is None or not mean.spans(policy.evaluation_window_s):
        return Fits(cal, None), by_window, None
    fits = Fits(cal, mean, mean_leads=True)
    by_mean = model.predict(applied, workload, fits.lead)
    strays = _apart(by_window.capacity_rps, by_mean.capacity_rps) > AGREEMENT_TOLERANCE
    if strays and prediction_agrees(snap, policy.slo, by_mean):
        return fits, by_mean, by_window
    return Fits(cal, mean), by_window, by_mean


def _apart(a: float, b: float) -> float:
    """|log(a / b)| of two capacities; infinite when only one of them is positive."""
    if a <= 0 or b <= 0:
        return 0.0 if a <= 0 and b <= 0 else math.inf
    return abs(math.log(a / b))


def _fits_named(robust: RobustGain, fits: Fits) -> str:
    """The fits a robust gain was judged under, as a reason names them."""
    names = [fits.lead_name()]
    if robust.second_ratio is not None:
        names.append(fits.second_name())
    if robust.bound_ratio is not None:
        names.append(f"the fit at a {ADMIT_BOUND_S * 1000:.0f} ms admission cost")
    if len(names) == 1:
        return f"{names[0]} predicts"
    if len(names) == 2:
        return f"both {names[0]} and {names[1]} predict"
    return ", ".join(names[:-1]) + f" and {names[-1]} all predict"


def _judged_by(cal: Calibration, diag: Diagnosis) -> Calibration:
    """The fits a candidate's gain must hold under: with the SLO met, the window's fit at the
    admission-cost bound too (nothing is lost by waiting, and a change made on a wrong
    prediction is a cost); with the SLO violated, not that one (every minute of waiting
    costs, and the canary's paired verdict on a violation comes within minutes). Run on
    every window (bench/tuning, nine scenarios), the bound lowered violated windows'
    proposals where the engine spends less than the bound: tight-itl-8b-h100's first
    proposal (its engine: 1.5 ms) to 20.1 req/s/pod against a truth of 32.0, and chat
    no-surge's to 18.4 against 25.1; chat no-surge's canary started 4.5 minutes later and
    its goodput went from 1.97x to 1.76x the defaults'."""
    return cal.without_bound() if diag.violates_slo else cal


def _binding_fit(
    robust: RobustGain, fits: Fits, cal: Calibration
) -> tuple[str, Calibration] | None:
    """The fit whose gain bound the candidate's, by name and calibration: the second fit
    (`Fits`: "window" while the mean leads, else "mean"), or the lead's (`cal`) fit at the
    admission-cost bound ("bound"); None when the lead's own gain is the smallest. The name
    keys the memo of that fit's search (`SearchMemo.other`)."""
    second = fits.second
    if robust.second_binds and second is not None:
        return ("window" if fits.mean_leads else "mean"), second
    at = cal.at_admission_bound() if robust.bound_binds else None
    return None if at is None else ("bound", at)


def _other_best(
    state: TuningState,
    policy: TuningPolicy,
    diag: Diagnosis,
    model: PerformanceModel,
    workload: Workload,
    binding: Calibration,
    check: ModelCheck,
    memo: SearchMemo,
    fit: str,
) -> tuple[Knobs | None, SearchMemo]:
    """The best of a search at the fit whose gain bound the candidate's (`binding`, named
    `fit`), remembered in the memo beside the lead fit's own search: a reconcile the memo
    answers runs neither again."""
    known, best = memo.other(fit)
    if known:
        return best, memo
    best = _conclude(state, policy, diag, model, workload, binding, check.trusted)[0].best
    return best, memo.with_other(fit, best)


def _best_at(
    state: TuningState,
    policy: TuningPolicy,
    model: PerformanceModel,
    workload: Workload,
    cal: Calibration,
    second: Calibration | None,
    other: Knobs | None,
    current_rps: float,
    best: Knobs,
    robust: RobustGain,
    applied_serves: bool,
) -> tuple[Knobs, Prediction, RobustGain] | None:
    """Of `other` (the best of a search at the fit whose gain bound the candidate's,
    `_other_best`) and the knobs between it and `best`, the one whose smallest gain under
    every fit is the largest, with its prediction at the lead fit (`cal`) and its robust
    gain, when that gain is more than `best`'s and at least the policy's minGainPct; None
    otherwise.

    The search runs at the lead fit, and the other fits only lower the gain of what it
    found; when they disagree, the lead's best can be the wrong one. In a run of a held-out
    Mixtral-8x7B deployment (with an admission-cost prior tried and reverted, see
    docs/decisions.md) one window's fit (compute efficiency 0.74 against the mean's 0.87)
    chose 320/256, whose truth is 0.78 of the best, while the mean fit predicted 384/256
    within 6 % of its truth. Runs only when another fit binds, so most decisions search
    once."""
    if other is None or other.same_as(best):
        return None
    found: tuple[Knobs, Prediction, RobustGain] | None = None
    for k in (other, *_between(best, other, state, policy)):
        pred = model.predict(k, workload, cal)
        gain = robust_gain(
            model, state.applied, k, workload, cal, second, current_rps, pred.capacity_rps,
            applied_serves=applied_serves,
        )  # fmt: skip
        if found is None or gain.best_rps > found[2].best_rps:
            found = (k, pred, gain)
    assert found is not None
    enough = capacity_gain_pct(current_rps, found[2].best_rps) >= policy.min_gain_pct
    if not enough or found[2].best_rps <= robust.best_rps:
        return None
    return found


# Where between the two fits' bests `_best_at` also looks: the most that every fit predicts
# is often between them, on the near side of the cliff one fit sees and the other does not
# (held-out Mixtral-8x7B: the window's fit chose 448 tokens, the fit at the admission-cost
# bound 320; the truth serves 384 best, 10 % above 448 and 28 % above 320).
_BETWEEN = (0.25, 0.5, 0.75)


def _between(a: Knobs, b: Knobs, state: TuningState, policy: TuningPolicy) -> list[Knobs]:
    """Knobs between `a` and `b` (token budgets and sequences on a log scale, memory on a
    linear one), rounded to the search's grains, that one rollout may reach."""

    def at(f: float) -> Knobs:
        return Knobs(
            max_num_batched_tokens=_log_between(
                a.max_num_batched_tokens, b.max_num_batched_tokens, f, MNBT_GRAIN
            ),
            max_num_seqs=_log_between(a.max_num_seqs, b.max_num_seqs, f, MNS_GRAIN),
            gpu_memory_utilization=round(
                a.gpu_memory_utilization
                + f * (b.gpu_memory_utilization - a.gpu_memory_utilization),
                2,
            ),
        )

    out: list[Knobs] = []
    for k in (at(f) for f in _BETWEEN):
        if k.same_as(a) or k.same_as(b) or any(k.same_as(o) for o in out):
            continue
        why = allowed(
            k, state.applied, policy.bounds, state.memory(), policy.gmu_rise_step, state.infeasible
        )
        if why is None:
            out.append(k)
    return out


def _log_between(a: int, b: int, f: float, grain: int) -> int:
    if a == b:
        return a
    v = math.exp(math.log(a) + f * (math.log(b) - math.log(a)))
    return max(grain, round(v / grain) * grain)


def _others_say(robust: RobustGain, fits: Fits) -> str:
    """Why the candidate's gain is another fit's, not the lead's: the second fit (`Fits`:
    this window's own fit while the recent windows' mean leads, the mean otherwise; one
    window's fit can sit on a cliff the recent ones do not: a 70B deployment's 512/512 was
    predicted +19 % from one window, -47 % from the mean of the ones before it, and -44 % by
    the truth), or the fit at the admission-cost bound, which the window cannot rule out
    (`perf_model.ADMIT_BOUND_S`)."""
    window = fits.window
    if robust.second_binds and fits.mean is not None:
        ratio = robust.second_ratio
        minutes = f"{fits.mean.span_s() / 60:.0f}"
        mean = fits.mean
        who = (
            f"this window's fit (compute {window.compute:.2f}, bandwidth "
            f"{window.bandwidth:.2f} against the mean fit of the last {minutes} min's "
            f"{mean.compute:.2f}, {mean.bandwidth:.2f})"
            if fits.mean_leads
            else f"the mean fit of the last {minutes} min (compute {mean.compute:.2f}, "
            f"bandwidth {mean.bandwidth:.2f} against this window's {window.compute:.2f}, "
            f"{window.bandwidth:.2f})"
        )
    else:
        ratio = robust.bound_ratio
        at = window.at_admission_bound() or window
        who = (
            f"the fit at a {ADMIT_BOUND_S * 1000:.0f} ms admission cost per request, which this "
            f"window cannot rule out (compute {at.compute:.2f}, bandwidth {at.bandwidth:.2f} "
            f"against this window's {window.compute:.2f}, {window.bandwidth:.2f} at "
            f"{window.admit_s * 1000:.1f} ms)"
        )
    pct = "" if ratio is None else f" ({100.0 * (ratio - 1.0):+.1f}%)"
    return f"{who} predicts a smaller gain{pct}: {robust.best_rps:.2f} req/s/pod"


def _canary_cannot_credit(
    model: PerformanceModel,
    best: Knobs,
    workload: Workload,
    cal: Calibration,
    current_rps: float,
    policy: TuningPolicy,
    rate: float,
) -> str | None:
    """Why a canary of `best` could not show its gain (None when it could): with the SLO
    met, it is promoted only on a credited gain that holds at the SLO its own requests
    cannot rule out (`canary.cautious_slo`), and at this rate its longest window holds too
    few requests for the gain the model predicts. A canary that cannot win is a restart
    for nothing (a 32B pod at 0.11 req/s counted 66-134 requests a window; bench.canary_power
    promoted a 17.6 % better candidate as often as the same knobs)."""
    window_s = CANARY_WINDOW_FACTOR * policy.rollout.verify_window_s
    requests = int(rate * window_s)
    cautious = _cautious_capacity(model, best, workload, cal, requests)
    if cautious >= current_rps:
        return None
    return (
        f"a canary at {rate:.2f} req/s/pod counts about {requests} requests in the "
        f"{window_s:.0f} s its window may run, too few to show the predicted gain: at the SLO "
        f"they cannot rule out, {best.describe()} is predicted to carry {cautious:.2f} req/s/pod, "
        f"under the {current_rps:.2f} the current knobs carry"
    )


def _with_model_violations(
    diag: Diagnosis,
    check: ModelCheck,
    current: Prediction,
    policy: TuningPolicy,
    second: Prediction | None,
) -> Diagnosis:
    """A violation the histogram cannot confirm (the threshold inside a wide bucket) counts
    when a trusted model predicts it at the measured load (`current`, the lead fit's) and
    the second fit does too (`second`, its prediction at the same knobs and load; None: no
    second fit, `Fits`).

    One window's fit alone is not enough where its data are few: a held-out 32B RAG
    deployment at 0.13 req/s/pod fitted compute 0.45 in one window and 1.05 in the window
    30 s before (the engine's: 0.75; the mean fit: 0.75). At 0.45 the model put TTFT p95 at
    3.4 s against a 3 s threshold inside vLLM's 2.5-5 s bucket, in a window that met the
    SLO, and two canaries started on that prediction were lost."""
    if diag.violates_slo or diag.kind == "idle" or not check.trusted:
        return diag
    found = _over_thresholds(current, policy.slo)
    if found and second is not None:
        confirmed = {metric for metric, _, _ in _over_thresholds(second, policy.slo)}
        found = tuple(f for f in found if f[0] in confirmed)
    if not found:
        return diag
    text = "; ".join(
        f"the model puts {m.upper()} at {v:.1f} ms > {thr:.0f} ms, which the histogram's "
        "buckets cannot rule out"
        for m, v, thr in found
    )
    return replace(diag, evidence=f"{diag.evidence}; {text}", violations=found)


def _over_thresholds(pred: Prediction, slo: SLO) -> tuple[tuple[str, float, float], ...]:
    """(metric, predicted ms, threshold ms) for every SLO target `pred` puts over its
    threshold."""
    return tuple(
        (metric, pred.latency_ms(metric), t.threshold_ms)
        for metric, t in slo.targets()
        if pred.latency_ms(metric) > t.threshold_ms
    )


def _with_peak(state: TuningState, rate: float, now: datetime) -> TuningState:
    """Remember the highest per-pod rate of the last day (the same rate again keeps the time
    it was first seen: an unchanged peak must not rewrite status every reconcile)."""
    stale = state.peak_rate_at is None or now - state.peak_rate_at > timedelta(days=1)
    if stale or state.peak_rate is None or rate > state.peak_rate:
        return replace(state, peak_rate=rate, peak_rate_at=now)
    return state


def _wait(state: TuningState, diag: Diagnosis) -> datetime | None:
    """Since when the rollout has waited for headroom, kept through a hold while the SLO is
    still violated: near-equal proposals that change from one window to the next (704, 768,
    832 tokens on chat-8b-h100-no-surge), or one window judged not worth it, would otherwise
    restart the clock every few minutes, and the break-even would never come. A met SLO ends
    the wait."""
    return state.headroom_wait_since if diag.violates_slo else None


def _headroom_wait(
    state: TuningState,
    policy: TuningPolicy,
    now: datetime,
    room: Headroom,
    violated: bool,
    summary: str,
    worth: Worth,
) -> Decision | None:
    """None when the rollout may start; else the decision to wait (bounded) for headroom.

    Without surge a restart leaves the other pods to carry its traffic. When they cannot, an
    overload leaves a queue that outlives the restart (bench/tuning measured goodput 0.70 of
    the defaults on chat-8b-h100 when restarts overloaded the remaining pod), so the rollout
    waits for the load to drop. Only a violated SLO whose gain exceeds the restart's cost with
    the overload counted may go without headroom, and it goes once the gain lost by waiting
    has reached that overload's cost (`economics.headroom_wait_s`, ski rental: at most twice
    the best choice in hindsight). Anything else waits at most `headroomTimeout`, then gives
    up. Surge avoids the wait.
    """
    if room.ok:
        return None
    waited, go_at, numbers = _wait_numbers(state, policy, now, worth)
    limit = policy.rollout.headroom_timeout_s
    may_go = violated and worth.gain_requests > worth.cost_now_requests
    if may_go and waited >= go_at:
        return None  # the caller says so in its reason (_without_headroom)
    if waited > limit:
        text = (
            f"{summary}; rollout given up after waiting {waited / 60:.0f} min for headroom "
            f"(headroomTimeout {limit / 60:.0f} min): {room.text}"
        )
        s = replace(state, phase="Observing", headroom_wait_since=None)
        return _done(s, now, "hold", text, events=(Event("Warning", "RolloutAbandoned", text),))
    until = go_at if may_go else limit
    if not may_go:
        numbers = f"only a violated SLO worth the overload goes without it; {numbers}"
    text = (
        f"{summary}; rollout waits for headroom ({waited / 60:.0f} of {until / 60:.0f} min; "
        f"{numbers}): {room.text}; {worth.text}"
    )
    events = () if state.headroom_wait_since else (Event("Normal", "WaitingForHeadroom", text),)
    s = replace(state, phase="Holding", headroom_wait_since=state.headroom_wait_since or now)
    return _done(s, now, "hold", text, events=events)


def _wait_numbers(
    state: TuningState, policy: TuningPolicy, now: datetime, worth: Worth
) -> tuple[float, float, str]:
    """How long the headroom wait has lasted, when going without headroom breaks even (at most
    headroomTimeout), and the numbers behind it in words."""
    since = state.headroom_wait_since or now
    waited = (now - since).total_seconds()
    limit = policy.rollout.headroom_timeout_s
    extra = worth.cost_now_requests - worth.cost_requests
    go_at = headroom_wait_s(worth.cost_now_requests, worth.cost_requests, worth.gain_rate, limit)
    text = (
        f"break-even {go_at / 60:.0f} min: the overload's extra {extra:,.0f} requests vs "
        f"{worth.gain_rate:.2f} req/s of gain lost while waiting, headroomTimeout "
        f"{limit / 60:.0f} min"
    )
    return waited, go_at, text


def _without_headroom(
    state: TuningState, policy: TuningPolicy, now: datetime, room: Headroom, worth: Worth
) -> str:
    waited, _, numbers = _wait_numbers(state, policy, now, worth)
    return f"going without headroom after waiting {waited / 60:.0f} min ({numbers}; {room.text})"


def _memo_answers(
    memo: SearchMemo,
    inputs: SearchInputs,
    workload: Workload,
    cal: Calibration,
    now: datetime,
    policy: TuningPolicy,
) -> bool:
    """The memo still answers, and its proposal is still legal (checked again, cheaply, so a
    reused conclusion can never carry a candidate the hard constraints now refuse)."""
    if not memo.answers(inputs, workload, cal, now, policy.evaluation_window_s):
        return False
    best = memo.result.best
    if best is None or memo.result.prediction is None:
        return True
    # Exploration steps pass the same check: they keep gpu_memory_utilization and
    # max_num_seqs <= max_num_batched_tokens, inside bounds and maxStep.
    legal = allowed(
        best, inputs.applied, policy.bounds, inputs.memory, inputs.gmu_rise_step, inputs.infeasible
    )
    return legal is None


@shared_evaluations()  # one memory for the searches and fallbacks of one decision
def _conclude(
    state: TuningState,
    policy: TuningPolicy,
    diag: Diagnosis,
    model: PerformanceModel,
    workload: Workload,
    cal: Calibration,
    trusted: bool = False,
) -> tuple[SearchResult, str]:
    """Run the search (and its fallbacks) and say what it found, after the diagnosis.

    A model that explains the applied knobs (`trusted`: ModelCheck) goes to its predicted best
    anywhere one rollout may reach; otherwise the search keeps to the diagnosed directions,
    and explores one step only when the SLO is missed and the model sees no fix."""
    applied = state.applied

    def run_search(guide: Diagnosis | None) -> SearchResult:
        return search(
            applied=applied,
            bounds=policy.bounds,
            model=model,
            workload=workload,
            calibration=cal,
            diagnosis=guide,
            infeasible=state.infeasible,
            memory=state.memory(),
            gmu_rise_step=policy.gmu_rise_step,
            min_gain_pct=policy.min_gain_pct,
            slo_violated=diag.violates_slo,
            evidence=evidence_of(state),
        )

    res = run_search(None if trusted else diag)
    conclusion = res.reason
    if diag.violates_slo and not res.worth_rollout and not trusted:
        # The diagnosis is a heuristic; when its directions cannot fix a violation, the
        # calibrated model may still know a way (e.g. a larger budget that packs prefill into
        # fewer steps). Safety rules are the same either way.
        free = run_search(None)
        if free.worth_rollout:
            res = free
            conclusion = f"the suggested direction does not help, but {free.reason}"
    if diag.violates_slo and not res.worth_rollout and not trusted:
        # Explore only where the model is uncertain: a trusted model that sees no fix is
        # believed (the trial would cost a restart to confirm it).
        probe = _exploration(applied, policy, diag, state)
        if probe is not None:
            # The model sees no fix, but the SLO is violated now and the diagnosis says which
            # way the steps are wrong: try one bounded step that way and let verification
            # judge it on live traffic. A regression forbids exactly these knobs, so the
            # exploration never repeats itself.
            res = replace(
                res,
                best=probe,
                prediction=model.predict(probe, workload, cal),
                gain_pct=0.0,
                worth_rollout=True,
                reason=f"the model predicts no fix; exploring {probe.describe()} one step in "
                "the diagnosed direction, to be verified on live traffic",
            )
            conclusion = res.reason
    return res, conclusion


def _exploration(
    applied: Knobs, policy: TuningPolicy, diag: Diagnosis, state: TuningState
) -> Knobs | None:
    """One step along the diagnosis' directions for the batching knobs, inside every rule
    a search candidate obeys (`allowed`: bounds, maxStep, known failures, the memory proven
    at the new token budget).

    Halves (or doubles) a knob, capped by the policy's maxStep and bounds; never touches
    gpu_memory_utilization (only measured stability may raise it) and keeps
    max_num_seqs <= max_num_batched_tokens as vLLM requires.
    """
    b = policy.bounds

    def step(value: int, direction: int, kb: KnobBounds) -> int:
        if direction < 0:
            target = value - min(kb.max_step, value / 2)
        elif direction > 0:
            target = value + min(kb.max_step, value)
        else:
            return value
        return int(min(max(round(target), kb.min), kb.max))

    mnbt = step(applied.max_num_batched_tokens, diag.directions.mnbt, b.mnbt)
    mns = step(applied.max_num_seqs, diag.directions.mns, b.mns)
    mns = min(mns, mnbt)
    probe = Knobs(mnbt, mns, applied.gpu_memory_utilization)
    if probe.same_as(applied):
        return None
    legal = allowed(probe, applied, b, state.memory(), policy.gmu_rise_step, state.infeasible)
    return probe if legal is None else None


def _start_trial(
    state: TuningState, knobs: Knobs, now: datetime, strategy: Strategy = "Rolling"
) -> tuple[TuningState, Trial]:
    """The state of a trial of `knobs` begun now: one new pending trial, counted once. A
    rolling trial applies the knobs to every pod; a canary leaves them on the baseline."""
    trial = Trial(id=state.next_trial_id(), knobs=knobs, started_at=now)
    started = replace(
        state.with_trial(trial),
        applied=state.applied if strategy == "Canary" else knobs,
        candidate=knobs,
        strategy=strategy,
        analysis=None,
        headroom_wait_since=None,
        phase="RollingOut",
        rollout_started_at=now,
        verify_until=None,
        last_rollout_at=now,
        rollouts_today=state.rollouts_today + 1,
    )
    return started, trial


def canary_command(
    state: TuningState, command: str, policy: TuningPolicy, now: datetime
) -> Decision | None:
    """A person's `promote` or `abort` of the running canary (vllm-autotuner promote|abort);
    None when no canary runs (the request is then left unhandled and reported). An abort is
    not the candidate's fault, so nothing is remembered as infeasible."""
    cand = state.candidate
    if state.strategy != "Canary" or cand is None or state.phase not in ("RollingOut", "Verifying"):
        return None
    if command == "abort":
        return _rollback(state, now, "RolledBack", None, "aborted by hand (vllm-autotuner abort)")
    s = replace(state, applied=cand, phase="Promoting", rollout_started_at=now, verify_until=None)
    text = f"canary {cand.describe()} promoted by hand (vllm-autotuner promote)"
    return _done(s, now, "promote", text, cand, (Event("Normal", "CanaryPromoted", text),))
