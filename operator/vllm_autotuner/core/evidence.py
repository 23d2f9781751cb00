"""What finished trials measured, as evidence every later prediction must answer to.

The model is calibrated on the window of the knobs that run now, and predicts other knobs from
there. Far from them it can be wrong in a way one window cannot show: on bench/tuning's
chat-8b-h100, calibrated at 512/512, it put 896 batched tokens at 33.9 req/s/pod, and three
canaries of 896 with 360, 512 and 664 sequences each measured about 25 (the truth: 24.5). A
finished trial's canary (or its verified window) measured the capacity of its knobs; the
trials in status are observations, as in Bayesian optimisation.

The search therefore corrects a candidate's predicted capacity by the log residuals
(measured over predicted, both now) of the trials near it, weighted by a Gaussian kernel in
log token budget, log sequences and memory, and shrunk towards no correction. The knobs that
run now are an observation too, with no residual: the current window is their measurement, so
the correction fades towards them.

A canary measured its knobs against the baseline pods over the same window, and that pair is
what the residual compares: the measured ratio of the two over the ratio the model predicts
now. An absolute residual mixes in how far today's window puts the baseline from that
window's: on bench/tuning's code-70b-h200-tp4, canaries measured -4.3 % and +2.2 % against
their baselines, but their absolute capacities sat 10-15 % above what each later window
predicted for the baseline knobs, so the corrections *raised* the next candidates (a "+9.4 %"
that measured -14.5 %), and five canaries in a row lost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_autotuner.core.tuning_types import Knobs, TuningState

# Kernel length scales. The model's KV sizing is close to exact; where it goes wrong is the
# step time against the chunk size, which the token budget sets. So a trial says most about
# knobs within ~25 % of its token budget, and its error carries across sequences (a factor of
# e) and memory (10 points) nearly whole: on chat-8b-h100, with 0.5 and 0.03 there, a loss at
# 896/512/0.92 (measured 25 req/s/pod, predicted 34) corrected 896/256/0.87 by only -4 %, and
# two more canaries of ~900 tokens lost.
SCALE_TOKENS = 0.25
SCALE_SEQS = 1.0
SCALE_GMU = 0.1
# Weight of "no correction" against one observation at the same knobs: the measurement is one
# window, so a trial right on a candidate moves it by 1 / (1 + SHRINK) of its residual.
SHRINK = 0.5
# Residuals are bounded: no single window says a prediction is off more than 3x either way.
MAX_RESIDUAL = math.log(3.0)


@dataclass(frozen=True)
class TrialEvidence:
    """A finished trial's knobs and the capacity per pod measured on its own window; for a
    canary also the baseline's knobs and capacity over the same window."""

    knobs: Knobs
    capacity_rps: float
    baseline_knobs: Knobs | None = None
    baseline_capacity_rps: float | None = None


def evidence_of(state: TuningState) -> tuple[TrialEvidence, ...]:
    """The finished trials that measured a capacity, other than the knobs that run now (their
    current window is newer evidence than any trial of them)."""
    out = []
    for t in state.trials:
        if t.outcome not in ("Committed", "RolledBack") or t.measured is None:
            continue
        cap = t.measured.capacity_rps
        if cap is None or cap <= 0 or t.knobs.same_as(state.applied):
            continue
        base = None if t.baseline is None else t.baseline.capacity_rps
        if t.baseline_knobs is None or base is None or base <= 0:
            out.append(TrialEvidence(t.knobs, cap))
        else:
            out.append(TrialEvidence(t.knobs, cap, t.baseline_knobs, base))
    return tuple(out)


def _weight(a: Knobs, b: Knobs) -> float:
    d2 = (
        (math.log(a.max_num_batched_tokens / b.max_num_batched_tokens) / SCALE_TOKENS) ** 2
        + (math.log(a.max_num_seqs / b.max_num_seqs) / SCALE_SEQS) ** 2
        + ((a.gpu_memory_utilization - b.gpu_memory_utilization) / SCALE_GMU) ** 2
    )
    return math.exp(-0.5 * d2)


def residual(measured: float, predicted: float) -> float | None:
    """log(measured / predicted), bounded; None when the model predicts nothing there."""
    if predicted <= 0 or measured <= 0:
        return None
    r = math.log(measured / predicted)
    return max(-MAX_RESIDUAL, min(MAX_RESIDUAL, r))


def paired_residual(
    measured: float, measured_base: float, predicted: float, predicted_base: float
) -> float | None:
    """log of the measured ratio of a canary to its baseline over the ratio predicted now,
    bounded; None when either side has nothing to compare."""
    if measured_base <= 0 or predicted_base <= 0:
        return None
    return residual(measured / measured_base, predicted / predicted_base)


def correction(k: Knobs, applied: Knobs, residuals: Sequence[tuple[Knobs, float]]) -> float:
    """The log factor to multiply a prediction for `k` by: the kernel-weighted mean of the
    residuals, with the applied knobs' zero residual and SHRINK's zero among them."""
    if not residuals:
        return 0.0
    weights = [(_weight(k, knobs), r) for knobs, r in residuals]
    total = SHRINK + _weight(k, applied) + sum(w for w, _ in weights)
    return sum(w * r for w, r in weights) / total
