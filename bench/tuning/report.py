"""The benchmark's outputs: a markdown table, a JSON file and PNG plots.

`verdict` says, goal by goal, whether the run met the goals (issues 5, 14 and 19): ours at
0.97 of the oracle or better, within 3 rollouts at the median; no harm (goodput at least the
defaults' and every search baseline's, at most 0.1 % of arrivals failed because of tuning);
SLO-violation minutes no more than the defaults' and within 15 of `oracle-static` wherever the
defaults violate, and fewer than any search baseline's; the model's capacity error at decision
points at most 10 % at the median and 25 % at worst; no crash left standing. `accuracy` gives
the model's capacity error per scenario, applied and proposed knobs apart.
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


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100.0 * x:.0f}%"


def table(results: Sequence[dict[str, Any]]) -> str:
    head = (
        "| scenario | method | final mnbt/mns/gmu | capacity ÷ oracle | goodput req/s | "
        "goodput ÷ defaults | GPU-hours (÷ defaults) | trials | tuning min | "
        "SLO-violation min Prometheus/exact | "
        "rollbacks | crashes trials/live | crash standing | failed req | "
        "failed by tuning (% arrivals; late) | unfinished at the horizon (late) |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|\n"
    )
    rows = []
    for r in results:
        oracle = r["oracle"]
        grid = oracle.get("grid_size", "")
        rows.append(
            f"| {r['scenario']} | oracle | {_knobs(oracle['knobs'])} | 1.000 "
            f"(= {oracle['capacity']:.2f} req/s/replica) | | | | {grid} (grid) | | | | | | | | |"
        )
        for name, v in r["methods"].items():
            ratio = "n/a" if v["ratio"] is None else f"{v['ratio']:.3f}"
            vs = v.get("goodput_vs_defaults")
            rows.append(
                f"| {r['scenario']} | {name} | {_knobs(v['final'])} | {ratio} | "
                f"{v['goodput']:.2f} | {'n/a' if vs is None else f'{vs:.3f}'} | "
                f"{_gpu_hours(v)} | {v['trials']} | {v['tuning_minutes']:.0f} | "
                f"{v['violation_minutes']}/{v['violation_minutes_exact']} | {v['rollbacks']} | "
                f"{v['trial_crashes']}/{v['live_crashes']} | "
                f"{'yes' if v['crash_left_standing'] else 'no'} | {v['failed_requests']} | "
                f"{v['failed_tuning']} ({v['failed_tuning_pct']:.3f}%; "
                f"{v.get('failed_tuning_late', 0)}) | "
                f"{v.get('unfinished', 0)} ({v.get('unfinished_late', 0)}) |"
            )
    return head + "\n".join(rows) + "\n"


def _gpu_hours(v: dict[str, Any]) -> str:
    """The live deployment's GPU-hours and their ratio to the defaults': a canary or a surge
    pod is a GPU its users pay for, whatever it does to the violation minutes."""
    hours, vs = v.get("gpu_hours"), v.get("gpu_hours_vs_defaults")
    if hours is None:
        return "n/a"
    return f"{hours:.2f} ({'n/a' if vs is None else f'{vs:.3f}'})"


def _errors(points: Sequence[dict[str, Any]]) -> list[float]:
    return [abs(p["error"]) for p in points if p["error"] is not None]


def _error_line(label: str, points: Sequence[dict[str, Any]]) -> str:
    errs = _errors(points)
    zero = sum(1 for p in points if p["true"] is not None and p["true"] <= 0)
    over = [p for p in points if p["overloaded"]]
    over_errs = _errors(over)
    text = f"{label}: {len(points)} decisions"
    if zero:
        text += f" ({zero} with true capacity 0, left out)"
    if not errs:
        return text + ", no comparable prediction"
    text += (
        f", |predicted/true - 1| median {_pct(statistics.median(errs))}, worst {_pct(max(errs))}"
    )
    if over:
        worst = _pct(max(over_errs)) if over_errs else "n/a"
        med = _pct(statistics.median(over_errs)) if over_errs else "n/a"
        text += f"; {len(over)} in overloaded windows: median {med}, worst {worst}"
    return text


def accuracy(results: Sequence[dict[str, Any]]) -> list[str]:
    """The model's capacity error at decision points, applied and proposed knobs apart,
    per scenario and over all of them (overloaded windows included and counted)."""
    lines = []
    every: dict[str, list[dict[str, Any]]] = {"applied": [], "proposed": []}
    for r in results:
        preds = r.get("ours_trace", {}).get("predictions") or []
        if "ours" not in r["methods"]:
            continue
        if not preds:
            lines.append(
                f"{r['scenario']}: no predictions recorded (decide() left Decision.predictions "
                "empty)"
            )
            continue
        for role in ("applied", "proposed"):
            pts = [p for p in preds if p["role"] == role]
            every[role] += pts
            lines.append(_error_line(f"{r['scenario']} {role}", pts))
    for role, pts in every.items():
        if pts and len(results) > 1:
            lines.append(_error_line(f"all scenarios {role}", pts))
    return lines


def _capacity_error(results: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    preds = [p for r in results for p in (r.get("ours_trace", {}).get("predictions") or [])]
    errs = _errors(preds)
    if not errs:
        return None
    return statistics.median(errs), max(errs)


def _met(problems: list[str]) -> str:
    return "MET" if not problems else "NOT MET: " + "; ".join(problems)


def verdict(results: Sequence[dict[str, Any]]) -> list[str]:
    ours = [(r["scenario"], r["methods"].get("ours"), r) for r in results]
    ours = [(n, o, r) for n, o, r in ours if o is not None]
    if not ours:
        return ["ours was not run"]
    lines = []
    ratios = [(n, o["ratio"] or 0.0) for n, o, _ in ours]
    low = [f"{n} ({x:.3f})" for n, x in ratios if x < 0.97]
    lines.append("capacity >= 0.97 of the oracle on every scenario: " + _met(low))
    trials = [o["trials"] for _, o, _ in ours]
    med = statistics.median(trials)
    lines.append(
        f"median rollouts {med:g} (<= 3): {'MET' if med <= 3 else 'NOT MET'} (per scenario: "
        + ", ".join(str(t) for t in trials)
        + ")"
    )
    lines += _harm(ours)
    lines += _violations(ours)
    err = _capacity_error(results)
    if err is None:
        lines.append("model capacity error at decision points: NOT MEASURED (no predictions)")
    else:
        ok = err[0] <= 0.10 and err[1] <= 0.25
        lines.append(
            f"model capacity error at decision points median {_pct(err[0])} (<= 10%), worst "
            f"{_pct(err[1])} (<= 25%): {'MET' if ok else 'NOT MET'}"
        )
    standing = [n for n, o, _ in ours if o["crash_left_standing"]]
    lines.append("no crash left standing: " + _met(standing))
    return lines


def _harm(ours: Sequence[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[str]:
    below, beaten, failing = [], [], []
    for n, o, r in ours:
        d = r["methods"].get("defaults")
        if d is not None and o["goodput"] < d["goodput"]:
            below.append(f"{n} ({o['goodput']:.2f} < {d['goodput']:.2f})")
        for b in SEARCH:
            v = r["methods"].get(b)
            if v is not None and o["goodput"] < v["goodput"]:
                beaten.append(f"{n}: {o['goodput']:.2f} < {b} {v['goodput']:.2f}")
        if o["failed_tuning_pct"] > 0.1:
            late = o.get("failed_tuning_late", 0)
            failing.append(
                f"{n} ({o['failed_tuning']} = {o['failed_tuning_pct']:.3f}%, {late} of them "
                "aborted after missing the TTFT threshold)"
            )
    return [
        "ours' goodput >= the defaults' on every scenario: " + _met(below),
        "ours' goodput >= every search baseline's: " + _met(beaten),
        "requests failed because of tuning <= 0.1% of arrivals: " + _met(failing),
    ]


def _violation_problems(
    ours: Sequence[tuple[str, dict[str, Any], dict[str, Any]]], key: str
) -> tuple[list[str], list[str], list[str]]:
    """(worse than the defaults, too far from oracle-static, worse than a search baseline)."""
    worse, far, baseline = [], [], []
    for n, o, r in ours:
        d = r["methods"].get("defaults")
        st = r["methods"].get("oracle-static")
        if d is not None and o[key] > d[key]:
            worse.append(f"{n} ({o[key]} > {d[key]})")
        if d is not None and st is not None and d[key] > 0 and o[key] > st[key] + 15:
            far.append(f"{n} ({o[key]} vs oracle-static {st[key]})")
        for b in SEARCH:
            v = r["methods"].get(b)
            if v is not None and o[key] >= v[key]:
                baseline.append(f"{n}: {o[key]} >= {b} {v[key]}")
    return worse, far, baseline


def _violations(ours: Sequence[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[str]:
    """Judged on the exact latencies (what users got); the Prometheus view is shown beside."""
    worse, far, baseline = _violation_problems(ours, "violation_minutes_exact")
    p_worse, p_far, p_baseline = _violation_problems(ours, "violation_minutes")

    def both(exact: list[str], prom: list[str]) -> str:
        return f"{_met(exact)} (as Prometheus shows them: {_met(prom)})"

    return [
        "SLO-violation minutes (exact) ours <= defaults: " + both(worse, p_worse),
        "SLO-violation minutes (exact) within 15 of oracle-static where the defaults violate: "
        + both(far, p_far),
        "fewer SLO-violation minutes (exact) than every search baseline: "
        + both(baseline, p_baseline),
    ]


def _spans(ts: Sequence[float], on: Sequence[bool]) -> list[tuple[float, float]]:
    """Intervals of consecutive reconciles where `on` holds (in the units of `ts`)."""
    spans: list[tuple[float, float]] = []
    start: float | None = None
    for i, (t, flag) in enumerate(zip(ts, on, strict=True)):
        if flag and start is None:
            start = ts[i - 1] if i > 0 else t
        if not flag and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, ts[-1]))
    return spans


def plot_ours(r: dict[str, Any], path: Path) -> None:
    tr = r["ours_trace"]
    if not tr["t"]:
        return
    t = [x / 60.0 for x in tr["t"]]
    fig, axes = plt.subplots(5, 1, figsize=(9, 10), sharex=True)
    keys = (
        ("maxNumBatchedTokens", "max_num_batched_tokens"),
        ("maxNumSeqs", "max_num_seqs"),
        ("gpuMemoryUtilization", "gpu_memory_utilization"),
    )
    canary = tr.get("canary") or [None] * len(t)
    spans = _spans(t, [c is not None for c in canary])
    promoting = _spans(t, [p == "Promoting" for p in tr.get("phases") or [""] * len(t)])
    color = {"rollout": "tab:blue", "rollback": "tab:red", "commit": "tab:green",
             "promote": "tab:purple"}  # fmt: skip
    for ax, (key, label) in zip(axes[:3], keys, strict=True):
        ax.step(t, [k[key] for k in tr["knobs"]], where="post", label="stable")
        ys = [None if c is None else c[key] for c in canary]
        if any(y is not None for y in ys):
            ax.step(t, [float("nan") if y is None else y for y in ys], where="post",
                    color="tab:orange", label="canary")  # fmt: skip
        ax.set_ylabel(label, fontsize=8)
        for when, action, _ in tr["actions"]:
            if action in color:
                ax.axvline(when / 60.0, color=color[action], alpha=0.3, lw=1)
    for ax in axes:
        for a, b in spans:
            ax.axvspan(a, b, color="tab:orange", alpha=0.12, lw=0)
        for a, b in promoting:
            ax.axvspan(a, b, color="tab:purple", alpha=0.10, lw=0)
    ours = r["methods"]["ours"]
    att = ours["attainment_per_minute"] or []
    xs = [i + 1 for i, a in enumerate(att) if a is not None and a >= 0]
    ys2 = [a for a in att if a is not None and a >= 0]
    axes[3].plot(xs, ys2, lw=0.8)
    axes[3].set_ylabel("SLO attainment\n(1-min window)", fontsize=8)
    failed = ours.get("failed_per_minute") or []
    tuning = ours.get("failed_tuning_per_minute") or []
    minutes = [i + 1 for i in range(len(failed))]
    axes[4].bar(minutes, failed, width=1.0, color="tab:gray", label="failed")
    axes[4].bar(minutes, tuning, width=1.0, color="tab:red", label="failed because of tuning")
    axes[4].set_ylabel("failed requests\nper minute", fontsize=8)
    axes[4].legend(fontsize=7, loc="upper right")
    axes[4].set_xlabel(
        "minutes (blue rollout, purple promote, green commit, red rollback; orange band: "
        "canary, purple band: promoting)",
        fontsize=8,
    )
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
    md += ["", "## The model's capacity at decision points", ""]
    md += [f"- {line}" for line in accuracy(results)]
    md.append("")
    for r in results:
        plot_ours(r, out / f"ours-{r['scenario']}.png")
        plot_best_so_far(r, out / f"best-so-far-{r['scenario']}.png")
        md.append(f"![{r['scenario']} ours](ours-{r['scenario']}.png)")
        md.append(f"![{r['scenario']} best so far](best-so-far-{r['scenario']}.png)")
    path = out / "results.md"
    path.write_text("\n".join(md) + "\n")
    return path
