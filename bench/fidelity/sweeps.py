"""Knob sweeps in the runs files: pairs of runs that differ in exactly one server setting.

A tuner moves `--max-num-batched-tokens`, `--max-num-seqs` and `--gpu-memory-utilization`; the
simulator it stands on must move the latencies the same way real vLLM does when one of them (or
another server setting) changes and nothing else does. This module finds every such pair in a set
of runs, whatever file they come from (same model, GPU, TP, weight precision and workload, one
setting apart), and compares the measured relative change of TPOT and E2E per segment with the
simulated one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_sim.replay import ReplayResult
from vllm_sim.runs import Knobs, Run

# Settings a sweep may move: the knobs, and CPU KV offload (recorded, not simulated).
SETTINGS = (*(f.name for f in dataclasses.fields(Knobs)), "kv_offload")
METRIC_KEYS = (("TPOT mean", "tpot_ms", "mean"), ("E2E mean", "e2e_ms", "mean"))
TOLERANCE_POINTS = 5.0  # |simulated - measured| change, in percentage points
SIGN_THRESHOLD_POINTS = 2.5  # measured changes smaller than this are within run-to-run spread


@dataclass(frozen=True)
class Sweep:
    base: Run
    moved: Run
    setting: str

    @property
    def label(self) -> str:
        old, new = _setting(self.base, self.setting), _setting(self.moved, self.setting)
        return f"{self.setting} {old} -> {new}"


@dataclass(frozen=True)
class SweepPoint:
    """One segment and metric of a sweep: measured and simulated relative change (percent)."""

    sweep: Sweep
    segment: str
    metric: str
    measured_pct: float
    simulated_pct: float

    @property
    def within_tolerance(self) -> bool:
        return abs(self.simulated_pct - self.measured_pct) <= TOLERANCE_POINTS

    @property
    def sign_ok(self) -> bool:
        """The direction agrees, wherever the measured change is beyond run-to-run spread."""
        if abs(self.measured_pct) < SIGN_THRESHOLD_POINTS:
            return True
        return (self.simulated_pct > 0) == (self.measured_pct > 0)

    @property
    def reproduced(self) -> bool:
        return self.within_tolerance and self.sign_ok


def _setting(run: Run, name: str) -> object:
    return run.kv_offload if name == "kv_offload" else getattr(run.knobs, name)


def _group_key(run: Run) -> tuple[object, ...]:
    return (run.model, run.gpu, run.tp, run.quantization, run.workload.name, run.overloaded)


def find_sweeps(runs: Iterable[Run]) -> list[Sweep]:
    """Every pair of runs of a group that differ in one setting, against the group's baseline
    (the run with the most default settings: budget 2048, 128 seqs, utilization 0.9, no
    offload), so that a sweep is always measured from the same reference."""
    groups: dict[tuple[object, ...], list[Run]] = {}
    for run in runs:
        groups.setdefault(_group_key(run), []).append(run)
    defaults = Knobs()
    out: list[Sweep] = []
    for members in groups.values():
        if len(members) < 2:
            continue

        def distance(r: Run) -> int:
            return sum(
                _setting(r, s) != (False if s == "kv_offload" else getattr(defaults, s))
                for s in SETTINGS
            )

        base = min(members, key=distance)
        for run in members:
            if run is base:
                continue
            moved = [s for s in SETTINGS if _setting(run, s) != _setting(base, s)]
            if len(moved) == 1:
                out.append(Sweep(base, run, moved[0]))
    return out


def _change(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return (new / old - 1.0) * 100.0


def sweep_points(sweep: Sweep, results: dict[str, ReplayResult]) -> list[SweepPoint]:
    """Measured vs simulated change for every segment both runs measured (stages only)."""
    base_res, moved_res = results[sweep.base.id], results[sweep.moved.id]
    base_by_seg = {m.segment: m for m in sweep.base.results if m.segment is not None}
    points = []
    for m in sweep.moved.results:
        if m.segment is None or m.segment not in base_by_seg:
            continue
        b = base_by_seg[m.segment]
        sim_new, sim_old = moved_res.stats(m), base_res.stats(b)
        for name, attr, stat in METRIC_KEYS:
            meas = _change(getattr(m, attr).get(stat), getattr(b, attr).get(stat))
            sim = _change(getattr(sim_new, attr).get(stat), getattr(sim_old, attr).get(stat))
            if meas is not None and sim is not None:
                points.append(SweepPoint(sweep, f"S{m.segment}", name, meas, sim))
    return points


def markdown(points: Sequence[SweepPoint]) -> str:
    lines = [
        "| model | GPU | TP | workload | change | seg | metric | measured | simulated | "
        "reproduced |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        b = p.sweep.base
        verdict = "yes" if p.reproduced else "NO"
        lines.append(
            f"| {b.model.split('/')[-1]} | {b.gpu} | {b.tp} | {b.workload.name} | "
            f"{p.sweep.label} | {p.segment} | {p.metric} | {p.measured_pct:+.1f}% | "
            f"{p.simulated_pct:+.1f}% | {verdict} |"
        )
    done = sum(p.reproduced for p in points)
    lines += ["", f"{done} of {len(points)} sweep points reproduced (sign, and size within "
              f"{TOLERANCE_POINTS:g} points)."]  # fmt: skip
    return "\n".join(lines)
