"""`python -m bench.scale.traced run ...`: the operator's CLI under tracemalloc.

BENCH_SCALE_TRACEMALLOC=PATH makes the scale benchmark start the operator through this module;
when the operator stops, the live allocations are written to PATH grouped by source line and
by file, so the per-deployment memory can be attributed (docs/scale.md).
"""

from __future__ import annotations

import os
import sys
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
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    target = Path(os.environ.get("BENCH_SCALE_TRACEMALLOC") or "tracemalloc.txt")
    tracemalloc.start(1)
    try:
        return cli.main(sys.argv[1:])
    finally:
        _report(target)


if __name__ == "__main__":
    sys.exit(main())
