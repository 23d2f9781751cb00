"""`python -m bench.tuning FILE... --out DIR [--methods ...] [--quick]` (docs/benchmarks.md).

A scenario with an `autoscaler:` section runs the autoscaled comparison instead
(bench/tuning/autoscaled.py); its results go to DIR/autoscaled-<name>.json and .md."""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.tuning import autoscaled
from bench.tuning.report import accuracy, table, verdict, write
from bench.tuning.runner import ALL_METHODS, QUICK_METHODS, run_scenario
from bench.tuning.scenario import load


def _one(args: tuple[str, tuple[str, ...], bool, str, float | None]) -> dict[str, Any]:
    path, methods, quick, model, horizon = args
    return run_scenario(path, methods, quick, model, horizon)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tuning", description=__doc__)
    p.add_argument("files", nargs="+", help="scenario YAML files (bench/scenarios/*.yaml)")
    p.add_argument("--out", default="bench/results/tuning", help="output directory")
    p.add_argument("--methods", nargs="+", default=None, help=f"subset of {ALL_METHODS}")
    p.add_argument("--quick", action="store_true", help="1 h horizon, 30-trial budgets only")
    p.add_argument("--jobs", type=int, default=2, help="scenarios run in parallel processes")
    p.add_argument("--model", choices=("analytic", "engine"), default="analytic",
                   help="the operator's performance model (its --performance-model)")  # fmt: skip
    p.add_argument("--horizon", type=float, default=None, help="override every horizon (s)")
    a = p.parse_args(argv)
    methods = tuple(a.methods or (QUICK_METHODS if a.quick else ALL_METHODS))
    unknown = set(methods) - set(ALL_METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; known: {', '.join(ALL_METHODS)}")
    started = time.monotonic()
    scaled = [f for f in a.files if load(f).autoscaler is not None]
    for f in scaled:
        _autoscaled(f, a.model, a.horizon, Path(a.out))
    jobs = [(f, methods, a.quick, a.model, a.horizon) for f in a.files if f not in scaled]
    if not jobs:
        return 0
    if a.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=a.jobs) as pool:
            results = list(pool.map(_one, jobs))
    else:
        results = [_one(j) for j in jobs]
    path = write(results, Path(a.out))
    print(table(results))
    for line in verdict(results):
        print(f"- {line}")
    print("\nThe model's capacity at decision points:")
    for line in accuracy(results):
        print(f"- {line}")
    print(f"\n{path} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


def _autoscaled(path: str, model: str, horizon: float | None, out: Path) -> None:
    result = autoscaled.run_autoscaled(path, model_kind=model, horizon_s=horizon)
    text = (
        autoscaled.table(result)
        + "\n"
        + "\n".join(f"- {line}" for line in autoscaled.verdict(result))
    )
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"autoscaled-{result['scenario']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
