"""Command line: replay every run of the given runs files and print the fidelity table."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.fidelity.report import compare, fit_client_overhead, markdown, to_json
from bench.fidelity.sweeps import find_sweeps, sweep_points
from bench.fidelity.sweeps import markdown as sweeps_markdown
from vllm_sim.replay import CLIENT, replay
from vllm_sim.runs import fit_runs_paths, load_runs
from vllm_sim.steptime import CALIBRATION

QUICK_STAGE_S = 150.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__)
    p.add_argument(
        "runs_files",
        nargs="*",
        type=Path,
        help="runs files (default: the fit set, calibration-h100*.yaml; check.yaml holds the "
        "runs never fitted on)",
    )
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "vllm-sim-fidelity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"cut every stage to {QUICK_STAGE_S:.0f} s at its rate (about 5x faster, noisier);"
        " overloaded runs keep their length (their meaning is the client timeout)",
    )
    p.add_argument("--only", default="", help="replay only runs whose id contains this text")
    p.add_argument(
        "--client-overhead-ms",
        type=float,
        default=CLIENT.overhead_s * 1e3,
        help="client-side latency added to TTFT and E2E (HTTP, streaming, detokenization)",
    )
    p.add_argument(
        "--fit-client-overhead",
        action="store_true",
        help="choose the client overhead that minimises the median TTFT error, and use it",
    )
    p.add_argument(
        "--set",
        default="",
        metavar="NAME=VALUE,...",
        help="override step-time constants (vllm_sim.steptime.Calibration fields) for this run",
    )
    args = p.parse_args(argv)
    calibration = None
    if args.set:
        overrides = dict(kv.split("=", 1) for kv in args.set.split(","))
        unknown = [k for k in overrides if not hasattr(CALIBRATION, k)]
        if unknown:
            print(f"unknown Calibration fields: {', '.join(unknown)}", file=sys.stderr)
            return 2
        calibration = replace(CALIBRATION, **{k: float(v) for k, v in overrides.items()})
        print(f"calibration: {calibration}", file=sys.stderr)
    files = args.runs_files or fit_runs_paths()
    runs = [r for f in files for r in load_runs(f) if args.only in r.id]
    if not runs:
        print("no runs selected", file=sys.stderr)
        return 2
    client = replace(CLIENT, overhead_s=args.client_overhead_ms / 1e3)
    results = []
    t_start = time.perf_counter()
    for i, run in enumerate(runs, 1):
        label = f"[{i}/{len(runs)}] {run.id}"

        def progress(frac: float, label: str = label) -> None:
            print(f"\r{label} {frac:4.0%}", end="", file=sys.stderr, flush=True)

        max_stage_s = QUICK_STAGE_S if args.quick and not run.overloaded else None
        show = progress if sys.stderr.isatty() else None
        result = replay(run, args.seed, client, max_stage_s, show, calibration)
        print(
            f"\r{label} {len(result.records)} requests in {result.wall_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        results.append(result)
    if args.fit_client_overhead:
        client = fit_client_overhead(results, client)
        print(f"fitted client overhead: {client.overhead_s * 1e3:.1f} ms", file=sys.stderr)
    reports = [compare(replace(r, client=client)) for r in results]
    md = markdown(reports, client, args.seed, args.quick)
    by_id = {r.run.id: replace(r, client=client) for r in results}
    sweeps = find_sweeps(r.run for r in results)
    if sweeps:
        points = [p for s in sweeps for p in sweep_points(s, by_id)]
        md += "\nKnob sweeps (measured vs simulated change against the group's baseline):\n\n"
        md += sweeps_markdown(points) + "\n"
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity.md").write_text(md)
    data = to_json(reports, client, args.seed, args.quick)
    (args.out / "fidelity.json").write_text(json.dumps(data, indent=1))
    print(
        f"wrote {args.out / 'fidelity.md'} and fidelity.json "
        f"({time.perf_counter() - t_start:.0f} s in all)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
