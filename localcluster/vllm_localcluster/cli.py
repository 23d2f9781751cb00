"""`vllm-localcluster`: the one-machine cluster and the demo that runs the operator on it."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_autotuner.cli import POSITIVE


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole closed loop on this machine: a local cluster, vllm-sim pods, "
        "the real Prometheus and the operator; writes a report",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("demo-report"), help="report directory")
    p.add_argument(
        "--time-scale", type=POSITIVE, default=5.0, help="simulated seconds per wall second"
    )
    p.add_argument(
        "--rate", type=POSITIVE, default=5.0, help="requests per simulated second, all pods"
    )
    p.add_argument("--workload", default="rag", help="vllm-sim workload preset")
    p.add_argument(
        "--max-minutes", type=POSITIVE, default=10.0, help="give up converging after this long"
    )
    p.add_argument(
        "--keep-running",
        action="store_true",
        help="after convergence, go on serving, tuning and printing until Ctrl-C; the report "
        "is written at convergence and again at the end",
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from vllm_localcluster.demo import DemoConfig, run_demo

    if shutil.which("prometheus") is None and not Path("/usr/bin/prometheus").exists():
        print(
            "error: the demo needs the Prometheus server binary. On Debian/Ubuntu: "
            "sudo apt-get install --no-install-recommends prometheus (or `make demo`, which "
            "installs it); elsewhere put a Prometheus 2.x/3.x `prometheus` binary on PATH.",
            file=sys.stderr,
        )
        return 2
    config = DemoConfig(
        out=args.out,
        time_scale=args.time_scale,
        rate=args.rate,
        workload=args.workload,
        max_minutes=args.max_minutes,
        keep_running=args.keep_running,
    )
    return run_demo(config)


def _add_cluster(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from vllm_localcluster.cluster import add_arguments

    p = sub.add_parser(
        "cluster",
        help="run the cluster until Ctrl-C: control plane, node agent, Prometheus",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p)


def cmd_cluster(args: argparse.Namespace) -> int:
    from vllm_localcluster.cluster import run

    return run(args)


def _add_controlplane(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "controlplane",
        help="build the control plane's binaries (once), or print where they are",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "action",
        choices=("build", "ensure", "path"),
        help="build: always; ensure: build when missing; path: print the binaries' directory",
    )


def cmd_controlplane(args: argparse.Namespace) -> int:
    from vllm_localcluster.controlplane import binaries

    try:
        if args.action == "build":
            binaries.build()
        found = binaries.ensure() if args.action == "ensure" else binaries.find()
    except (binaries.BuildError, binaries.MissingBinaries) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.action == "path":
        print(found.apiserver.parent)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-localcluster",
        description="A Kubernetes cluster on this machine (pods run as vllm-sim processes) "
        "and the demo that runs the operator on it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    _add_cluster(sub)
    _add_controlplane(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    handlers = {"demo": cmd_demo, "cluster": cmd_cluster, "controlplane": cmd_controlplane}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
