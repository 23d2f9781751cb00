"""The engine's fitted parameters, averaged over the recent windows at the applied knobs.

One window's step-time fit is noisy where the window cannot tell the parameters apart. On
code-70b-h200-tp4 at 8192/1024 (a reality of compute 0.80), consecutive 300 s windows fitted
compute anywhere from 0.62 to 0.95: most steps there are decodes, which bandwidth sets, and a
few prefill-heavy steps decide compute. A candidate on a cliff of that parameter follows the
noise: 512/512 was predicted at 1.56 req/s/pod from one window and at 2.87 from a window two
minutes later (the truth: 1.38), and the second prediction started a canary that could only
lose.

The running mean here is an exponentially weighted mean of the four fitted parameters in the
fit's own units (log efficiencies, admission cost, log jitter). It restarts when the knobs
change (fits at other knobs carry other biases of the model) and is kept in the state's
calibration mapping beside the fit itself.

Once the mean spans an evaluation window it is a second opinion, and it leads (`Fits`,
decide's `_fits`) where this window's fit strays from it: when the two put the applied
knobs' capacity further apart than the model's agreement tolerance and the mean still
explains the window (its SLO percentiles at the measured load agree with the measurement).
decide() then predicts, searches and publishes its model check with the mean, and this
window's fit is the second opinion. Windows at the same knobs measure the same engine, and
where each holds few requests one window's fit can stray far: on a held-out 32B RAG
deployment at 0.13 req/s/pod (engine compute 0.75), the windows of ten minutes fitted
compute from 0.45 to 1.12 while the mean stayed at 0.74-0.77; at 0.45 the window's fit put
the applied knobs' capacity at 0.00 req/s/pod, the mean at 0.23 and the engine's own
parameters at 0.23. It does not lead always: it follows a trend of the fits a window
behind. On bursty-8b-h100 the first windows' fits put the applied knobs at 16.0-18.5
req/s/pod and the later ones at 17-20.5 (the truth: 19.8), and a mean that always led
predicted 16-17.6 for fifteen minutes.

`robust_gain` is what decide() does with both: a change must be predicted to gain from the
lead fit, from the second and, when decide() passes a calibration that carries one, from
the window's fit at the admission-cost bound (`Calibration.at_admission_bound`). The
smallest of the gains is the one it acts on. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_autotuner.core.perf_model import Calibration, PerformanceModel, Workload
from vllm_autotuner.core.tuning_types import Knobs

# The mean's time constant, in evaluation windows: a fit is forgotten at 1/e after two
# windows, so the mean rests on about three windows' worth of independent data (the windows
# of consecutive reconciles overlap).
MEAN_WINDOWS = 2.0

# The fitted step-time parameters the mean follows, as Calibration names them.
_PARAMS = ("bandwidth", "compute", "admit_s", "jitter")
_KEYS = tuple(f"mean_{p}" for p in _PARAMS)
_AT = "mean_at"
_SINCE = "mean_since"


@dataclass(frozen=True)
class ParamMean:
    """The running mean of bandwidth and compute efficiency, admission cost (s) and jitter,
    its last update (`at`, epoch seconds) and when it started (`since`)."""

    bandwidth: float
    compute: float
    admit_s: float
    jitter: float
    at: float
    since: float

    @classmethod
    def start(cls, cal: Calibration, now_s: float) -> ParamMean:
        return cls(cal.bandwidth, cal.compute, cal.admit_s, cal.jitter, now_s, now_s)

    @classmethod
    def from_dict(cls, d: Mapping[str, float]) -> ParamMean | None:
        if any(k not in d for k in (*_KEYS, _AT, _SINCE)):
            return None
        bandwidth, compute, admit_s, jitter = (float(d[k]) for k in _KEYS)
        if min(bandwidth, compute, jitter) <= 0 or admit_s < 0:
            return None
        return cls(bandwidth, compute, admit_s, jitter, float(d[_AT]), float(d[_SINCE]))

    def to_dict(self) -> dict[str, float]:
        values = (self.bandwidth, self.compute, self.admit_s, self.jitter)
        return {**dict(zip(_KEYS, values, strict=True)), _AT: self.at, _SINCE: self.since}

    def span_s(self) -> float:
        """How long the mean has been gathering windows."""
        return self.at - self.since

    def spans(self, window_s: float) -> bool:
        """Whether the mean has gathered an evaluation window (`window_s`): before that it
        rests on the same few windows as the fit, and has no word of its own."""
        return self.span_s() >= window_s

    def calibration(self, cal: Calibration) -> Calibration:
        """`cal` with the mean's step-time parameters (its KV, traffic and API fits kept)."""
        return cal.with_step_times(self.bandwidth, self.compute, self.admit_s, self.jitter)


