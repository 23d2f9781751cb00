"""A fast fit of the step-time constants: replay once, then optimise on the recorded steps.

A full replay of the fit set takes ~15 s, and coordinate descent needs hundreds of them. But a
steady stage's TPOT is, to first order, the sequence-weighted mean duration of the steps that ran
in it, and the steps (tokens, sequences, KV read, attention pairs) barely change when the
constants move a little. So: replay every steady run once with the current constants, record its
steps, and for candidate constants predict each stage's TPOT as the replayed TPOT times the ratio
of the recorded steps' weighted mean duration under the candidate and under the current
constants; minimise the mean |log(predicted / measured)| with scipy; replay again with the result
and repeat until it settles. Overloaded runs are left to the full objective (fit.py), which
reports the result at the end.

    python -m bench.fidelity.surrogate [RUNS_FILE ...] [--params a,b,...] [--iterations 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from bench.fidelity.fit import CAPPED_AT_ONE, DEFAULT_PARAMS, QUICK_STAGE_S, objective
from vllm_sim.catalog import load_gpu
from vllm_sim.engine import Engine
from vllm_sim.kv import engine_model, kv_dtype_bytes
from vllm_sim.replay import CLIENT, engine_config, replay
from vllm_sim.runs import Run, fit_runs_paths, load_runs
from vllm_sim.steptime import CALIBRATION, Calibration, FloatArray, StepTimeModel


@dataclass
class Steps:
    """The steps one replay ran: start time and the step-time model's four inputs."""

    t: list[float] = field(default_factory=list)
    n_tokens: list[float] = field(default_factory=list)
    n_seqs: list[float] = field(default_factory=list)
    ctx: list[float] = field(default_factory=list)
    pairs: list[float] = field(default_factory=list)

    def add(self, t: float, n: float, s: float, c: float, p: float) -> None:
        self.t.append(t)
        self.n_tokens.append(n)
        self.n_seqs.append(s)
        self.ctx.append(c)
        self.pairs.append(p)

    def arrays(self) -> tuple[FloatArray, ...]:
        return tuple(
            np.asarray(x, dtype=np.float64)
            for x in (self.t, self.n_tokens, self.n_seqs, self.ctx, self.pairs)
        )


def _recorder(steps: Steps) -> object:
    """An on_engine hook that logs every step the engine runs, one by one or skipped ahead."""

    def hook(engine: Engine) -> None:
        st = engine.steptime
        sched = engine.sched
        step_time, decode_times = st.step_time, st.decode_times
        commit_stretch = sched.commit_decode_stretch
        last: list[tuple[int, float]] = []

        def logged_step(n: int, s: int, c: float, p: float) -> float:
            steps.add(engine.now, n, s, c, p)
            return step_time(n, s, c, p)

        def logged_decode(d: int, ctx0: float, k: int) -> FloatArray:
            last[:] = [(d, ctx0)]
            return decode_times(d, ctx0, k)

        def logged_commit(ends: FloatArray) -> tuple[float, int, list[float]]:
            d, ctx0 = last[0]
            for i in range(int(ends.size)):
                ctx = ctx0 + i * d
                steps.add(engine.now, d, d, ctx, ctx + d)
            return commit_stretch(ends)

        st.step_time = logged_step  # type: ignore[method-assign]
        st.decode_times = logged_decode  # type: ignore[method-assign]
        sched.commit_decode_stretch = logged_commit  # type: ignore[method-assign]

    return hook


@dataclass
class Point:
    """One steady stage: its recorded steps, the replayed and the measured TPOT."""

    run: Run
    steps: tuple[FloatArray, ...]
    replayed_ms: float
    measured_ms: float
    base_mean_s: float = 0.0


# The saturated point whose step time no smooth term reaches (docs/fidelity.md): never fitted.
UNFITTED = {"mixtral-8x7b-tp2-reasoning"}


