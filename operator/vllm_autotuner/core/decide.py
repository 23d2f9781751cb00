"""decide(): one pure step of the tuning loop.

Given what the tuner remembers (TuningState), what it sees now (Observation), the policy and
the clock, return what to do and the state to remember. The operator applies
`knobs_to_apply` (rendering the Deployment from `new_state.applied`), patches status with
`new_state.to_dict()` and emits `events`. Everything that could make a change unsafe is checked
here, in one place, so the property tests can hold decide() to the safety rules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from vllm_autotuner.core.diagnosis import Diagnosis, diagnose
from vllm_autotuner.core.perf_model import Calibration, PerformanceModel, Prediction, Workload
from vllm_autotuner.core.rollout import (
    PodFailure,
    judge,
    measure,
    pod_failure,
    roll_day,
    rollout_blocker,
    rollout_progress,
)
from vllm_autotuner.core.search import SearchResult, allowed, gmu_ceiling, is_forbidden, search
from vllm_autotuner.core.search_memo import SearchInputs, SearchMemo
from vllm_autotuner.core.snapshot import Observation, Snapshot, defect
from vllm_autotuner.core.tuning_types import (
    Action,
    DecisionRecord,
    DeploymentContext,
    Event,
    InfeasibleConfig,
    InfeasibleKind,
    KnobBounds,
    Knobs,
    Phase,
    Predicted,
    Recommendation,
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
        phase: Phase = state.phase if state.phase in ("RollingOut", "Verifying") else "Idle"
        return _done(
            replace(state, phase=phase),
            now,
            "hold",
            f"mode Off: tuning disabled; running {state.applied.describe()}",
        )
    if state.phase in ("RollingOut", "Verifying"):
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
) -> Decision:
    new_state = replace(state, last_decision=DecisionRecord(now, action, reason))
    return Decision(action, reason, new_state, knobs, events, diagnosis, prediction)


def _rollback(
    state: TuningState,
    now: datetime,
    outcome: TrialOutcome,
    kind: InfeasibleKind | None,
    reason: str,
    measured_state: TuningState | None = None,
) -> Decision:
    cand = state.candidate
    trial = state.current_trial()
    s = measured_state or state
    if trial is not None:
        s = s.with_trial(replace(trial, ended_at=now, outcome=outcome, reason=reason))
    if kind is not None and cand is not None:
        s = s.with_infeasible(InfeasibleConfig(cand, reason, now, kind))
    s = replace(
        s,
        applied=state.last_good,
        candidate=None,
        phase="RolledBack",
        rollout_started_at=None,
        verify_until=None,
    )
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
    rules = policy.rollout
    if cand is None:
        return _done(
            replace(state, phase="Observing", applied=state.last_good),
            now,
            "hold",
            f"{state.phase} without a candidate; back to observing {state.last_good.describe()}",
        )
    failure: PodFailure | None = pod_failure(obs.pods, cand)
    if failure is not None:
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

    if state.phase == "RollingOut":
        started = state.rollout_started_at or now
        ready, complete = rollout_progress(obs.pods, cand, ctx.replicas)
        elapsed = (now - started).total_seconds()
        if complete:
            until = now + timedelta(seconds=rules.verify_window_s)
            text = (
                f"rollout of {cand.describe()} complete: {ready}/{ctx.replicas} pods ready "
                f"after {elapsed:.0f} s; verifying for {rules.verify_window_s:.0f} s"
            )
            return _done(
                replace(state, phase="Verifying", verify_until=until),
                now,
                "verify",
                text,
                events=(Event("Normal", "RolloutReady", text),),
            )
        if elapsed > rules.ready_timeout_s:
            return _rollback(
                state,
                now,
                "NotReady",
                "NotReady",
                f"{ready}/{ctx.replicas} pods ready after {elapsed:.0f} s "
                f"(readyTimeout {rules.ready_timeout_s:.0f} s)",
            )
        return _done(
            state,
            now,
            "hold",
            f"rolling out {cand.describe()}: {ready}/{ctx.replicas} pods ready after "
            f"{elapsed:.0f} s (readyTimeout {rules.ready_timeout_s:.0f} s)",
        )

    # Verifying
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
        grace_end = until + timedelta(seconds=rules.verify_window_s)
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

    workload = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
    cal = model.calibrate(snap, cand, ctx, workload, _prior(state))
    pred = model.predict(cand, workload, cal)
    measured = measure(snap, policy.slo, pred.capacity_rps)
    previous_ok: bool | None = None
    if state.baseline is not None:
        raw = replace(workload, safety_margin=1.0)
        previous_ok = model.predict(state.last_good, raw, cal).meets_slo
    verdict = judge(snap, policy.slo, state.baseline, previous_ok)
    trial = state.current_trial()
    if not verdict.keep:
        measured_state = replace(state, calibration=state.calibration)
        if trial is not None:
            measured_state = measured_state.with_trial(replace(trial, measured=measured))
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
        rollout_started_at=None,
        verify_until=None,
        stable_gpu_memory_utilization=max(state.stable_gmu(), cand.gpu_memory_utilization),
        baseline=measured,
        calibration=cal.to_dict(),
    )
    text = (
        f"committed {cand.describe()}: {verdict.reason}; predicted capacity "
        f"{pred.capacity_rps:.2f} req/s/pod"
    )
    return _done(
        s, now, "commit", text, events=(Event("Normal", "TuningCommitted", text),), prediction=pred
    )


def _prior(state: TuningState) -> Calibration | None:
    return Calibration.from_dict(state.calibration) if state.calibration else None


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
    stable = s.stable_gpu_memory_utilization
    if failing.kind == "OOMKilled" and (stable is None or stable >= applied.gpu_memory_utilization):
        stable = fallback.gpu_memory_utilization  # what was "proven stable" was not
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
        stable_gpu_memory_utilization=stable,
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
    applied = state.applied
    snap = obs.snapshot
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
    problem = _unusable(snap, applied, policy)
    if problem is not None:
        return _done(replace(state, phase="Holding"), now, "hold", problem)

    workload = Workload.from_snapshot(snap, policy.slo, policy.safety_margin)
    cal = model.calibrate(snap, applied, ctx, workload, _prior(state))
    current = model.predict(applied, workload, cal)
    diag = diagnose(snap, policy.slo, applied, policy.min_requests_per_window)
    s = replace(state, calibration=cal.to_dict())
    if applied.same_as(state.last_good):
        s = replace(s, baseline=measure(snap, policy.slo, current.capacity_rps))
    if diag.kind == "idle":
        return _done(
            replace(s, phase="Idle", recommendation=None),
            now,
            "hold",
            f"idle: {diag.evidence}",
            diagnosis=diag,
            prediction=current,
        )

    inputs = SearchInputs.of(applied, policy, diag, state)
    if memo is not None and _memo_answers(memo, inputs, workload, cal, now, policy):
        res, conclusion = memo.result, memo.conclusion
    else:
        res, conclusion = _conclude(state, policy, diag, model, workload, cal)
        memo = SearchMemo(now, inputs, workload, cal, res, conclusion)
    summary = f"{diag.kind}: {diag.evidence}; {conclusion}"
    if not res.worth_rollout or res.best is None or res.prediction is None:
        return replace(
            _done(
                replace(s, phase="Observing", recommendation=None),
                now,
                "hold",
                summary,
                diagnosis=diag,
                prediction=res.prediction or current,
            ),
            search_memo=memo,
        )
    best, pred = res.best, res.prediction
    previous = state.recommendation
    changed = previous is None or not previous.knobs.same_as(best)
    rec = Recommendation(
        knobs=best,
        reason=summary,
        predicted=Predicted(pred.capacity_rps, pred.ttft_ms, pred.itl_ms),
        gain_pct=min(res.gain_pct, 1e6),
        # Since when these knobs are recommended: a repeated recommendation keeps its time,
        # so an unchanged conclusion does not rewrite status every reconcile.
        time=now if previous is None or changed else previous.time,
    )
    s = replace(s, phase="Candidate", recommendation=rec)
    if policy.mode == "Recommend":
        text = f"recommend {summary}"
        events = (Event("Normal", "TuningRecommendation", text),) if changed else ()
        return replace(_done(s, now, "recommend", text, None, events, diag, pred), search_memo=memo)
    blocker = rollout_blocker(s, policy.rollout, now)
    if blocker is not None:
        waits = f"{summary}; rollout waits: {blocker}"
        return replace(_done(s, now, "hold", waits, None, (), diag, pred), search_memo=memo)
    s, trial = _start_trial(s, best, now)
    text = f"rollout {best.describe()} (trial {trial.id}, from {applied.describe()}): {summary}"
    return _done(
        s, now, "rollout", text, best, (Event("Normal", "RolloutStarted", text),), diag, pred
    )


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
    gmu_max = gmu_ceiling(inputs.applied, inputs.stable_gmu, inputs.gmu_rise_step)
    return allowed(best, inputs.applied, policy.bounds, gmu_max, inputs.infeasible) is None


def _conclude(
    state: TuningState,
    policy: TuningPolicy,
    diag: Diagnosis,
    model: PerformanceModel,
    workload: Workload,
    cal: Calibration,
) -> tuple[SearchResult, str]:
    """Run the search (and its fallbacks) and say what it found, after the diagnosis."""
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
            stable_gmu=state.stable_gmu(),
            gmu_rise_step=policy.gmu_rise_step,
            min_gain_pct=policy.min_gain_pct,
            slo_violated=diag.violates_slo,
        )

    res = run_search(diag)
    conclusion = res.reason
    if diag.violates_slo and not res.worth_rollout:
        # The diagnosis is a heuristic; when its directions cannot fix a violation, the
        # calibrated model may still know a way (e.g. a larger budget that packs prefill into
        # fewer steps). Safety rules are the same either way.
        free = run_search(None)
        if free.worth_rollout:
            res = free
            conclusion = f"the suggested direction does not help, but {free.reason}"
    if diag.violates_slo and not res.worth_rollout:
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
    """One step along the diagnosis' directions for the batching knobs, inside every rule.

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
    if probe.same_as(applied) or not b.contains(probe) or not b.within_step(applied, probe):
        return None
    if is_forbidden(probe, state.infeasible) is not None:
        return None
    return probe


def _start_trial(state: TuningState, knobs: Knobs, now: datetime) -> tuple[TuningState, Trial]:
    """The state of a rollout of `knobs` begun now: one new pending trial, counted once."""
    trial = Trial(id=state.next_trial_id(), knobs=knobs, started_at=now)
    started = replace(
        state.with_trial(trial),
        applied=knobs,
        candidate=knobs,
        phase="RollingOut",
        rollout_started_at=now,
        verify_until=None,
        last_rollout_at=now,
        rollouts_today=state.rollouts_today + 1,
    )
    return started, trial
