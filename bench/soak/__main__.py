"""`python -m bench.soak --deployments N --virtual-hours H --time-scale S [--faults]
[--autoscaler] [--rate R] [--out DIR]`: exits 0 when every check passed (docs/scale.md, "Soak")."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.soak.run import Soak, SoakConfig, save


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    p.add_argument("--deployments", type=int, default=3)
    p.add_argument("--virtual-hours", type=float, default=2.0)
    p.add_argument("--time-scale", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=0.5, help="req per virtual s per deployment")
    p.add_argument(
        "--faults", action="store_true", help="kill pods, restart Prometheus, API errors"
    )
    p.add_argument(
        "--autoscaler",
        action="store_true",
        help="a replica autoscaler owns every count (moves it every 5 virtual minutes)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench/results/soak"))
    args = p.parse_args(argv)
    config = SoakConfig(
        deployments=args.deployments,
        virtual_hours=args.virtual_hours,
        time_scale=args.time_scale,
        rate=args.rate,
        faults=args.faults,
        out=args.out,
        seed=args.seed,
        autoscaler=args.autoscaler,
    )
    print(
        f"soak: {config.deployments} deployments, {config.virtual_hours:g} virtual hours at "
        f"{config.time_scale:g}x ({config.wall_s:.0f}s wall), faults={config.faults}, "
        f"autoscaler={config.autoscaler}",
        flush=True,
    )
    report = Soak(config, log=lambda s: print(s, flush=True)).run()
    save(report, args.out)
    print(f"wall {report.wall_s:.0f}s; rollouts {report.rollouts}, commits {report.commits}, "
          f"rollbacks {report.rollbacks}; trials {report.trials}; requests "
          f"{report.requests_completed} ok / {report.requests_failed} failed; "
          f"operator restarts {report.operator_restarts}")  # fmt: skip
    if config.autoscaler:
        print(f"autoscaler writes {report.autoscaler_writes} "
              f"({len(report.autoscaler_errors)} errors); operator writes to a replica count "
              f"an autoscaler owns {report.operator_writes_to_autoscaled_replicas}")  # fmt: skip
    for fault in report.faults:
        print(f"  fault {fault}")
    for problem in report.problems:
        print(f"  PROBLEM {problem}")
    print("OK" if report.ok else "FAILED")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