def collect(runs: list[Run], cal: Calibration, seed: int) -> list[Point]:
    """Steady stages, plus the saturated TPOT of the overloaded runs (128 sequences running: the
    step time that decides how many requests beat the client timeout)."""
    points: list[Point] = []
    for run in runs:
        if run.id in UNFITTED:
            continue
        steps = Steps()
        cut = None if run.overloaded else QUICK_STAGE_S
        result = replay(run, seed, CLIENT, cut, calibration=cal,
                        on_engine=_recorder(steps))  # type: ignore[arg-type]  # fmt: skip
        t, n, s, c, p = steps.arrays()
        for m in run.results:
            if m.segment is None or run.workload.rates_assumed or "mean" not in m.tpot_ms:
                continue
            lo, hi = result.segment_bounds(m)
            mask = (t >= lo) & (t < hi) & (s > 0)
            sim = result.stats(m).tpot_ms.get("mean")
            if sim is None or not mask.any():
                continue
            points.append(Point(run, (n[mask], s[mask], c[mask], p[mask]), sim, m.tpot_ms["mean"]))
    return points


def _model(run: Run, cal: Calibration) -> StepTimeModel:

    cfg = engine_config(run)
    model = engine_model(cfg)
    kv = model.kv_bytes_per_token(run.tp, kv_dtype_bytes(cfg.kv_cache_dtype, model))
    return StepTimeModel(model, load_gpu(run.gpu), run.tp, kv, calibration=cal)


def weighted_mean(point: Point, cal: Calibration) -> float:
    n, s, c, p = point.steps
    dt = _model(point.run, cal).step_times(n, s, c, p)
    return float((dt * s).sum() / s.sum())


def surrogate_objective(points: list[Point], cal: Calibration) -> float:
    errs = []
    for pt in points:
        predicted = pt.replayed_ms * weighted_mean(pt, cal) / pt.base_mean_s
        errs.append(abs(math.log(predicted / pt.measured_ms)))
    return sum(errs) / len(errs)


def optimise(points: list[Point], start: Calibration, params: tuple[str, ...]) -> Calibration:
    x0 = np.log([getattr(start, name) for name in params])

    def cal_of(x: FloatArray) -> Calibration:
        values = {name: float(math.exp(v)) for name, v in zip(params, x, strict=True)}
        for name in values:
            if name in CAPPED_AT_ONE:
                values[name] = min(values[name], 1.0)
        return dataclasses.replace(start, **values)

    res = minimize(lambda x: surrogate_objective(points, cal_of(x)), x0, method="Nelder-Mead",
                   options={"maxiter": 3000, "xatol": 1e-3, "fatol": 1e-5})  # fmt: skip
    return cal_of(res.x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fidelity.surrogate", description=__doc__)
    ap.add_argument("runs_files", nargs="*", type=Path)
    ap.add_argument("--params", default=",".join(DEFAULT_PARAMS))
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", default="", metavar="NAME=VALUE,...", help="start from these values")
    args = ap.parse_args(argv)
    files = args.runs_files or fit_runs_paths()
    runs = [r for f in files for r in load_runs(f)]
    params = tuple(x for x in args.params.split(",") if x)
    cal = CALIBRATION
    if args.set:
        cal = dataclasses.replace(
            cal, **{k: float(v) for k, v in (kv.split("=", 1) for kv in args.set.split(","))}
        )
    for i in range(args.iterations):
        t0 = time.perf_counter()
        points = collect(runs, cal, args.seed)
        for pt in points:
            pt.base_mean_s = weighted_mean(pt, cal)
        before = surrogate_objective(points, cal)
        cal = optimise(points, cal, params)
        after = surrogate_objective(points, cal)
        print(f"iteration {i + 1}: {len(points)} points, surrogate {before:.4f} -> {after:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)  # fmt: skip
        print(f"  {cal}", file=sys.stderr)
    full = objective(runs, cal, args.seed, quick=True)
    print(f"full objective (quick replays, overloads included): {full:.4f}")
    print(repr(cal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
