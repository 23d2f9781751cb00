#!/usr/bin/env python3
"""Copy the generated CRDs (crds/*.yaml) into the Helm chart (charts/vllm-autotuner/files/crds/).

crds/ is the single source of truth, generated from the pydantic models. The chart templates
its copy (templates/crds.yaml adds the chart's labels and `helm.sh/resource-policy: keep`), so
that `helm upgrade` and Argo CD upgrade the CRDs too. Run this after `make crds`; with --check
it changes nothing and exits 1 when the copy is stale (tests/unit/ship/test_chart_crds.py fails
in that case too).

    python scripts/sync-chart-crds.py           # sync
    python scripts/sync-chart-crds.py --check   # report drift
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "crds"
TARGET = ROOT / "charts" / "vllm-autotuner" / "files" / "crds"


def plan(source: Path, target: Path) -> tuple[dict[str, bytes], list[str]]:
    """What must be written (name -> bytes) and removed for target to equal source."""
    wanted = {p.name: p.read_bytes() for p in sorted(source.glob("*.yaml"))}
    present = {p.name: p.read_bytes() for p in sorted(target.glob("*.yaml"))}
    writes = {name: data for name, data in wanted.items() if present.get(name) != data}
    removals = sorted(set(present) - set(wanted))
    return writes, removals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the chart's copy drifted")
    parser.add_argument("--source", type=Path, default=SOURCE)
    parser.add_argument("--target", type=Path, default=TARGET)
    args = parser.parse_args(argv)

    if not any(args.source.glob("*.yaml")):
        print(f"error: no CRDs in {args.source}; run `make crds` first", file=sys.stderr)
        return 2
    writes, removals = plan(args.source, args.target)
    if args.check:
        for name in writes:
            print(f"stale: {args.target / name}")
        for name in removals:
            print(f"extra: {args.target / name}")
        return 1 if writes or removals else 0
    args.target.mkdir(parents=True, exist_ok=True)
    for name, data in writes.items():
        (args.target / name).write_bytes(data)
        print(f"wrote {args.target / name}")
    for name in removals:
        (args.target / name).unlink()
        print(f"removed {args.target / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