def updated(
    stored: Mapping[str, float], cal: Calibration, now_s: float, window_s: float
) -> ParamMean | None:
    """The mean after this window's fit `cal` (None when `cal` is not fitted). `stored` is
    the state's calibration mapping from the last reconcile: its mean continues when its fit
    ran at the same knobs, and restarts otherwise. Time-weighted, so a reconcile period
    does not change the mean's memory; a clock that went back restarts it. A fit equal to
    the stored one is no news and leaves the mean as it was."""
    if not cal.fitted:
        return None
    prev = ParamMean.from_dict(stored)
    same_knobs = (
        stored.get("fitted_budget") == cal.fitted_budget
        and stored.get("fitted_seqs") == cal.fitted_seqs
    )
    if prev is None or not same_knobs or now_s < prev.at:
        return ParamMean.start(cal, now_s)
    if _same_fit(stored, cal):
        # No new samples since the last reconcile (the fit is a pure function of the window):
        # nothing to weigh, and nothing to write to status (an idle deployment's reconcile
        # writes nothing, docs/scale.md).
        return prev
    a = 1.0 - math.exp(-(now_s - prev.at) / (MEAN_WINDOWS * max(window_s, 1.0)))

    def log_mean(old: float, new: float) -> float:
        return math.exp(math.log(old) + a * (math.log(new) - math.log(old)))

    return ParamMean(
        bandwidth=log_mean(prev.bandwidth, cal.bandwidth),
        compute=log_mean(prev.compute, cal.compute),
        admit_s=prev.admit_s + a * (cal.admit_s - prev.admit_s),
        jitter=log_mean(prev.jitter, cal.jitter),
        at=now_s,
        since=prev.since,
    )


def _same_fit(stored: Mapping[str, float], cal: Calibration) -> bool:
    return all(stored.get(k) == getattr(cal, k) for k in _PARAMS)


@dataclass(frozen=True)
class Fits:
    """The fits a steady decision weighs: this window's (`window`) and the recent windows'
    mean (`mean`; None when there is none that spans an evaluation window, and so no word of
    its own). The `lead` is the one decide() predicts with: the mean when it leads
    (`mean_leads`, decide's `_fits`), this window's fit otherwise. The `second` is the other
    one, whose word a gain, or a violation the histogram cannot confirm, needs as well (None
    when there is no mean). The mean keeps the window's KV, traffic and API fits and its fit
    at the admission-cost bound (`ParamMean.calibration`)."""

    window: Calibration
    mean: ParamMean | None
    mean_leads: bool = False

    @property
    def lead(self) -> Calibration:
        if self.mean_leads and self.mean is not None:
            return self.mean.calibration(self.window)
        return self.window

    @property
    def second(self) -> Calibration | None:
        if self.mean is None:
            return None
        return self.window if self.mean_leads else self.mean.calibration(self.window)

    def lead_name(self) -> str:
        return _MEAN_NAME if self.mean_leads and self.mean is not None else _WINDOW_NAME

    def second_name(self) -> str:
        return _WINDOW_NAME if self.lead_name() == _MEAN_NAME else _MEAN_NAME


