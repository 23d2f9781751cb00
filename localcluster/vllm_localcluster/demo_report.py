"""The demo's report: what the operator did, in a picture and a page.

A person wants to see at a glance that the knobs moved, that ITL came down under its SLO, when
each candidate ran as a canary on one pod and how it compared with the baseline pods, when it
was promoted, committed or rejected, and what all that cost in failed requests; the markdown
page holds the numbers, the decisions and the Events in time order.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_localcluster.narration import in_time_order, latency, percentile_label

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from vllm_localcluster.demo import Sample, Timeline, Traffic

# How each decision that changes the pods is marked on every panel.
MARKERS = {
    "rollout": ("tab:purple", "--", "rollout"),
    "canary": ("tab:purple", "--", "canary started"),
    "promote": ("tab:cyan", "-", "canary promoted"),
    "commit": ("tab:green", "-", "commit"),
    "reject": ("tab:red", "--", "canary rejected"),
    "rollback": ("tab:red", "-", "rollback"),
}
CANARY_SPAN = "canary on one pod"


def _knob(label: str | None, name: str) -> float | None:
    """One knob of a `mnbt=..,mns=..,gmu=..` label (None when absent)."""
    parts = dict(p.split("=", 1) for p in (label or "").split(",") if "=" in p)
    value = parts.get(name, "None")
    return None if value == "None" else float(value)


def _knob_series(samples: Sequence[Sample]) -> tuple[list[float | None], list[float | None]]:
    """--max-num-batched-tokens and --max-num-seqs applied at each sample."""
    return [_knob(s.applied, "mnbt") for s in samples], [_knob(s.applied, "mns") for s in samples]


def canary_spans(samples: Sequence[Sample]) -> list[tuple[float, float, str]]:
    """(start, end, knobs) in seconds of each stretch of samples during which a canary ran."""
    spans: list[tuple[float, float, str]] = []
    start: Sample | None = None
    for before, after in itertools.pairwise([*samples, None]):
        if before is None:  # only the end marker comes after the last sample
            break
        if before.canary is not None and start is None:
            start = before
        ends = after is None or after.canary != before.canary
        if start is not None and ends:
            spans.append((start.t, before.t if after is None else after.t, str(start.canary)))
            start = None
    return spans


def failures_per_minute(samples: Sequence[Sample]) -> list[float | None]:
    """Requests the Service failed, per wall minute, between consecutive samples."""
    out: list[float | None] = [None]
    for before, after in itertools.pairwise(samples):
        dt = after.t - before.t
        out.append(60.0 * max(0, after.failed - before.failed) / dt if dt > 0 else None)
    return out


def _mark_decisions(axes: Sequence[Axes], timeline: Timeline) -> None:
    """A vertical line per rollout, canary, promotion, commit and rollback on every panel, once
    in the legend; a shaded band while a canary runs beside the baseline pods."""
    for i, (start, end, _) in enumerate(canary_spans(timeline.samples)):
        for j, axis in enumerate(axes):
            label = CANARY_SPAN if i == 0 and j == 0 else None
            axis.axvspan(start / 60.0, end / 60.0, color="tab:purple", alpha=0.08, label=label)
    seen: set[str] = set()
    for when, action, _ in timeline.decisions:
        if action not in MARKERS:
            continue
        color, style, label = MARKERS[action]
        for i, axis in enumerate(axes):
            first = i == 0 and action not in seen
            axis.axvline(when / 60.0, color=color, linestyle=style, alpha=0.6,
                         label=label if first else None)  # fmt: skip
        seen.add(action)


def _legend(left: Axes, right: Axes) -> list[str]:
    """One legend for a panel with two y axes; its labels."""
    handles, names = left.get_legend_handles_labels()
    more_handles, more_names = right.get_legend_handles_labels()
    left.legend([*handles, *more_handles], [*names, *more_names], loc="upper right", fontsize=8)
    return [*names, *more_names]


def _plot(path: Path, timeline: Timeline, policy: dict[str, Any]) -> list[str]:
    """Writes timeline.png; the labels of its first panel's legend (for tests)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = policy["spec"]["slo"]
    itl, ttft = percentile_label("itl", slo), percentile_label("ttft", slo)
    samples = timeline.samples
    t = [s.t / 60.0 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax = axes[0]
    ax.plot(t, [s.itl_ms for s in samples], label=itl, color="tab:blue")
    ax.axhline(slo["itl"]["thresholdMs"], color="tab:blue", linestyle=":", label="ITL SLO")
    paired = [s for s in samples if s.canary_itl is not None and s.baseline_itl is not None]
    if paired:
        ax.plot([s.t / 60.0 for s in paired], [s.canary_itl for s in paired], "o",
                color="tab:purple", markersize=3, label=f"{itl}, canary pod")  # fmt: skip
        ax.plot([s.t / 60.0 for s in paired], [s.baseline_itl for s in paired], "x",
                color="tab:gray", markersize=3, label=f"{itl}, baseline pods")  # fmt: skip
    ax2 = ax.twinx()
    ax2.plot(t, [s.ttft_ms for s in samples], label=ttft, color="tab:orange")
    ax2.axhline(slo["ttft"]["thresholdMs"], color="tab:orange", linestyle=":", label="TTFT SLO")
    ax.set_ylabel(f"{itl} (ms)")
    ax2.set_ylabel(f"{ttft} (ms)")
    ax.set_title(
        "Latency against the SLO (Prometheus, as the operator saw it; "
        "stable pods, and the canary's paired window)"
    )

    mnbt, mns = _knob_series(samples)
    axes[1].step(t, mnbt, where="post", label="--max-num-batched-tokens")
    axes[1].step(t, mns, where="post", label="--max-num-seqs")
    canary = [_knob(s.canary, "mnbt") for s in samples]
    if any(v is not None for v in canary):
        axes[1].step(t, canary, where="post", linestyle="--", color="tab:purple",
                     label="--max-num-batched-tokens, canary pod")  # fmt: skip
    axes[1].set_yscale("log", base=2)
    axes[1].set_ylabel("knob value")
    axes[1].set_title("Knobs applied by the operator (stable pods, and the canary pod)")
    axes[1].legend(loc="upper right", fontsize=8)

    ax = axes[2]
    ax.plot(t, [None if s.kv is None else 100 * s.kv for s in samples], label="KV cache %")
    ax.set_ylabel("KV cache usage (%)")
    ax3 = ax.twinx()
    ax3.plot(t, [s.rate for s in samples], color="tab:green", label="requests/s, stable pods")
    ax3.set_ylabel("requests/s (simulated time)")
    ax.set_title("Load and KV-cache usage of the stable pods (a canary takes its share)")

    axes[3].plot(t, failures_per_minute(samples), color="tab:red", label="failed requests")
    axes[3].set_ylabel("failed requests / min")
    axes[3].set_title(
        "Requests that failed, as the client saw them (no ready pod, cut mid-stream, aborted)"
    )
    axes[3].set_xlabel("minutes since start")

    _mark_decisions(axes, timeline)
    names = _legend(axes[0], ax2)
    _legend(axes[2], ax3)
    axes[3].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return names


def write_report(
    out: Path,
    timeline: Timeline,
    final: dict[str, Any],
    events: Sequence[dict[str, Any]],
    policy: dict[str, Any],
    converged: bool,
    service: Any,
    traffic: Traffic | None = None,
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    png = out / "timeline.png"
    if timeline.samples:
        _plot(png, timeline, policy)
    status = final.get("status") or {}
    tuning = status.get("tuning") or {}
    observed = status.get("observed") or {}
    slo = policy["spec"]["slo"]
    itl, ttft = percentile_label("itl", slo), percentile_label("ttft", slo)
    first = next((s for s in timeline.samples if s.itl_ms is not None), None)
    lines = [
        "# vllm-autotuner demo report",
        "",
        f"Outcome: **{'converged into the SLO' if converged else 'did not converge'}**.",
        "",
        f"SLO: {ttft} <= {slo['ttft']['thresholdMs']} ms, {itl} <= {slo['itl']['thresholdMs']} ms.",
        "",
        *measures(timeline, tuning, traffic, service),
        "",
        f"| | knobs | {ttft} (ms) | {itl} (ms) |",
        "|---|---|---|---|",
    ]
    if first is not None:  # the knobs its latencies were measured on, not those applied since
        lines.append(f"| first observation | {first.knobs} | {first.ttft_ms} | {first.itl_ms} |")
    applied = tuning.get("applied") or {}
    lines.append(
        f"| final | mnbt={applied.get('maxNumBatchedTokens')},mns={applied.get('maxNumSeqs')},"
        f"gmu={applied.get('gpuMemoryUtilization')} | {latency(observed, 'ttft', slo)} | "
        f"{latency(observed, 'itl', slo)} |"
    )
    lines += ["", "## Trials", "", "| id | knobs | how | outcome | reason |"]
    lines.append("|---|---|---|---|---|")
    canaries = canary_trials(events)
    for trial in tuning.get("trials") or []:
        k = trial.get("knobs") or {}
        how = "canary, one pod" if trial.get("id") in canaries else "rolling"
        lines.append(
            f"| {trial.get('id')} | mnbt={k.get('maxNumBatchedTokens')},"
            f"mns={k.get('maxNumSeqs')},gmu={k.get('gpuMemoryUtilization')} | {how} | "
            f"{trial.get('outcome')} | {str(trial.get('reason', '')).replace('|', '/')} |"
        )
    lines += ["", "## Decisions, in order", ""]
    for when, action, reason in timeline.decisions:
        lines.append(f"- `{int(when // 60):02d}:{int(when % 60):02d}` **{action}**: {reason}")
    lines += ["", "## Events on the VLLMDeployment, in time order", ""]
    for event in in_time_order(list(events)):
        lines.append(f"- {event.get('type')} {event.get('reason')}: {event.get('message')}")
    lines += ["", "![timeline](timeline.png)", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    (out / "status.json").write_text(json.dumps(final.get("status") or {}, indent=1))
    return [md, png]


def canary_trials(events: Sequence[dict[str, Any]]) -> set[int]:
    """Ids of the trials that ran as a canary (their CanaryStarted Event names them)."""
    found: set[int] = set()
    for event in events:
        if event.get("reason") != "CanaryStarted":
            continue
        match = re.search(r"\(trial (\d+),", str(event.get("message") or ""))
        if match:
            found.add(int(match[1]))
    return found


def _clock(seconds: float | None) -> str:
    return "-" if seconds is None else f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def console_measures(
    timeline: Timeline, tuning: dict[str, Any], traffic: Traffic | None, service: Any
) -> list[str]:
    """The report's measures as plain lines for the console, where the demo ends."""
    lines = measures(timeline, tuning, traffic, service)[2:]
    return [line.replace("**", "").strip().removeprefix("- ") for line in lines]


def measures(
    timeline: Timeline, tuning: dict[str, Any], traffic: Traffic | None, service: Any
) -> list[str]:
    """What the run cost and how long it took, in a few numbers (markdown)."""
    decided = [t for t, action, _ in timeline.decisions if action in ("rollout", "canary")]
    trials = tuning.get("trials") or []
    outcomes = [str(t.get("outcome")) for t in trials]
    promoted = sum(1 for _, action, _ in timeline.decisions if action == "promote")
    rejected = sum(1 for _, action, _ in timeline.decisions if action == "reject")
    lines = ["## Measures", ""]
    if traffic is not None:
        lines.append(
            f"- failed requests: **{traffic.failed}** of {traffic.finished} (the target is 0)"
        )
        lines += [f"  - {n} x {why}" for why, n in sorted(traffic.errors.items())]
    if service is not None:
        lines.append(
            f"- at the Service: {service.requests} requests, {service.refused} found no ready "
            "pod or lost it mid-request"
        )
    lines += [
        f"- first rollout decided at {_clock(decided[0] if decided else None)}; converged at "
        f"{_clock(timeline.converged_at)} (minutes:seconds since the start)",
        f"- trials: {len(trials)} ({outcomes.count('Committed')} committed, "
        f"{len(trials) - outcomes.count('Committed') - outcomes.count('Pending')} rolled back); "
        f"canaries promoted: {promoted}, rejected: {rejected}",
    ]
    return lines
