"""`python -m bench.tuning.sustained RESULTS.json [--requests 4000]`: is the ground truth's
capacity one the engine sustains?

The ground truth (bench/tuning/truth.py) judges a rate on one run sized by time: a warm-up of
two expected request latencies, a measured window of three (at least `truth.requests` judged)
and a cool-down. A configuration whose latencies stay under the SLO while its running set
grows towards max_num_seqs can still pass such a run at a rate it cannot hold: the queue has
not built yet. This re-measures the final knobs of the oracle, the defaults and ours of a
finished bench.tuning run with the same rate search on fixed runs of `--requests` (the first
10 % warm-up), and prints both capacities and ours ÷ oracle under each. (Until 2026-12-06 the
truth itself was a fixed run of 800 requests; this tool measured it 22 % optimistic.)
With `--decisions` it also measures the sustained capacity of every knob setting the
operator predicted at a decision (results.json's `ours_trace.predictions`) and prints the
model's |error| against both. It never changes
results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import cache
from pathlib import Path
from typing import Any

from bench.tuning.scenario import load
from bench.tuning.truth import Truth, oom_hazard, search_capacity, starts
from vllm_autotuner.core.tuning_types import Knobs

PRECISION = 1.02


@cache
def sustained(scenario_file: str, knobs: Knobs, requests: int) -> tuple[float, float]:
    """(the ground truth's capacity, the same search on runs of `requests`). Remembered: the
    decisions' knobs include the final ones the table measured."""
    s = load(scenario_file)
    short = Truth(s).capacity(knobs)
    if short <= 0 or oom_hazard(s, knobs) or not starts(s, knobs):
        return short, 0.0
    long, _, crashed = search_capacity(s, knobs, requests, s.truth_seed, short, PRECISION)
    return short, 0.0 if crashed else long


def _knobs(d: dict[str, Any]) -> Knobs:
    return Knobs.from_dict(d)


def rows(results: list[dict[str, Any]], requests: int) -> list[str]:
    out = [
        f"| scenario | method | knobs | truth | sustained ({requests} requests) | "
        "sustained ÷ truth |",
        "|---|---|---|---:|---:|---:|",
    ]
    for sc in results:
        picks = {
            "oracle": _knobs(sc["oracle"]["knobs"]),
            "defaults": _knobs(sc["defaults"]),
            "ours": _knobs(sc["methods"]["ours"]["final"]),
        }
        caps: dict[str, tuple[float, float]] = {}
        for method, k in picks.items():
            caps[method] = sustained(sc["file"], k, requests)
            short, long = caps[method]
            ratio = long / short if short > 0 else float("nan")
            line = (
                f"| {sc['scenario']} | {method} | {k.max_num_batched_tokens}/{k.max_num_seqs}/"
                f"{k.gpu_memory_utilization:.2f} | {short:.2f} | {long:.2f} | {ratio:.3f} |"
            )
            print(line, flush=True)
            out.append(line)
        o_short, o_long = caps["oracle"]
        u_short, u_long = caps["ours"]
        if o_short > 0 and o_long > 0:
            print(
                f"  {sc['scenario']}: ours ÷ oracle {u_short / o_short:.3f} (truth), "
                f"{u_long / o_long:.3f} (sustained)",
                flush=True,
            )
    return out


def decision_errors(results: list[dict[str, Any]], requests: int) -> None:
    """The model's capacity error at every decision, against the ground truth and against
    the sustained capacity of the same knobs."""
    every: dict[str, list[float]] = {"truth": [], "sustained": []}
    for sc in results:
        measured: dict[Knobs, tuple[float, float]] = {}
        errs: dict[str, list[float]] = {"truth": [], "sustained": []}
        for p in sc["ours_trace"]["predictions"]:
            k = _knobs(p["knobs"])
            if k not in measured:
                measured[k] = sustained(sc["file"], k, requests)
            short, long = measured[k]
            for name, truth in (("truth", short), ("sustained", long)):
                if truth > 0:
                    errs[name].append(abs(p["predicted"] / truth - 1.0))
        for name, e in errs.items():
            every[name] += e
            if e:
                print(
                    f"  {sc['scenario']} vs {name}: {len(e)} decisions ({len(measured)} knob "
                    f"settings), |error| median {statistics.median(e):.0%}, worst {max(e):.0%}",
                    flush=True,
                )
    for name, e in every.items():
        if e:
            print(
                f"all scenarios vs {name}: {len(e)} decisions, |error| median "
                f"{statistics.median(e):.0%}, worst {max(e):.0%}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="results.json of a bench.tuning run")
    ap.add_argument("--requests", type=int, default=4000, help="requests per judged run")
    ap.add_argument(
        "--decisions", action="store_true", help="also the model's error at every decision"
    )
    args = ap.parse_args(argv)
    if args.requests < 100:
        ap.error("--requests must be at least 100")
    try:
        results = json.loads(args.results.read_text())
    except (OSError, ValueError) as e:
        print(f"cannot read {args.results}: {e}", file=sys.stderr)
        return 2
    rows(results, args.requests)
    if args.decisions:
        decision_errors(results, args.requests)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
