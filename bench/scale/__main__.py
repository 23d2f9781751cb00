"""`python -m bench.scale --deployments 1000 --namespaces 50 [--sizes 10 100] [--cycles N]
[--interval S] [--out DIR]`: the operator at scale, with the numbers docs/scale.md quotes.

Goals (issue 8): p99 reconcile under 1 s, Prometheus queries per cycle independent of the
number of deployments, zero API writes in an idle cycle, operator memory at most 320 MiB
(issue 17: with the kubernetes package; 256 MiB before it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.scale.run import RunResult, run_once, save


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def steady_queries(r: RunResult) -> str:
    """Queries per complete cycle (the first and last groups may be cut by the window)."""
    inner = r.queries_per_cycle[1:-1] or r.queries_per_cycle
    if not inner:
        return "-"
    lo, hi = min(inner), max(inner)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def table(results: list[RunResult]) -> str:
    head = (
        "| deployments | namespaces | converged in | reconcile p50 / p99 (idle) | "
        "p50 / p99 (all) | > 1 s | queries / cycle | idle writes | RSS / peak | CPU |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in results:
        lines.append(
            f"| {r.deployments} | {r.namespaces} | {r.converge_s:.0f} s ({r.converged}) | "
            f"{_ms(r.idle_p50_s)} / {_ms(r.idle_p99_s)} ({r.idle_reconciles}) | "
            f"{_ms(r.reconcile_p50_s)} / {_ms(r.reconcile_p99_s)} | "
            f"{r.reconciles_over_1s}/{r.reconciles_total} | {steady_queries(r)} | "
            f"{r.idle_writes} | {r.rss_mib:.0f} / {r.hwm_mib:.0f} MiB | {r.operator_cpu_s:.0f} s |"
        )
    return "\n".join(lines)


def verdict(results: list[RunResult]) -> list[str]:
    out = []
    for r in results:
        p99 = r.idle_p99_s
        out.append(
            f"{r.deployments}: p99 < 1 s: {'yes' if p99 is not None and p99 < 1 else 'NO'}; "
            f"zero idle writes: {'yes' if r.idle_writes == 0 else 'NO ' + str(r.idle_writes_by_resource)}; "  # noqa: E501
            f"memory <= 320 MiB: {'yes' if r.hwm_mib <= 320 else 'NO'}"
        )
    sizes = [statistics.median(r.queries_per_cycle) for r in results if r.queries_per_cycle]
    if sizes:
        same = max(sizes) == min(sizes)
        out.append(f"queries per cycle constant across sizes: {'yes' if same else 'NO'} {sizes}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    p.add_argument("--deployments", type=int, default=1000)
    p.add_argument("--namespaces", type=int, default=50)
    p.add_argument(
        "--sizes", type=int, nargs="*", default=[10, 100], help="smaller fleets run first"
    )
    p.add_argument("--cycles", type=int, default=3, help="idle reconcile intervals measured")
    p.add_argument("--interval", type=float, default=30.0, help="operator --reconcile-interval")
    p.add_argument("--timeout", type=float, default=900.0, help="convergence limit per size (s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/scale"))
    args = p.parse_args(argv)
    sizes = sorted({*[s for s in args.sizes if s < args.deployments], args.deployments})
    results: list[RunResult] = []
    for n in sizes:
        print(f"running {n} deployments in {min(n, args.namespaces)} namespaces", flush=True)
        results.append(
            run_once(
                n,
                args.namespaces,
                interval_s=args.interval,
                idle_cycles=args.cycles,
                out=args.out,
                timeout_s=args.timeout,
            )
        )
        save(results, args.out)
    text = table(results)
    notes = verdict(results)
    print(text)
    print("\n".join(notes))
    (args.out / "scale.md").write_text(text + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
