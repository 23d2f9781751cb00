"""`python -m bench.hostile_prometheus [--scenarios NAME...] [--transports aiohttp api-client]`:
the operator's peak memory and cycle time while Prometheus answers with hostile bodies.

A local server on 127.0.0.1 answers every query with one scenario's body (bench/
hostile_prometheus/answers.py); a fresh child process per scenario imports the whole operator,
runs three observation cycles for 10 deployments of 2 pods through the operator's own
PrometheusSource (the aiohttp transport of `vllm-autotuner run`, or prometheus-api-client of
`vllm-autotuner recommend`) and reports its peak RSS. Goal (issue 15): under 256 MiB for every
scenario, and no cycle longer than the query timeout (10 s) plus a second.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.hostile_prometheus.answers import NAMESPACE, SCENARIOS, pods
from bench.hostile_prometheus.server import Server

GOAL_MIB = 256
TIMEOUT_S = 10.0


CHILD = """
import asyncio, json, resource, sys, time
from datetime import UTC, datetime
import vllm_autotuner.operator  # the whole operator's imports: kopf, aiohttp, pydantic, scipy
from vllm_autotuner.adapters.prometheus import PrometheusSource
from vllm_autotuner.adapters.promql import SnapshotTarget

url, transport, pods_json, ns, timeout = sys.argv[1:6]
by_deployment = {}
for deployment, pod in json.loads(pods_json):
    by_deployment.setdefault(deployment, []).append(pod)
targets = [
    SnapshotTarget(namespace=ns, name=d, pods=tuple(p), since=None, knobs=None, revision=None,
                   window_s=300, model_name="m")
    for d, p in by_deployment.items()
]
def rss():
    # VmHWM: this process's own peak (ru_maxrss would keep the forking parent's across exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

baseline = rss()
source = PrometheusSource(url, timeout_s=float(timeout))
cycles, snaps = [], {}
for _ in range(3):
    t0 = time.monotonic()
    now = datetime.now(UTC)
    if transport == "aiohttp":
        snaps = asyncio.run(source.snapshots(targets, now))
    else:
        snaps = source.snapshots_sync(targets, now)
    cycles.append(time.monotonic() - t0)
available = sum(s.available for s in snaps.values())
reason = next((s.reason for s in snaps.values() if s.reason), "")
print(json.dumps({"baseline_mib": baseline, "peak_mib": rss(), "cycle_s": max(cycles),
                  "available": available, "targets": len(targets), "reason": reason[:110]}))
"""


def run_child(url: str, transport: str, budget_s: float) -> dict[str, Any]:
    env = dict(os.environ)
    cmd = [
        sys.executable, "-c", CHILD, url, transport, json.dumps(pods()), NAMESPACE, str(TIMEOUT_S),
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {budget_s:.0f}s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS))
    parser.add_argument("--transports", nargs="*", default=["aiohttp", "api-client"])
    parser.add_argument("--budget", type=float, default=180.0, help="seconds per child")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    server = Server().start()
    rows: list[dict[str, Any]] = []
    print(
        "| scenario | transport | peak RSS | baseline | slowest cycle | deployments with data |"
        " what the operator said |"
    )
    print("|---|---|---|---|---|---|---|")
    try:
        for name in args.scenarios:
            t0 = time.monotonic()
            server.answer = SCENARIOS[name]()
            print(
                f"# {name}: {len(server.answer.body)} bytes on the wire "
                f"(built in {time.monotonic() - t0:.1f}s)",
                file=sys.stderr,
            )
            for transport in args.transports:
                r = run_child(f"http://127.0.0.1:{server.port}", transport, args.budget)
                r.update(scenario=name, transport=transport)
                rows.append(r)
                if "error" in r:
                    print(f"| {name} | {transport} | - | - | - | - | FAILED: {r['error']} |")
                else:
                    print(
                        f"| {name} | {transport} | {r['peak_mib']:.0f} MiB | "
                        f"{r['baseline_mib']:.0f} MiB | {r['cycle_s']:.1f} s | "
                        f"{r['available']}/{r['targets']} | {r['reason']} |",
                        flush=True,
                    )
    finally:
        server.stop()
    peaks = [r["peak_mib"] for r in rows if "peak_mib" in r]
    slow = [r["cycle_s"] for r in rows if "cycle_s" in r]
    failed = [r for r in rows if "error" in r]
    worst = max(peaks, default=0.0)
    print(
        f"\nworst peak: {worst:.0f} MiB (goal < {GOAL_MIB} MiB: "
        f"{'met' if worst < GOAL_MIB and not failed else 'NOT met'}); slowest cycle "
        f"{max(slow, default=0.0):.1f} s (timeout {TIMEOUT_S:g} s); failed runs: {len(failed)}"
    )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0 if worst < GOAL_MIB and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
