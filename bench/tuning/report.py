"""The benchmark's outputs: a markdown table, a JSON file and PNG plots.

The table is read against the goal of issue 5: ours at 0.97 of the oracle or better on every
scenario, within 4 rollouts at the median, with fewer SLO-violation minutes than any search
baseline and no crash left standing. `verdict` says, goal by goal, whether the run met it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SEARCH = ("auto_tune", "random30", "random50", "bo30", "bo50")


def _knobs(d: dict[str, Any]) -> str:
    return f"{d['maxNumBatchedTokens']}/{d['maxNumSeqs']}/{d['gpuMemoryUtilization']:.2f}"


def table(results: Sequence[dict[str, Any]]) -> str:
    head = (
        "| scenario | method | final mnbt/mns/gmu | capacity ÷ oracle | goodput req/s | "
        "trials | tuning min | SLO-violation min | rollbacks | crashes trials/live | "
        "crash standing | failed req |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|\n"
    )
    rows = []
    for r in results:
        oracle = r["oracle"]
        grid = oracle.get("grid_size", "")
        rows.append(
            f"| {r['scenario']} | oracle | {_knobs(oracle['knobs'])} | 1.000 "
            f"(= {oracle['capacity']:.2f} req/s/replica) | | {grid} (grid) | | | | | | |"
        )
        for name, v in r["methods"].items():
            ratio = "n/a" if v["ratio"] is None else f"{v['ratio']:.3f}"
            rows.append(
                f"| {r['scenario']} | {name} | {_knobs(v['final'])} | {ratio} | "
                f"{v['goodput']:.2f} | {v['trials']} | {v['tuning_minutes']:.0f} | "
                f"{v['violation_minutes']} | {v['rollbacks']} | "
                f"{v['trial_crashes']}/{v['live_crashes']} | "
                f"{'yes' if v['crash_left_standing'] else 'no'} | {v['failed_requests']} |"
            )
    return head + "\n".join(rows) + "\n"


def verdict(results: Sequence[dict[str, Any]]) -> list[str]:
    ours = [(r["scenario"], r["methods"].get("ours"), r) for r in results]
    ours = [(n, o, r) for n, o, r in ours if o is not None]
    if not ours:
        return ["ours was not run"]
    lines = []
    ratios = [(n, o["ratio"] or 0.0) for n, o, _ in ours]
    low = [f"{n} ({x:.3f})" for n, x in ratios if x < 0.97]
    lines.append(
        "capacity >= 0.97 of the oracle on every scenario: "
        + ("MET" if not low else "NOT MET: " + ", ".join(low))
    )
    trials = [o["trials"] for _, o, _ in ours]
    med = statistics.median(trials)
    lines.append(
        f"median rollouts {med:g} (<= 4): {'MET' if med <= 4 else 'NOT MET'} (per scenario: "
        + ", ".join(str(t) for t in trials)
        + ")"
    )
    worse = []
    for n, o, r in ours:
        for b in SEARCH:
            v = r["methods"].get(b)
            if v is not None and o["violation_minutes"] >= v["violation_minutes"]:
                worse.append(f"{n}: {o['violation_minutes']} >= {b} {v['violation_minutes']}")
    lines.append(
        "fewer SLO-violation minutes than every search baseline: "
        + ("MET" if not worse else "NOT MET: " + "; ".join(worse))
    )
    standing = [n for n, o, _ in ours if o["crash_left_standing"]]
    lines.append(
        "no crash left standing: " + ("MET" if not standing else "NOT MET: " + ", ".join(standing))
    )
    return lines


def plot_ours(r: dict[str, Any], path: Path) -> None:
    tr = r["ours_trace"]
    if not tr["t"]:
        return
    t = [x / 60.0 for x in tr["t"]]
    fig, axes = plt.subplots(4, 1, figsize=(9, 8), sharex=True)
    keys = (
        ("maxNumBatchedTokens", "max_num_batched_tokens"),
        ("maxNumSeqs", "max_num_seqs"),
        ("gpuMemoryUtilization", "gpu_memory_utilization"),
    )
    for ax, (key, label) in zip(axes[:3], keys, strict=True):
        ax.step(t, [k[key] for k in tr["knobs"]], where="post")
        ax.set_ylabel(label, fontsize=8)
        for when, action, _ in tr["actions"]:
            if action in ("rollout", "rollback", "commit"):
                color = {"rollout": "tab:blue", "rollback": "tab:red", "commit": "tab:green"}
                ax.axvline(when / 60.0, color=color[action], alpha=0.3, lw=1)
    att = r["methods"]["ours"]["attainment_per_minute"] or []
    xs = [i + 1 for i, a in enumerate(att) if a is not None and a >= 0]
    ys = [a for a in att if a is not None and a >= 0]
    axes[3].plot(xs, ys, lw=0.8)
    axes[3].set_ylabel("SLO attainment\n(1-min window)", fontsize=8)
    axes[3].set_xlabel("minutes (applied knobs; blue rollout, green commit, red rollback)")
    axes[0].set_title(f"{r['scenario']}: ours over time")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_best_so_far(r: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    oracle = r["oracle"]["capacity"]
    for name, v in r["methods"].items():
        pts = v["best_so_far"]
        if name == "defaults":
            ax.axhline(v["capacity"], color="gray", ls=":", label="defaults")
            continue
        if not pts:
            continue
        start = r["methods"]["defaults"]["capacity"]
        xs = [0] + [p[0] for p in pts]
        ax.step(xs, [start] + [p[1] for p in pts], where="post", label=name)
    ax.axhline(oracle, color="black", ls="--", label="oracle")
    ax.set_xlabel("trials (rollouts / server restarts)")
    ax.set_ylabel("true capacity of best-so-far (req/s/replica)")
    ax.set_xscale("symlog", linthresh=10)
    ax.set_title(f"{r['scenario']}: best-so-far capacity against trials")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(results: Sequence[dict[str, Any]], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(list(results), indent=1))
    md = ["# Tuning benchmark", "", table(results), "## Against the goal", ""]
    md += [f"- {line}" for line in verdict(results)]
    md.append("")
    for r in results:
        plot_ours(r, out / f"ours-{r['scenario']}.png")
        plot_best_so_far(r, out / f"best-so-far-{r['scenario']}.png")
        md.append(f"![{r['scenario']} ours](ours-{r['scenario']}.png)")
        md.append(f"![{r['scenario']} best so far](best-so-far-{r['scenario']}.png)")
    path = out / "results.md"
    path.write_text("\n".join(md) + "\n")
    return path
