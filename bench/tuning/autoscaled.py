"""Tuning beside a replica autoscaler: one scenario with an `autoscaler:` section, six live runs.

The same traffic, the same autoscaler rules; the knobs and the signal differ:

- defaults+capacity: vLLM's defaults (the operator, in mode Recommend, only publishes their
  capacity), the autoscaler on load ÷ capacity;
- defaults+kv, defaults+waiting: vLLM's defaults, the autoscaler on KV-cache usage or on
  waiting requests alone;
- ours+capacity: the operator tunes (mode Auto) and publishes the capacity as it changes;
- ours+kv, ours+waiting: the operator tunes, the autoscaler ignores the capacity.

Each row: the final knobs and their true capacity ÷ the oracle's, the replica-minutes (GPUs held,
loading and draining included), the SLO-violation minutes, goodput, failed requests (and those
failed because of tuning), the scale events and the most replicas, and how far the published
capacity was from the truth at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.tuning import methods as m
from bench.tuning.autoscaler import HPA, SIGNALS, Signal
from bench.tuning.runner import live_stats
from bench.tuning.scenario import load
from bench.tuning.truth import Truth
from bench.tuning.world import World

RUNS: tuple[tuple[str, Signal], ...] = tuple(
    (method, signal) for method in ("defaults", "ours") for signal in SIGNALS
)


def run_autoscaled(
    path: str,
    runs: Sequence[tuple[str, Signal]] = RUNS,
    model_kind: str = "analytic",
    horizon_s: float | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    s = load(path)
    if s.autoscaler is None:
        raise ValueError(f"{path}: no autoscaler section")
    started = time.monotonic()

    def progress(text: str) -> None:
        line = f"[{s.name} {time.monotonic() - started:6.1f}s] {text}"
        (log or (lambda x: print(x, file=sys.stderr, flush=True)))(line)

    horizon = float(horizon_s if horizon_s is not None else s.horizon_s)
    truth = Truth(s)
    oracle_k, oracle_cap = m.run_oracle(s, truth, progress)
    progress(f"oracle {oracle_k.describe()}: {oracle_cap:.2f} req/s per replica")
    rows: dict[str, Any] = {}
    for method, signal in runs:
        hpa = HPA(s.autoscaler, signal)
        world = World(s, m.vllm_defaults(s), horizon, autoscaler=hpa)
        mode = "Auto" if method == "ours" else "Recommend"
        tuning, _, rollbacks = m.run_ours(s, world, model_kind, progress, mode=mode)
        live = live_stats(world)
        final = tuning.final
        true_cap = truth.capacity(final)
        published = hpa.capacity()
        rows[f"{method}+{signal}"] = {
            "final": final.to_dict(),
            "capacity": round(true_cap, 3),
            "ratio": round(true_cap / oracle_cap, 4) if oracle_cap > 0 else None,
            "published_capacity": None if published is None else round(published, 3),
            "published_vs_true": (
                round(published / true_cap, 3) if published is not None and true_cap > 0 else None
            ),
            "replica_minutes": round(world.gpu_seconds / 60.0, 1),
            "mean_replicas": round(world.gpu_seconds / horizon, 2),
            "max_replicas": max(n for _, n in world.replica_timeline),
            "scale_events": len(world.replica_timeline) - 1,
            "replica_timeline": [[round(t), n] for t, n in world.replica_timeline],
            "violation_minutes": live.violation_minutes,
            "violation_minutes_exact": live.violation_minutes_exact,
            "goodput": round(live.goodput, 3),
            "arrivals": live.arrivals,
            "failed_requests": live.failed_requests,
            "failed_tuning": live.failed_tuning,
            "trials": len(tuning.trials),
            "rollbacks": rollbacks,
        }
        row = rows[f"{method}+{signal}"]
        progress(
            f"{method}+{signal}: {row['replica_minutes']:.0f} replica-min, "
            f"{row['violation_minutes']} violation min, {row['scale_events']} scale events, "
            f"final {final.describe()} ({row['ratio']} of the oracle)"
        )
    truth.save()
    return {
        "scenario": s.name,
        "file": path,
        "key": s.key,
        "horizon_s": horizon,
        "autoscaler": vars(s.autoscaler),
        "oracle": {"knobs": oracle_k.to_dict(), "capacity": round(oracle_cap, 3)},
        "runs": rows,
        "seconds": round(time.monotonic() - started, 1),
    }


def _knobs(d: dict[str, Any]) -> str:
    return f"{d['maxNumBatchedTokens']}/{d['maxNumSeqs']}/{d['gpuMemoryUtilization']:.2f}"


def table(result: dict[str, Any]) -> str:
    head = (
        "| run | final mnbt/mns/gmu | capacity ÷ oracle | published ÷ true | replica-min | "
        "mean / max replicas | scale events | SLO-violation min Prometheus/exact | "
        "goodput req/s | failed req (by tuning) | trials |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for name, v in result["runs"].items():
        pub = v["published_vs_true"]
        rows.append(
            f"| {name} | {_knobs(v['final'])} | {v['ratio']:.3f} | "
            f"{'n/a' if pub is None else f'{pub:.2f}'} | {v['replica_minutes']:.0f} | "
            f"{v['mean_replicas']:.2f} / {v['max_replicas']} | {v['scale_events']} | "
            f"{v['violation_minutes']}/{v['violation_minutes_exact']} | {v['goodput']:.2f} | "
            f"{v['failed_requests']} ({v['failed_tuning']}) | {v['trials']} |"
        )
    return head + "\n".join(rows) + "\n"


def verdict(result: dict[str, Any]) -> list[str]:
    """The issue's goals for tuning with an autoscaler in the loop, one line each."""
    runs = result["runs"]
    out = []
    ours, base = runs.get("ours+capacity"), runs.get("defaults+capacity")
    if ours is not None:
        ok = ours["ratio"] is not None and ours["ratio"] >= 0.97
        out.append(
            f"{'MET' if ok else 'NOT MET'}: ours+capacity ends at {ours['ratio']:.3f} of the "
            "oracle's capacity per replica (goal >= 0.97)"
        )
    if ours is not None and base is not None:
        fewer = ours["replica_minutes"] < base["replica_minutes"]
        no_worse = ours["violation_minutes"] <= base["violation_minutes"]
        out.append(
            f"{'MET' if fewer and no_worse else 'NOT MET'}: ours+capacity "
            f"{ours['replica_minutes']:.0f} replica-min and {ours['violation_minutes']} "
            f"violation min vs defaults+capacity {base['replica_minutes']:.0f} and "
            f"{base['violation_minutes']} (goal: fewer replica-minutes, violation minutes no more)"
        )
    for method in ("defaults", "ours"):
        cap = runs.get(f"{method}+capacity")
        for signal in ("kv", "waiting"):
            other = runs.get(f"{method}+{signal}")
            if cap is None or other is None:
                continue
            out.append(
                f"{method}: load/capacity {cap['replica_minutes']:.0f} replica-min, "
                f"{cap['violation_minutes']} violation min; {signal} alone "
                f"{other['replica_minutes']:.0f} replica-min, {other['violation_minutes']} "
                "violation min"
            )
    return out
