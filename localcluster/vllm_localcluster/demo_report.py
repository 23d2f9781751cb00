"""The demo's report: what the operator did, in a picture and a page.

A person wants to see at a glance that the knobs moved, that ITL came down under its SLO, when
the rollouts, commits and rollbacks happened and what they cost in failed requests; the
markdown page holds the numbers, the decisions and the Events in time order.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_localcluster.narration import in_time_order

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from vllm_localcluster.demo import Sample, Timeline

# How each decision that changes the pods is marked on every panel.
MARKERS = {
    "rollout": ("tab:purple", "--", "rollout"),
    "commit": ("tab:green", "-", "commit"),
    "rollback": ("tab:red", "-", "rollback"),
}


def _knob_series(samples: Sequence[Sample]) -> tuple[list[float | None], list[float | None]]:
    """--max-num-batched-tokens and --max-num-seqs applied at each sample."""
    mnbt: list[float | None] = []
    mns: list[float | None] = []
    for s in samples:
        parts = dict(p.split("=", 1) for p in (s.applied or "").split(",") if "=" in p)
        mnbt.append(float(parts["mnbt"]) if parts.get("mnbt", "None") != "None" else None)
        mns.append(float(parts["mns"]) if parts.get("mns", "None") != "None" else None)
    return mnbt, mns


def failures_per_minute(samples: Sequence[Sample]) -> list[float | None]:
    """Requests the Service failed, per wall minute, between consecutive samples."""
    out: list[float | None] = [None]
    for before, after in itertools.pairwise(samples):
        dt = after.t - before.t
        out.append(60.0 * max(0, after.failed - before.failed) / dt if dt > 0 else None)
    return out


def _mark_decisions(axes: Sequence[Axes], timeline: Timeline) -> None:
    """A vertical line per rollout, commit and rollback on every panel, once in the legend."""
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
    samples = timeline.samples
    t = [s.t / 60.0 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax = axes[0]
    ax.plot(t, [s.itl_p95 for s in samples], label="ITL p95", color="tab:blue")
    ax.axhline(slo["itl"]["thresholdMs"], color="tab:blue", linestyle=":", label="ITL SLO")
    ax2 = ax.twinx()
    ax2.plot(t, [s.ttft_p95 for s in samples], label="TTFT p95", color="tab:orange")
    ax2.axhline(slo["ttft"]["thresholdMs"], color="tab:orange", linestyle=":", label="TTFT SLO")
    ax.set_ylabel("ITL p95 (ms)")
    ax2.set_ylabel("TTFT p95 (ms)")
    ax.set_title("Latency against the SLO (from Prometheus, as the operator saw it)")

    mnbt, mns = _knob_series(samples)
    axes[1].step(t, mnbt, where="post", label="--max-num-batched-tokens")
    axes[1].step(t, mns, where="post", label="--max-num-seqs")
    axes[1].set_yscale("log", base=2)
    axes[1].set_ylabel("knob value")
    axes[1].set_title("Knobs applied by the operator")
    axes[1].legend(loc="upper right", fontsize=8)

    ax = axes[2]
    ax.plot(t, [None if s.kv is None else 100 * s.kv for s in samples], label="KV cache %")
    ax.set_ylabel("KV cache usage (%)")
    ax3 = ax.twinx()
    ax3.plot(t, [s.rate for s in samples], color="tab:green", label="requests/s")
    ax3.set_ylabel("requests/s (simulated time)")
    ax.set_title("Load and KV-cache usage")

    axes[3].plot(t, failures_per_minute(samples), color="tab:red", label="failed requests")
    axes[3].set_ylabel("failed requests / min")
    axes[3].set_title("Requests the Service could not serve (no ready pod, or lost mid-stream)")
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
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    png = out / "timeline.png"
    if timeline.samples:
        _plot(png, timeline, policy)
    status = final.get("status") or {}
    tuning = status.get("tuning") or {}
    observed = status.get("observed") or {}
    slo = policy["spec"]["slo"]
    first = next((s for s in timeline.samples if s.itl_p95 is not None), None)
    lines = [
        "# vllm-autotuner demo report",
        "",
        f"Outcome: **{'converged into the SLO' if converged else 'did not converge'}**.",
        "",
        f"SLO: TTFT p95 <= {slo['ttft']['thresholdMs']} ms, "
        f"ITL p95 <= {slo['itl']['thresholdMs']} ms.",
        "",
        "| | knobs | TTFT p95 (ms) | ITL p95 (ms) |",
        "|---|---|---|---|",
    ]
    if first is not None:  # the knobs its latencies were measured on, not those applied since
        lines.append(f"| first observation | {first.knobs} | {first.ttft_p95} | {first.itl_p95} |")
    applied = tuning.get("applied") or {}
    lines.append(
        f"| final | mnbt={applied.get('maxNumBatchedTokens')},mns={applied.get('maxNumSeqs')},"
        f"gmu={applied.get('gpuMemoryUtilization')} | {observed.get('ttftP95Ms')} | "
        f"{observed.get('itlP95Ms')} |"
    )
    lines += ["", "## Trials", "", "| id | knobs | outcome | reason |", "|---|---|---|---|"]
    for trial in tuning.get("trials") or []:
        k = trial.get("knobs") or {}
        lines.append(
            f"| {trial.get('id')} | mnbt={k.get('maxNumBatchedTokens')},"
            f"mns={k.get('maxNumSeqs')},gmu={k.get('gpuMemoryUtilization')} | "
            f"{trial.get('outcome')} | {str(trial.get('reason', '')).replace('|', '/')} |"
        )
    lines += ["", "## Decisions, in order", ""]
    for when, action, reason in timeline.decisions:
        lines.append(f"- `{int(when // 60):02d}:{int(when % 60):02d}` **{action}**: {reason}")
    lines += ["", "## Events on the VLLMDeployment, in time order", ""]
    for event in in_time_order(list(events)):
        lines.append(f"- {event.get('type')} {event.get('reason')}: {event.get('message')}")
    if service is not None:
        lines += [
            "",
            "## Traffic",
            "",
            f"{service.requests} requests went through the Service; {service.refused} found no "
            "ready pod or lost it mid-stream (surge-free rollouts of a single replica stop "
            "serving while the new pod loads, exactly as on a real cluster).",
        ]
    lines += ["", "![timeline](timeline.png)", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    (out / "status.json").write_text(json.dumps(final.get("status") or {}, indent=1))
    return [md, png]
