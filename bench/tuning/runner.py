"""One scenario, every method, one process: the searches, the live runs and the numbers.

Live runs of the offline methods share their common prefix: until its tuning ends, such a
method's deployment is exactly the defaults' deployment (same traffic, same seeds), so the
defaults' world is run once and forked (deep copy) at each switch time, where the fork rolls
out the method's result and runs to the horizon.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.tuning import methods as m
from bench.tuning.scenario import load
from bench.tuning.truth import Truth
from bench.tuning.world import World
from vllm_autotuner.core.tuning_types import Knobs

ALL_METHODS = (
    "defaults", "auto_tune", "random30", "random50", "bo30", "bo50", "ours", "oracle-static",
)  # fmt: skip
QUICK_METHODS = ("defaults", "auto_tune", "random30", "bo30", "ours", "oracle-static")


@dataclass
class Live:
    """What the users of one live run saw (ground truth) and what Prometheus showed."""

    goodput: float
    arrivals: int
    violation_minutes: int  # as Prometheus shows them (histogram_quantile)
    violation_minutes_exact: int  # from exact latencies
    failed_requests: int
    failed_tuning: int  # aborted by a rollout's drain or scale-down, or no ready pod in one
    failed_crash: int
    failed_rejected: int
    failed_tuning_late: int  # of failed_tuning: aborted after missing the TTFT threshold
    unfinished: int  # still queued or running at the horizon: neither good nor failed
    unfinished_late: int  # of those: already past the TTFT threshold
    crashes: int
    replacements: int
    crash_left_standing: bool
    gpu_hours: float  # GPUs held (loading, serving, backing off, draining) x time
    attainment: list[float] = field(default_factory=list)  # -1: no traffic that minute
    failed_per_minute: list[int] = field(default_factory=list)
    failed_tuning_per_minute: list[int] = field(default_factory=list)


def live_stats(w: World) -> Live:
    view = w.minute_view()
    causes = w.failed_by_cause()
    n = len(view.violated)
    unfinished, unfinished_late = w.unfinished()
    return Live(
        goodput=w.goodput(),
        arrivals=w.arrivals(),
        violation_minutes=int(view.violated.sum()),
        violation_minutes_exact=int(view.violated_exact.sum()),
        failed_requests=w.failed(),
        failed_tuning=causes["tuning"],
        failed_crash=causes["crash"],
        failed_rejected=causes["rejected"],
        failed_tuning_late=int(w.acc.failed_tuning_late.sum()),
        unfinished=unfinished,
        unfinished_late=unfinished_late,
        crashes=w.crashes,
        replacements=w.replacements,
        crash_left_standing=w.crash_left_standing(),
        gpu_hours=w.gpu_seconds / 3600.0,
        attainment=[-1.0 if np.isnan(a) else round(float(a), 4) for a in view.attainment],
        failed_per_minute=[int(x) for x in w.acc.failed[:n]],
        failed_tuning_per_minute=[int(x) for x in w.acc.failed_tuning[:n]],
    )


def _prediction(p: m.PredictionPoint) -> dict[str, Any]:
    err = p.error()
    return {
        "t": p.t,
        "role": p.role,
        "knobs": _knobs(p.knobs),
        "predicted": round(p.predicted, 4),
        "true": None if p.true is None else round(p.true, 4),
        "error": None if err is None else round(err, 4),
        "observed_rate": round(p.observed_rate, 4),
        "arrival_rate": round(p.arrival_rate, 4),
        "overloaded": p.overloaded,
    }


def _knobs(k: Knobs) -> dict[str, Any]:
    return k.to_dict()


def _ratio(value: float, base: float) -> float | None:
    """value / base to four decimals (None without a positive base)."""
    return round(value / base, 4) if base > 0 else None


def run_scenario(
    path: str,
    methods: Sequence[str] = ALL_METHODS,
    quick: bool = False,
    model_kind: str = "analytic",
    horizon_s: float | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    s = load(path)
    started = time.monotonic()

    def progress(text: str) -> None:
        line = f"[{s.name} {time.monotonic() - started:6.1f}s] {text}"
        (log or (lambda x: print(x, file=sys.stderr, flush=True)))(line)

    horizon = float(horizon_s if horizon_s is not None else s.horizon_s)
    if quick and horizon_s is None:
        horizon = min(horizon, 3600.0)
    truth = Truth(s)
    oracle_k, oracle_cap = m.run_oracle(s, truth, progress)
    progress(f"oracle {oracle_k.describe()}: {oracle_cap:.2f} req/s per replica")
    defaults = m.vllm_defaults(s)

    tunings: dict[str, m.Tuning] = {"defaults": m.Tuning("defaults", defaults)}
    if "auto_tune" in methods:
        tunings["auto_tune"] = m.auto_tune(s, progress)
    want_random = [x for x in methods if x.startswith("random")]
    if want_random:
        n = max(int(x[len("random") :]) for x in want_random)
        full = m.random_search(s, truth, n, s.seed + 101, progress)
        for x in want_random:
            tunings[x] = m.prefix(full, int(x[len("random") :]), x)
    want_bo = [x for x in methods if x.startswith("bo")]
    if want_bo:
        n = max(int(x[len("bo") :]) for x in want_bo)
        full = m.bayes_opt(s, truth, n, s.seed + 202, progress)
        for x in want_bo:
            tunings[x] = m.prefix(full, int(x[len("bo") :]), x)

    # Live runs of defaults and the offline methods, forking the defaults' world.
    lives: dict[str, Live] = {}
    base = World(s, defaults, horizon)
    offline = sorted(
        (t.tuning_s, name) for name, t in tunings.items() if name not in ("defaults", "ours")
    )
    for ts, name in offline:
        final = tunings[name].final
        if ts >= horizon or final.same_as(defaults):
            continue
        base.advance_to(ts)
        fork = copy.deepcopy(base, memo={id(base.requests): base.requests})
        fork.apply(final)
        fork.advance_to(horizon)
        lives[name] = live_stats(fork)
        progress(f"{name}: live run done (switched at {ts / 60:.0f} min)")
    base.advance_to(horizon)
    lives["defaults"] = live_stats(base)
    for _, name in offline:
        lives.setdefault(name, lives["defaults"])

    trace = m.OursTrace()
    rollbacks = 0
    if "ours" in methods:
        world = World(s, defaults, horizon)
        tunings["ours"], trace, rollbacks = m.run_ours(s, world, model_kind, progress, truth)
        lives["ours"] = live_stats(world)
        progress(f"ours: live run done ({len(tunings['ours'].trials)} trials)")

    # The grid is finite: a search may end between its points. The oracle is the best of the
    # grid and of every configuration any method ended on, all judged by the same truth.
    grid_best = (oracle_k, oracle_cap)
    for tu in tunings.values():
        cap = truth.capacity(tu.final)
        if cap > oracle_cap:
            oracle_k, oracle_cap = tu.final, cap
    if "oracle-static" in methods:  # the best any tuner could do: the oracle from t = 0
        static = World(s, oracle_k, horizon)
        static.advance_to(horizon)
        tunings["oracle-static"] = m.Tuning("oracle-static", oracle_k)
        lives["oracle-static"] = live_stats(static)
        progress(f"oracle-static: live run done ({oracle_k.describe()})")
    base_goodput = lives["defaults"].goodput
    base_gpu_hours = lives["defaults"].gpu_hours
    rows: dict[str, Any] = {}
    for name, tu in tunings.items():
        for tp in tu.trials:
            object.__setattr__(tp, "incumbent_truth", truth.capacity(tp.incumbent))
        cap = truth.capacity(tu.final)
        live = lives[name]
        rows[name] = {
            "final": _knobs(tu.final),
            "capacity": round(cap, 3),
            "ratio": _ratio(cap, oracle_cap),
            "goodput": round(live.goodput, 3),
            "goodput_vs_defaults": _ratio(live.goodput, base_goodput),
            "arrivals": live.arrivals,
            "gpu_hours": round(live.gpu_hours, 3),
            "gpu_hours_vs_defaults": _ratio(live.gpu_hours, base_gpu_hours),
            "trials": len(tu.trials),
            "tuning_minutes": round(tu.tuning_s / 60.0, 1),
            "violation_minutes": live.violation_minutes,
            "violation_minutes_exact": live.violation_minutes_exact,
            "rollbacks": rollbacks if name == "ours" else 0,
            "trial_crashes": tu.trial_crashes,
            "live_crashes": live.crashes,
            "crash_left_standing": live.crash_left_standing,
            "failed_requests": live.failed_requests,
            "failed_tuning": live.failed_tuning,
            "failed_tuning_pct": (
                round(100.0 * live.failed_tuning / live.arrivals, 4) if live.arrivals else 0.0
            ),
            "failed_tuning_late": live.failed_tuning_late,
            "unfinished": live.unfinished,
            "unfinished_late": live.unfinished_late,
            "failed_crash": live.failed_crash,
            "failed_rejected": live.failed_rejected,
            "restarts": live.replacements,
            "best_so_far": [[tp.index, round(tp.incumbent_truth, 3)] for tp in tu.trials],
            "trial_knobs": [
                {**_knobs(tp.knobs), "measured": tp.measured, "failed": tp.failed}
                for tp in tu.trials
            ],
            "attainment_per_minute": live.attainment if name == "ours" else None,
            "failed_per_minute": live.failed_per_minute if name == "ours" else None,
            "failed_tuning_per_minute": live.failed_tuning_per_minute if name == "ours" else None,
        }
    truth.save()
    progress(f"done ({truth.evaluations} ground-truth evaluations)")
    return {
        "scenario": s.name,
        "file": path,
        "key": s.key,
        "description": s.description,
        "horizon_s": horizon,
        "replicas": s.replicas,
        "oracle": {
            "knobs": _knobs(oracle_k),
            "capacity": round(oracle_cap, 3),
            "grid_knobs": _knobs(grid_best[0]),
            "grid_capacity": round(grid_best[1], 3),
            "grid_size": len(m.oracle_configs(s, truth, lambda _: None)),
        },
        "defaults": _knobs(defaults),
        "methods": rows,
        "rollout": {
            "max_surge": s.rollout.max_surge,
            "canary": s.rollout.canary,
            "shutdown_timeout_s": s.rollout.shutdown_timeout_s,
            "pre_stop_s": s.rollout.pre_stop_s,
            "load_time_s": s.rollout.load_time_s,
        },
        "ours_trace": {
            "t": trace.times,
            "knobs": [_knobs(k) for k in trace.knobs],
            "phases": trace.phases,
            "canary": [None if k is None else _knobs(k) for k in trace.canary],
            "actions": [[t, a, r] for t, a, r in trace.actions],
            "predictions": [_prediction(p) for p in trace.predictions],
        },
        "seconds": round(time.monotonic() - started, 1),
    }
