"""Remember the last search per deployment, so a reconcile without new evidence does not redo it.

The search is most of a decision's CPU (about 150 candidate predictions, each a capacity
bisection), and at a thousand deployments on one event loop it is what the operator cannot
afford every reconcile (docs/scale.md). Nor does it need to: a snapshot covers the whole
evaluation window, so two snapshots taken a reconcile interval apart share most of their data,
and a rollout cannot follow a conclusion faster than the policy's minInterval anyway.

A memo answers again only while everything the search's hard constraints depend on is
unchanged (applied knobs, bounds, known-infeasible configurations, the memory proven stable
level, the diagnosis' kind and directions, which SLO targets are violated, what finished trials
measured), the workload and
the calibration have not drifted by more than `DRIFT`, and it is younger than the evaluation
window. Anything else is new evidence and runs the search again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime

from vllm_autotuner.core.diagnosis import Diagnosis, Directions
from vllm_autotuner.core.evidence import TrialEvidence, evidence_of
from vllm_autotuner.core.memory import ProvenMemory
from vllm_autotuner.core.perf_model import Calibration, Workload
from vllm_autotuner.core.search import SearchResult
from vllm_autotuner.core.tuning_types import (
    SLO,
    Bounds,
    InfeasibleConfig,
    Knobs,
    Mode,
    TuningPolicy,
    TuningState,
)

DRIFT = 0.1
"""Relative change of load, lengths or fitted step scales that counts as new evidence: about
what moves a capacity prediction by more than the 5% a rollout must gain by default."""

PREFIX_HIT_DRIFT = 0.05
"""Absolute change of the prefix-cache hit rate (a fraction) that counts as new evidence."""


@dataclass(frozen=True)
class SearchInputs:
    """Everything besides the workload that decides which candidates are legal and preferred."""

    applied: Knobs
    bounds: Bounds
    slo: SLO
    mode: Mode
    safety_margin: float
    min_gain_pct: float
    gmu_rise_step: float
    memory: ProvenMemory
    infeasible: tuple[InfeasibleConfig, ...]
    diagnosis_kind: str
    directions: Directions
    violated: tuple[str, ...]
    evidence: tuple[TrialEvidence, ...] = ()

    @classmethod
    def of(
        cls, applied: Knobs, policy: TuningPolicy, diagnosis: Diagnosis, state: TuningState
    ) -> SearchInputs:
        return cls(
            applied=applied,
            bounds=policy.bounds,
            slo=policy.slo,
            mode=policy.mode,
            safety_margin=policy.safety_margin,
            min_gain_pct=policy.min_gain_pct,
            gmu_rise_step=policy.gmu_rise_step,
            memory=state.memory(),
            infeasible=tuple(state.infeasible),
            diagnosis_kind=diagnosis.kind,
            directions=diagnosis.directions,
            violated=tuple(sorted(v[0] for v in diagnosis.violations)),
            evidence=evidence_of(state),
        )


@dataclass(frozen=True)
class SearchMemo:
    """One search's conclusion: its result, the text after the diagnosis, and its evidence."""

    time: datetime
    inputs: SearchInputs
    workload: Workload
    calibration: Calibration
    result: SearchResult
    conclusion: str
    # The best of the search run again at another fit whose gain bound the candidate's
    # (decide._best_at), per fit ("mean", "bound"); None: that search found none.
    others: tuple[tuple[str, Knobs | None], ...] = ()

    def other(self, fit: str) -> tuple[bool, Knobs | None]:
        """(whether the search at `fit` is remembered, its best)."""
        for name, best in self.others:
            if name == fit:
                return True, best
        return False, None

    def with_other(self, fit: str, best: Knobs | None) -> SearchMemo:
        return replace(self, others=(*self.others, (fit, best)))

    def answers(
        self,
        inputs: SearchInputs,
        workload: Workload,
        calibration: Calibration,
        now: datetime,
        max_age_s: float,
    ) -> bool:
        """Whether this memo may stand in for a new search (see the module docstring)."""
        age = (now - self.time).total_seconds()
        if age < 0 or age >= max_age_s or inputs != self.inputs:
            return False
        w0, w1 = self.workload, workload
        c0, c1 = self.calibration, calibration
        pairs = (
            (w0.request_rate, w1.request_rate),
            (w0.prompt_mean, w1.prompt_mean),
            (w0.prompt_p90, w1.prompt_p90),
            (w0.gen_mean, w1.gen_mean),
            (w0.gen_p90, w1.gen_p90),
            (c0.bandwidth, c1.bandwidth),
            (c0.compute, c1.compute),
        )
        if any(_drifted(a, b) for a, b in pairs):
            return False
        # Small costs (seconds) drift by a few ms before they matter.
        costs = ((c0.admit_s, c1.admit_s), (c0.api_s, c1.api_s))
        if any(abs(a - b) > max(DRIFT * max(a, b), COST_DRIFT_S) for a, b in costs):
            return False
        if abs(w0.prefix_hit_rate - w1.prefix_hit_rate) > PREFIX_HIT_DRIFT:
            return False
        gmu = inputs.applied.gpu_memory_utilization
        kv0, kv1 = c0.kv_tokens_at(gmu), c1.kv_tokens_at(gmu)
        if kv0 is None or kv1 is None:
            return kv0 is None and kv1 is None
        return not _drifted(kv0, kv1)


COST_DRIFT_S = 0.002


def _drifted(a: float, b: float) -> bool:
    scale = max(abs(a), abs(b))
    return scale > 0 and abs(a - b) > DRIFT * scale
