"""`python -m bench.scale.traced run ...`: the operator's CLI under tracemalloc.

BENCH_SCALE_TRACEMALLOC=PATH makes the scale benchmark start the operator through this module;
every 30 s the live allocations are written to PATH grouped by source line and
by file, so the per-deployment memory can be attributed (docs/scale.md).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

from vllm_autotuner import cli


def _report(path: Path) -> None:
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    lines = [f"traced total: {sum(s.size for s in snap.statistics('filename')) / 2**20:.1f} MiB"]
    for group in ("filename", "lineno"):
        lines.append(f"\n# top by {group}")
        for stat in snap.statistics(group)[:40]:
            lines.append(f"{stat.size / 2**20:8.2f} MiB {stat.count:9d} blocks  {stat.traceback}")
    if tracemalloc.get_traceback_limit() > 1:
        lines.append("\n# top by traceback")
        for stat in snap.statistics("traceback")[:25]:
            lines.append(f"{stat.size / 2**20:8.2f} MiB {stat.count:9d} blocks")
            lines.extend(f"      {frame}" for frame in reversed(stat.traceback))
    path.write_text("\n".join(lines) + "\n")


def _every(period_s: float, path: Path) -> None:
    # The benchmark kills an operator that takes long to stop, so report while it runs too;
    # each report is also kept as PATH.<seconds since start> (the start-up storm and the end).
    started = time.monotonic()
    while True:
        time.sleep(period_s)
        _report(path)
        elapsed = round(time.monotonic() - started)
        path.with_name(f"{path.name}.{elapsed:04d}s").write_text(path.read_text())


def main() -> int:
    target = Path(os.environ.get("BENCH_SCALE_TRACEMALLOC") or "tracemalloc.txt")
    # BENCH_SCALE_TRACEMALLOC_FRAMES=N also groups by N-frame tracebacks (slower).
    tracemalloc.start(int(os.environ.get("BENCH_SCALE_TRACEMALLOC_FRAMES") or 1))
    threading.Thread(target=_every, args=(30.0, target), daemon=True).start()
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