_MEAN_NAME = "the recent windows' mean fit"
_WINDOW_NAME = "this window's fit"


@dataclass(frozen=True)
class RobustGain:
    """The candidate's capacity a decision acts on (`best_rps`, req/s per pod) and the gains
    over the applied knobs (candidate / applied) that the second fit predicts (`second_ratio`;
    None: no second fit, `Fits`) and the lead's fit at the admission-cost bound
    (`bound_ratio`; None: the window rules it out). `second_binds` or `bound_binds` says which
    of them is the smallest gain and so lowered `best_rps` from the lead's prediction (at
    most one)."""

    best_rps: float
    second_ratio: float | None
    second_binds: bool
    bound_ratio: float | None = None
    bound_binds: bool = False

    @property
    def binds(self) -> bool:
        return self.second_binds or self.bound_binds


def robust_gain(
    model: PerformanceModel,
    applied: Knobs,
    best: Knobs,
    workload: Workload,
    cal: Calibration,
    second: Calibration | None,
    current_rps: float,
    best_rps: float,
    *,
    applied_serves: bool = False,
) -> RobustGain:
    """The candidate's capacity at the smallest of three gains over the applied knobs: the
    lead fit's (`cal`; `best_rps` / `current_rps`, already predicted), the second fit's
    (`Fits.second`, None: none) and that of `cal`'s fit at the admission-cost bound
    (`Calibration.at_admission_bound`), each applied to `current_rps`. `applied_serves`: the
    window measured the applied knobs meeting the SLO, so a fit that predicts they serve
    nothing is refuted by the window and has no say (`_under`)."""
    low_s, second_ratio = best_rps, None
    if second is not None:
        low_s, second_ratio = _under(model, applied, best, workload, second, current_rps,
                                     best_rps, applied_serves)  # fmt: skip
    low_b, bound_ratio = best_rps, None
    at_bound = cal.at_admission_bound()
    if at_bound is not None:
        low_b, bound_ratio = _under(model, applied, best, workload, at_bound, current_rps,
                                    best_rps, applied_serves)  # fmt: skip
    low = min(low_s, low_b)
    second_binds = low_s < best_rps and low_s <= low_b
    return RobustGain(
        low, second_ratio, second_binds, bound_ratio, low < best_rps and not second_binds
    )


def _under(
    model: PerformanceModel,
    applied: Knobs,
    best: Knobs,
    workload: Workload,
    other: Calibration,
    current_rps: float,
    best_rps: float,
    applied_serves: bool,
) -> tuple[float, float | None]:
    """The candidate's capacity by another calibration's gain (`current_rps` x its ratio, at
    most `best_rps`), and that ratio (None when it predicts no capacity for the applied
    knobs: then its own word on whether the candidate serves at all, unless the window saw
    the applied knobs meet the SLO while the lead fit predicts they serve).

    A fit that puts the applied knobs' first tokens over the SLO at any rate, where the
    window measured them within it, is contradicted by its own window, and its "the
    candidate serves nothing either" is no gain of zero. A held-out RAG deployment's trough
    window (Qwen2.5-32B, 62 requests at 0.07 req/s/pod) fitted compute efficiency 0.47
    against the recent windows' mean 0.76 (the reality's 0.75), predicted TTFT p95 3.2 s for
    the applied knobs (SLO 3 s, met), and so published a capacity of 0 for the proposal,
    whose truth is 0.22 req/s/pod."""
    now_o = model.predict(applied, workload, other).capacity_rps
    best_o = model.predict(best, workload, other).capacity_rps
    if now_o <= 0 and current_rps > 0 and applied_serves:
        return best_rps, None
    if now_o <= 0 or current_rps <= 0:
        ratio = None if now_o <= 0 else best_o / now_o
        return (best_rps if best_o > 0 else 0.0), ratio
    ratio = best_o / now_o
    return min(best_rps, current_rps * ratio), ratio
