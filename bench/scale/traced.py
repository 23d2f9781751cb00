"""`python -m bench.scale.traced run ...`: the operator's CLI under tracemalloc.

BENCH_SCALE_TRACEMALLOC=PATH makes the scale benchmark start the operator through this module;
every 30 s (BENCH_SCALE_TRACEMALLOC_PERIOD) the live allocations are written to PATH grouped
by source line and by file, so the per-deployment memory can be attributed (docs/scale.md).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

from vllm_autotuner import cli


def _allocators() -> str:
    """glibc's arenas (malloc_info: one <heap> per arena, its free and mapped bytes) and
    pymalloc's (sys._debugmallocstats), as text."""
    import ctypes
    import tempfile

    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as xml:
        stream = libc.fopen(xml.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        arenas = xml.read()
    with tempfile.TemporaryFile("w+") as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        pymalloc = [line for line in err.read().splitlines() if "arena" in line or "#" in line]
    return "\n# glibc arenas\n" + _arenas(arenas) + "\n# pymalloc\n" + "\n".join(pymalloc[-24:])


def _objects() -> str:
    """The garbage collector's objects by type: count and shallow size, the largest first."""
    import gc
    from collections import Counter

    count: Counter[str] = Counter()
    size: Counter[str] = Counter()
    for obj in gc.get_objects():
        name = type(obj).__qualname__
        count[name] += 1
        size[name] += sys.getsizeof(obj)
    rows = [f"{size[k] / 2**20:8.2f} MiB {count[k]:9d}  {k}" for k, _ in size.most_common(40)]
    return "# gc objects by type (shallow)\n" + "\n".join(rows)


def _arenas(xml: str) -> str:
    """One line per glibc arena from malloc_info's XML: mapped and free MiB."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml)
    mib = 2**20
    lines = []
    for heap in [*root.findall("heap"), root]:
        free = sum(int(t.get("size", 0)) for t in heap.findall("total") if t.get("type") != "mmap")
        mapped = sum(
            int(t.get("size", 0)) for t in heap.findall("system") if t.get("type") == "current"
        )
        mmap = sum(int(t.get("size", 0)) for t in heap.findall("total") if t.get("type") == "mmap")
        name = f"arena {heap.get('nr')}" if heap is not root else "all"
        lines.append(
            f"{name}: {mapped / mib:.1f} MiB mapped, {free / mib:.1f} MiB free, "
            f"{mmap / mib:.1f} MiB in mmap"
        )
    return "\n".join(lines)


def _report(path: Path) -> None:
    if not tracemalloc.is_tracing():
        status = Path("/proc/self/status").read_text().splitlines()
        memory = [line for line in status if line.startswith(("VmRSS", "VmHWM", "RssAnon"))]
        path.write_text(", ".join(memory) + "\n" + _allocators() + "\n" + _objects() + "\n")
        return
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    current, peak = tracemalloc.get_traced_memory()
    status = Path("/proc/self/status").read_text().splitlines()
    memory = [line for line in status if line.startswith(("VmRSS", "VmHWM", "RssAnon"))]
    lines = [
        f"traced total: {sum(s.size for s in snap.statistics('filename')) / 2**20:.1f} MiB",
        f"traced now / peak: {current / 2**20:.1f} / {peak / 2**20:.1f} MiB; tracemalloc's own: "
        f"{tracemalloc.get_tracemalloc_memory() / 2**20:.1f} MiB; " + ", ".join(memory),
    ]
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
    # BENCH_SCALE_TRACEMALLOC_FRAMES=N also groups by N-frame tracebacks (slower); 0 traces
    # nothing and reports the allocators' own statistics instead (glibc arenas, pymalloc).
    frames = int(os.environ.get("BENCH_SCALE_TRACEMALLOC_FRAMES") or 1)
    if frames:
        tracemalloc.start(frames)
    period_s = float(os.environ.get("BENCH_SCALE_TRACEMALLOC_PERIOD") or 30)
    threading.Thread(target=_every, args=(period_s, target), daemon=True).start()
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
