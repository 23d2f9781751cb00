"""Find the next knob setting worth a rollout.

The space is small on purpose: one rollout may move each knob at most its `max_step` from what
runs now, so the search is a brute-force pass (`numeric.grid_argmin`, deterministic) over a
lattice of a few steps per knob around the applied knobs. Safety rules are hard constraints,
never traded for predicted gain:

- inside the policy's bounds and within max_step of the applied knobs;
- gpu_memory_utilization at most `gmu_rise_step` above what is proven stable at the candidate's
  token budget (core/memory.py), and not past it together with a larger budget;
- max_num_batched_tokens >= max_num_seqs (vLLM refuses to start otherwise, vLLM arg_utils.py);
- not a known-infeasible configuration nor in its forbidden neighbourhood (same or higher
  gpu_memory_utilization with a same-or-larger token budget than one that crashed, OOM-ed or
  never became ready: both raise the memory a pod needs);
- each knob moves only in the direction the diagnosis allows.

Among what is left, the candidate must be predicted to meet every SLO target with the safety
margin at the current load; the best has the most predicted capacity. It is worth a rollout
when it fixes a measured SLO violation or gains at least `min_gain_pct` of capacity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from vllm_autotuner.core.diagnosis import Diagnosis
from vllm_autotuner.core.evidence import TrialEvidence, correction, paired_residual, residual
from vllm_autotuner.core.memory import ProvenMemory
from vllm_autotuner.core.perf_model import (
    Calibration,
    PerformanceModel,
    Prediction,
    Screened,
    Workload,
)
from vllm_autotuner.core.steady_state import shared_evaluations
from vllm_autotuner.core.tuning_types import GMU_EPSILON, Bounds, InfeasibleConfig, Knobs

# Rounding grains: token budgets in multiples of 64 (a comfortable multiple of block_size 16
# and of the CUDA-graph capture sizes' step 8/16), sequences in multiples of 8, memory in 1%.
MNBT_GRAIN = 64
MNS_GRAIN = 8
GMU_GRAIN = 0.01
# Points per knob in the coarse pass (log-spaced over what one rollout may reach) and in the
# refinement around the coarse pass's best.
COARSE_POINTS = (8, 5, 3)
FINE_POINTS = (5, 3, 3)
# Candidates that cannot serve the current load at all (the queue grows without bound) rank
# after every one that serves it late: this far above any SLO ratio, less the log of their
# predicted capacity.
OVERLOADED_SCORE = 1e9


@dataclass(frozen=True)
class SearchResult:
    best: Knobs | None
    prediction: Prediction | None
    current: Prediction
    gain_pct: float
    worth_rollout: bool
    reason: str
    evaluated: int


# A trial that lost (Regression) rules out its neighbourhood: knobs within this factor of it on
# both counts, with no more than REGRESSION_GMU more memory (less memory, a smaller KV cache, is
# no cure for a loss), would be judged the same way, and retrying them costs a restart each
# (issue 19: rag-8b-a100 lost at 8896/256/0.90, then tried 8896/256/0.92 and 8128/256/0.85;
# tight-itl lost at 256/176/0.92, then tried 224/176/0.90 and 256/176/0.87; each rejected).
REGRESSION_RATIO = 1.2
REGRESSION_GMU = 0.02


def _near(k: Knobs, lost: Knobs) -> bool:
    def close(x: int, y: int) -> bool:
        return max(x, y) <= REGRESSION_RATIO * min(x, y)

    return (
        close(k.max_num_batched_tokens, lost.max_num_batched_tokens)
        and close(k.max_num_seqs, lost.max_num_seqs)
        and k.gpu_memory_utilization <= lost.gpu_memory_utilization + REGRESSION_GMU + GMU_EPSILON
    )


def is_forbidden(knobs: Knobs, infeasible: Iterable[InfeasibleConfig]) -> str | None:
    """Why `knobs` must not be proposed (None when allowed)."""
    for e in infeasible:
        if knobs.same_as(e.knobs):
            return f"{knobs.describe()} failed before ({e.kind}: {e.reason})"
        if e.kind == "Regression" and _near(knobs, e.knobs):
            return f"within {REGRESSION_RATIO - 1:.0%} of {e.knobs.describe()}, which lost"
        if (
            e.kind != "Regression"
            and knobs.gpu_memory_utilization >= e.knobs.gpu_memory_utilization - GMU_EPSILON
            and knobs.max_num_batched_tokens >= e.knobs.max_num_batched_tokens
        ):
            return (
                f"at or above {e.knobs.describe()}, which failed ({e.kind}) — "
                "same-or-higher memory use is forbidden"
            )
    return None


def gmu_ceiling(applied: Knobs, memory: ProvenMemory, rise_step: float) -> float:
    """The highest gpu_memory_utilization a rollout may set at any token budget (never forces
    a decrease); `allowed` holds each budget to its own."""
    return max(applied.gpu_memory_utilization, memory.highest() + rise_step)


def _grain(value: float, grain: float) -> float:
    """A grain no coarser than a quarter of the value (small budgets keep their resolution)."""
    g = grain
    while g > 1 and g * 4 > value:
        g /= 2
    return g


def _log_axis(
    current: float, lo: float, hi: float, step: float, grain: float, n: int, direction: int
) -> list[float]:
    """`n` log-spaced points over what one rollout may reach, rounded to grains, with the
    current value; only one side of it when the diagnosis fixes a direction."""
    low = max(lo, current - step) if direction <= 0 else current
    high = min(hi, current + step) if direction >= 0 else current
    values = {current}
    if high > low > 0:
        for v in np.geomspace(low, high, n):
            g = _grain(v, grain)
            r = round(v / g) * g
            if low - 1e-9 <= r <= high + 1e-9:
                values.add(r)
    return sorted(values)


def _linear_axis(
    current: float, lo: float, hi: float, step: float, grain: float, n: int, direction: int
) -> list[float]:
    low = max(lo, current - step) if direction <= 0 else current
    high = min(hi, current + step) if direction >= 0 else current
    values = {round(current, 4)}
    if high > low:
        for v in np.linspace(low, high, n):
            values.add(round(round(v / grain) * grain, 4))
        values.add(round(high, 4))
    return sorted(v for v in values if low - 1e-9 <= v <= high + 1e-9 or v == round(current, 4))


def candidate_axes(
    applied: Knobs,
    bounds: Bounds,
    diagnosis: Diagnosis | None,
    gmu_max: float,
    points: tuple[int, int, int] = COARSE_POINTS,
    around: Knobs | None = None,
) -> tuple[list[int], list[int], list[float]]:
    """Each knob's values for one pass: over everything one rollout may reach from `applied`
    (or, in a refinement, a neighbourhood of `around` within that)."""
    d = diagnosis.directions if diagnosis is not None else None
    b = bounds
    centre = around or applied

    def span(
        cur: float, kb_lo: float, kb_hi: float, step: float, app: float
    ) -> tuple[float, float, float]:
        lo = max(kb_lo, app - step)
        hi = min(kb_hi, app + step)
        if around is None:
            return lo, hi, step
        width = max(cur * 0.3, 1e-9)
        return max(lo, cur - width), min(hi, cur + width), width

    lo, hi, st = span(centre.max_num_batched_tokens, b.mnbt.min, b.mnbt.max, b.mnbt.max_step,
                      applied.max_num_batched_tokens)  # fmt: skip
    mnbt = _log_axis(centre.max_num_batched_tokens, lo, hi, st, MNBT_GRAIN, points[0],
                     d.mnbt if d else 0)  # fmt: skip
    lo, hi, st = span(centre.max_num_seqs, b.mns.min, b.mns.max, b.mns.max_step,
                      applied.max_num_seqs)  # fmt: skip
    mns = _log_axis(centre.max_num_seqs, lo, hi, st, MNS_GRAIN, points[1], d.mns if d else 0)
    gmu_hi = min(b.gmu.max, gmu_max)
    gmu = _linear_axis(centre.gpu_memory_utilization, b.gmu.min, gmu_hi, b.gmu.max_step,
                       GMU_GRAIN, points[2], d.gmu if d else 0)  # fmt: skip
    return (
        sorted({round(v) for v in mnbt}),
        sorted({round(v) for v in mns}),
        sorted({round(v, 4) for v in gmu}),
    )


def allowed(
    k: Knobs,
    applied: Knobs,
    bounds: Bounds,
    memory: ProvenMemory,
    rise_step: float,
    infeasible: Sequence[InfeasibleConfig],
) -> str | None:
    """Why `k` violates a hard constraint (None when it is a legal proposal)."""
    if not bounds.contains(k):
        return "outside bounds"
    if not bounds.within_step(applied, k):
        return "more than maxStep from applied"
    past = _past_proof(k, memory)
    if past > rise_step + GMU_EPSILON:
        return "gpu_memory_utilization above what is proven stable at its token budget plus a step"
    if past > GMU_EPSILON and k.max_num_batched_tokens > applied.max_num_batched_tokens:
        return "gpu_memory_utilization above what is proven stable with a larger token budget"
    if k.max_num_batched_tokens < k.max_num_seqs:
        return "maxNumBatchedTokens below maxNumSeqs"
    return is_forbidden(k, infeasible)


def _past_proof(k: Knobs, memory: ProvenMemory) -> float:
    """How far `k`'s gpu_memory_utilization goes past what is proven stable at its token budget
    (core/memory.py); 0 or less when no proof is needed.

    Such a rollout must not also raise the token budget: vLLM sizes the KV cache after
    profiling activations at the budget, so both add to the memory a pod needs at run time,
    and an OOM from a rollout that raised both cannot say which to undo. One memory experiment
    at a time. On bench/tuning's kv-bound-8b-a100-40gb, 0.94 proven at 320 tokens let
    2048/0.92 go to 2368/0.96, which the reality's OOM hazard (above 0.95 with 2,048 tokens or
    more) killed; the moves that won there (to 384/0.97 and 256/0.96) lower the budget."""
    if memory.covers(k):
        return 0.0
    return k.gpu_memory_utilization - memory.at(k.max_num_batched_tokens)


@shared_evaluations()  # candidates re-walk each other's rates: same numbers, less work
def search(
    *,
    applied: Knobs,
    bounds: Bounds,
    model: PerformanceModel,
    workload: Workload,
    calibration: Calibration,
    diagnosis: Diagnosis | None,
    infeasible: Sequence[InfeasibleConfig],
    memory: ProvenMemory,
    gmu_rise_step: float,
    min_gain_pct: float,
    slo_violated: bool,
    max_evaluations: int = 400,
    refine_top: int = 2,
    evidence: Sequence[TrialEvidence] = (),
) -> SearchResult:
    """The best knobs one rollout may reach: a coarse log-spaced pass over the whole reachable
    box, then a finer pass around its best (so a budget can go from 8192 to 704 in one move
    when the model says so). Candidates' capacities answer to what finished trials measured
    (`evidence`, core/evidence.py). Deterministic for the same inputs."""
    gmu_max = gmu_ceiling(applied, memory, gmu_rise_step)
    stage_model, stage_cal = (
        model.screen(calibration) if isinstance(model, Screened) else (model, calibration)
    )
    scorer = _Scorer(
        applied, bounds, memory, gmu_rise_step, infeasible, slo_violated, workload,
        stage_model, stage_cal, _residuals(evidence, model, workload, calibration),
    )  # fmt: skip
    best = scorer.best_of(candidate_axes(applied, bounds, diagnosis, gmu_max), max_evaluations)
    if math.isfinite(scorer.score(best)):
        around = candidate_axes(applied, bounds, diagnosis, gmu_max, FINE_POINTS, around=best)
        best = scorer.best_of(around, max_evaluations)
    best_score, best_pred = scorer.scored(best)
    if best_pred is not None and not best_pred.feasible:
        # Ranked without its capacity (it misses the SLO now); the proposal states it.
        best_pred = scorer.corrected(best, stage_model.predict(best, workload, stage_cal))
    current = model.predict(applied, workload, calibration)
    if isinstance(model, Screened):
        # The slow model judges only the screen's best few (and the current knobs).
        best_score, best_pred = math.inf, None
        for k in scorer.finalists(refine_top):
            p = scorer.corrected(k, model.predict(k, workload, calibration))
            sc = scorer.score_of(k, p)
            if sc < best_score:
                best, best_score, best_pred = k, sc, p
    found = _Found(applied, current, scorer.evaluated(), workload, scorer.residuals)
    if not math.isfinite(best_score) or best_pred is None:
        return found.nothing()
    return found.verdict(best, best_pred, slo_violated, min_gain_pct)


class _Scorer:
    """One search's candidates, each predicted (at most) once and scored: most capacity
    first, among near-equals the smallest move; with the SLO violated, a candidate that
    cannot meet it ranks by how close it comes. Predictions answer to what finished trials
    measured (`residuals`)."""

    def __init__(
        self,
        applied: Knobs,
        bounds: Bounds,
        memory: ProvenMemory,
        gmu_rise_step: float,
        infeasible: Sequence[InfeasibleConfig],
        slo_violated: bool,
        workload: Workload,
        model: PerformanceModel,
        calibration: Calibration,
        residuals: list[tuple[Knobs, float]],
    ) -> None:
        self.applied, self.bounds, self.memory = applied, bounds, memory
        self.gmu_rise_step, self.infeasible = gmu_rise_step, infeasible
        self.slo_violated, self.workload = slo_violated, workload
        self.model, self.calibration, self.residuals = model, calibration, residuals
        self.cache: dict[tuple[int, int, float], tuple[float, Prediction | None]] = {}

    def corrected(self, k: Knobs, p: Prediction) -> Prediction:
        if not self.residuals or not p.feasible or p.capacity_rps <= 0:
            return p
        c = correction(k, self.applied, self.residuals)
        return replace(p, capacity_rps=p.capacity_rps * math.exp(c))

    def score_of(self, k: Knobs, p: Prediction) -> float:
        # Most capacity first; among near-equals, the smallest move (fewer surprises).
        applied = self.applied
        move = (
            abs(math.log(k.max_num_batched_tokens / applied.max_num_batched_tokens))
            + abs(math.log(k.max_num_seqs / applied.max_num_seqs))
            + abs(k.gpu_memory_utilization - applied.gpu_memory_utilization) * 10.0
        )
        if p.feasible:
            return -p.capacity_rps * (1.0 - 1e-3 * move) - 1e-9
        if self.slo_violated and math.isfinite(p.slo_ratio):
            # No candidate may meet the SLO within one step: then the one that comes closest
            # (positive scores always lose to feasible ones).
            return p.slo_ratio * (1.0 + 1e-3 * move)
        if self.slo_violated and p.capacity_rps > 0:
            # Overloaded at this load: the most capacity comes closest to serving it (after
            # every candidate that would serve it, however late).
            c = correction(k, applied, self.residuals)
            return OVERLOADED_SCORE - math.log(p.capacity_rps) - c + 1e-3 * move
        return math.inf

    def _predicted(self, k: Knobs) -> Prediction:
        p = self.model.predict(k, self.workload, self.calibration, capacity=False)
        if self.slo_violated and not p.feasible and not math.isfinite(p.slo_ratio):
            p = self.model.predict(k, self.workload, self.calibration, capacity=True)
        return self.corrected(k, p)

    def scored(self, k: Knobs) -> tuple[float, Prediction | None]:
        """(score, prediction) of `k`; (inf, None) where the rules do not allow it."""
        key = (k.max_num_batched_tokens, k.max_num_seqs, k.gpu_memory_utilization)
        if key not in self.cache:
            why = allowed(
                k, self.applied, self.bounds, self.memory, self.gmu_rise_step, self.infeasible
            )
            if why is not None:
                self.cache[key] = (math.inf, None)
            else:
                p = self._predicted(k)
                self.cache[key] = (self.score_of(k, p), p)
        return self.cache[key]

    def score(self, k: Knobs) -> float:
        return self.scored(k)[0]

    def best_of(self, axes: tuple[list[int], list[int], list[float]], limit: int) -> Knobs:
        grid = [Knobs(t, q, g) for t in axes[0] for q in axes[1] for g in axes[2]]
        return min(grid[:limit], key=lambda k: (self.score(k), k))

    def finalists(self, n: int) -> list[Knobs]:
        """The `n` best-scored candidates that the rules allow and the screen ranked."""
        ranked = sorted(
            (sc, k) for k, (sc, p) in self.cache.items() if p is not None and math.isfinite(sc)
        )
        return [Knobs(*key) for _, key in ranked[:n]]

    def evaluated(self) -> int:
        return sum(1 for _, p in self.cache.values() if p is not None)


@dataclass(frozen=True)
class _Found:
    """What a search concludes about its best candidate, against the applied knobs'
    prediction (`current`), in the words of its reason."""

    applied: Knobs
    current: Prediction
    evaluated: int
    workload: Workload
    residuals: list[tuple[Knobs, float]]

    def nothing(self) -> SearchResult:
        return SearchResult(
            None,
            None,
            self.current,
            0.0,
            False,
            f"no candidate within bounds and steps is predicted to meet the SLO with "
            f"{(1 - self.workload.safety_margin):.0%} margin ({self.evaluated} evaluated)",
            self.evaluated,
        )

    def verdict(
        self, best: Knobs, pred: Prediction, slo_violated: bool, min_gain_pct: float
    ) -> SearchResult:
        """Whether `best` (predicted `pred`) is worth a rollout, and why."""
        current, evaluated = self.current, self.evaluated
        base = current.capacity_rps
        gain = capacity_gain_pct(base, pred.capacity_rps)
        capacity = (
            f"predicted capacity {pred.capacity_rps:.2f} req/s/pod vs {base:.2f} now ({_pct(gain)})"
        )
        note = _evidence_note(best, self.applied, self.residuals)
        numbers = f"{capacity}, TTFT {pred.ttft_ms:.0f} ms, ITL {pred.itl_ms:.1f} ms{note}"
        if best.same_as(self.applied):
            return SearchResult(
                None,
                pred,
                current,
                0.0,
                False,
                f"current knobs are the best of {evaluated} evaluated ({numbers})",
                evaluated,
            )

        def verdict(worth: bool, text: str) -> SearchResult:
            return SearchResult(best, pred, current, gain, worth, text, evaluated)

        if slo_violated and pred.feasible and gain <= 0:
            # Meets the SLO at this load with the margin where the current knobs do not, yet
            # serves no more: the two predictions differ only in headroom at this load, which
            # is within the model's error. bench/tuning made four such rollouts over ten
            # runs; none won.
            return verdict(
                False,
                f"best candidate {best.describe()} is predicted to meet the SLO at this load "
                f"but to serve no more than the current knobs ({numbers})",
            )
        if slo_violated and pred.feasible:
            return verdict(
                True, f"{best.describe()} is predicted to fix the SLO violation: {numbers}"
            )
        if not pred.feasible:
            improvement, text, short = self._short_of_slo(best, pred, gain, capacity, note, numbers)
            worth = improvement >= min_gain_pct
            return verdict(worth, text if worth else f"best candidate {short}: {text}")
        if gain >= min_gain_pct:
            return verdict(True, f"{best.describe()}: {numbers}")
        return verdict(
            False,
            f"best candidate {best.describe()} gains {_pct(gain)}, below the "
            f"{min_gain_pct:g}% worth a rollout ({numbers})",
        )

    def _short_of_slo(
        self, best: Knobs, pred: Prediction, gain: float, capacity: str, note: str, numbers: str
    ) -> tuple[float, str, str]:
        """(improvement in percent, text, what falls short) of a candidate predicted to miss
        the SLO at this load: how much closer to the SLO it comes, or, where every candidate
        is overloaded, how much more capacity it has."""
        current = self.current
        if math.isfinite(pred.slo_ratio):
            improvement = (
                (current.slo_ratio - pred.slo_ratio) / current.slo_ratio * 100.0
                if math.isfinite(current.slo_ratio) and current.slo_ratio > 0
                else 100.0
            )
            text = (
                f"{best.describe()} is predicted to bring the worst SLO target from "
                f"{current.slo_ratio:.0%} to {pred.slo_ratio:.0%} of its threshold "
                f"(the best one step can do; {numbers})"
            )
            return improvement, text, f"improves the SLO by only {improvement:.1f}%"
        # Every candidate overloaded at this load: the most capacity comes closest.
        text = (
            f"{best.describe()} is the most capacity one step can reach, though no "
            f"candidate is predicted to serve {self.workload.request_rate:.2f} req/s/pod "
            f"within the SLO ({capacity}{note})"
        )
        return gain, text, f"gains only {_pct(gain)}"


def _residuals(
    evidence: Sequence[TrialEvidence],
    model: PerformanceModel,
    workload: Workload,
    calibration: Calibration,
) -> list[tuple[Knobs, float]]:
    """(knobs, log of measured over predicted now) for each trial the model predicts; for a
    canary, of its measured ratio to the baseline over the ratio predicted now."""
    out = []
    for e in evidence:
        predicted = model.predict(e.knobs, workload, calibration).capacity_rps
        if e.baseline_knobs is None or e.baseline_capacity_rps is None:
            r = residual(e.capacity_rps, predicted)
        else:
            base = model.predict(e.baseline_knobs, workload, calibration).capacity_rps
            r = paired_residual(e.capacity_rps, e.baseline_capacity_rps, predicted, base)
        if r is not None:
            out.append((e.knobs, r))
    return out


def _evidence_note(k: Knobs, applied: Knobs, residuals: Sequence[tuple[Knobs, float]]) -> str:
    c = correction(k, applied, residuals)
    if abs(c) < 0.01:
        return ""
    shift = _pct((math.exp(c) - 1.0) * 100.0)
    return f" (after {shift} from what {len(residuals)} earlier trials measured)"


def capacity_gain_pct(base_rps: float, new_rps: float) -> float:
    """The gain of capacity from `base_rps` to `new_rps`, in percent (infinite from none)."""
    if base_rps > 0:
        return (new_rps - base_rps) / base_rps * 100.0
    return math.inf if new_rps > 0 else 0.0


def _pct(gain: float) -> str:
    return "+inf%" if math.isinf(gain) else f"{gain:+.1f}%"
