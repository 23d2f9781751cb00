"""Fit the engine's step-time constants (vllm_sim.steptime.Calibration) to runs files.

Only the physics is fitted: bandwidth efficiencies and the fixed step, per-sequence and
all-reduce costs, shared by every model, GPU and TP degree, so that what generalises to runs
that are not in the file is the same thing that fits the ones that are. Prefill MFU is left alone
unless asked for: with prefix caching hitting whole prompts the calibration set barely
constrains it.

    python -m bench.fidelity.fit [RUNS_FILE ...] [--params a,b,...] [--rounds N] [--quick]

Coordinate descent on log-scale steps (x1.25, then smaller), each evaluation a replay of every
run (steady runs cut to 150 s with --quick; overloaded runs at full length). The objective is the
mean |log(sim/measured)| of TPOT mean and E2E (p50 where measured, else mean) over the steady
per-stage points, plus half that of the overloaded runs' throughput. It prints the best constants
as a `Calibration(...)` to paste into vllm_sim/steptime.py with a note of what it was fitted on.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import sys
import time
from pathlib import Path

from vllm_sim.replay import CLIENT, replay
from vllm_sim.runs import Run, fit_runs_paths, load_runs
from vllm_sim.steptime import CALIBRATION, Calibration

QUICK_STAGE_S = 150.0
DEFAULT_PARAMS = (
    "eta_bw_weights",
    "eta_bw_kv",
    "eta_mfu",
    "gemm_overlap_loss",
    "c_layer_s",
    "c_host_s",
    "c_seq_s",
    "sampler_s_per_vocab",
    "allreduce_latency_s",
    "eta_link",
    "kv_tail_units_per_sm",
)
CAPPED_AT_ONE = {"eta_bw_weights", "eta_bw_kv", "eta_mfu", "eta_link", "eta_moe",
                 "gemm_overlap_loss"}  # fmt: skip


def _log_err(sim: float | None, measured: float | None) -> float | None:
    if sim is None or measured is None or sim <= 0 or measured <= 0:
        return None
    return abs(math.log(sim / measured))


def objective(runs: list[Run], cal: Calibration, seed: int, quick: bool) -> float:
    steady: list[float] = []
    overload: list[float] = []
    for run in runs:
        cut = QUICK_STAGE_S if quick and not run.overloaded else None
        result = replay(run, seed, CLIENT, cut, calibration=cal)
        for m in run.results:
            if m.segment is None:
                continue
            s = result.stats(m)
            if run.overloaded:
                e = _log_err(s.throughput_rps, m.throughput_rps)
                if e is not None:
                    overload.append(e)
                continue
            if run.workload.rates_assumed:
                continue
            e2e_key = "p50" if "p50" in m.e2e_ms else "mean"
            for e in (
                _log_err(s.tpot_ms.get("mean"), m.tpot_ms.get("mean")),
                _log_err(s.e2e_ms.get(e2e_key), m.e2e_ms.get(e2e_key)),
            ):
                if e is not None:
                    steady.append(e)
    score = sum(steady) / max(1, len(steady))
    if overload:
        score += 0.5 * sum(overload) / len(overload)
    return score


def _score(args: tuple[list[Run], Calibration, int, bool]) -> float:
    return objective(*args)


def fit(
    runs: list[Run],
    start: Calibration,
    params: tuple[str, ...],
    rounds: int,
    seed: int,
    quick: bool,
    jobs: int = 1,
) -> tuple[Calibration, float]:
    """Coordinate descent; with jobs > 1 every move of a round is evaluated at once (in worker
    processes) and the best one taken."""
    best = start
    t0 = time.perf_counter()
    best_score = objective(runs, best, seed, quick)
    print(f"start: {best_score:.4f} ({time.perf_counter() - t0:.0f} s/eval)", file=sys.stderr)
    step = 1.25
    pool = multiprocessing.Pool(jobs) if jobs > 1 else None
    try:
        for rnd in range(rounds):
            moves = []
            for name in params:
                for direction in (step, 1 / step):
                    value = getattr(best, name) * direction
                    if name in CAPPED_AT_ONE:
                        value = min(value, 1.0)
                    if value != getattr(best, name):
                        moves.append((name, value))
            if pool is None:
                improved = False
                for name, value in moves:
                    cand = dataclasses.replace(best, **{name: value})
                    score = objective(runs, cand, seed, quick)
                    if score < best_score - 1e-5:
                        best, best_score, improved = cand, score, True
                        print(f"  {name} = {value:.6g}: {score:.4f}", file=sys.stderr)
                        break
            else:
                cands = [dataclasses.replace(best, **{n: v}) for n, v in moves]
                scores = pool.map(_score, [(runs, c, seed, quick) for c in cands])
                i = min(range(len(scores)), key=scores.__getitem__)
                improved = scores[i] < best_score - 1e-5
                if improved:
                    best, best_score = cands[i], scores[i]
                    print(f"  {moves[i][0]} = {moves[i][1]:.6g}: {best_score:.4f}", file=sys.stderr)
            print(f"round {rnd + 1} (step x{step:.3f}): {best_score:.4f}", file=sys.stderr)
            if not improved:
                step = math.sqrt(step)
                if step < 1.02:
                    break
    finally:
        if pool is not None:
            pool.close()
    return best, best_score


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity.fit", description=__doc__)
    p.add_argument("runs_files", nargs="*", type=Path)
    p.add_argument("--params", default=",".join(DEFAULT_PARAMS))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--jobs", type=int, default=1, help="worker processes for the moves of a round")
    p.add_argument("--only", default="", help="fit on runs whose id contains this text")
    p.add_argument(
        "--set",
        default="",
        metavar="NAME=VALUE,...",
        help="start from these Calibration values (a field at 0 never moves: give it a start)",
    )
    args = p.parse_args(argv)
    files = args.runs_files or fit_runs_paths()
    runs = [r for f in files for r in load_runs(f) if args.only in r.id]
    params = tuple(x for x in args.params.split(",") if x)
    unknown = [x for x in params if not hasattr(CALIBRATION, x)]
    if unknown:
        print(f"unknown Calibration fields: {', '.join(unknown)}", file=sys.stderr)
        return 2
    start = CALIBRATION
    if args.set:
        overrides = {k: float(v) for k, v in (kv.split("=", 1) for kv in args.set.split(","))}
        bad = [k for k in overrides if not hasattr(CALIBRATION, k)]
        if bad:
            print(f"unknown Calibration fields: {', '.join(bad)}", file=sys.stderr)
            return 2
        start = dataclasses.replace(CALIBRATION, **overrides)
    best, score = fit(runs, start, params, args.rounds, args.seed, args.quick, args.jobs)
    print(f"objective {score:.4f} (mean |log error|); fitted on {len(runs)} runs of {files}")
    print(repr(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
