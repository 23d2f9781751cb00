"""The demo's report: what the operator did, in a picture and a page.

A person wants to see at a glance that the knobs moved, that ITL came down under its SLO and
what each decision said; the markdown page holds the numbers and the decisions in order.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_localcluster.demo import Timeline


def _plot(path: Path, timeline: Timeline, policy: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = policy["spec"]["slo"]
    t = [s.t / 60.0 for s in timeline.samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    ax = axes[0]
    ax.plot(t, [s.itl_p95 for s in timeline.samples], label="ITL p95", color="tab:blue")
    ax.axhline(slo["itl"]["thresholdMs"], color="tab:blue", linestyle="--", label="ITL SLO")
    ax2 = ax.twinx()
    ax2.plot(t, [s.ttft_p95 for s in timeline.samples], label="TTFT p95", color="tab:orange")
    ax2.axhline(slo["ttft"]["thresholdMs"], color="tab:orange", linestyle=":", label="TTFT SLO")
    ax.set_ylabel("ITL p95 (ms)")
    ax2.set_ylabel("TTFT p95 (ms)")
    ax.set_title("Latency against the SLO (from Prometheus, as the operator saw it)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)

    ax = axes[1]
    mnbt, mns = [], []
    for s in timeline.samples:
        parts = dict(p.split("=", 1) for p in (s.knobs or "").split(",") if "=" in p)
        mnbt.append(float(parts["mnbt"]) if parts.get("mnbt", "None") != "None" else None)
        mns.append(float(parts["mns"]) if parts.get("mns", "None") != "None" else None)
    ax.step(t, mnbt, where="post", label="--max-num-batched-tokens")
    ax.step(t, mns, where="post", label="--max-num-seqs")
    ax.set_yscale("log", base=2)
    ax.set_ylabel("knob value")
    ax.set_title("Knobs applied by the operator")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[2]
    ax.plot(t, [None if s.kv is None else 100 * s.kv for s in timeline.samples], label="KV cache %")
    ax.set_ylabel("KV cache usage (%)")
    ax3 = ax.twinx()
    ax3.plot(t, [s.rate for s in timeline.samples], color="tab:green", label="requests/s")
    ax3.set_ylabel("requests/s (simulated time)")
    ax.set_title("Load and KV-cache usage")
    ax.set_xlabel("minutes since start")
    for axis in axes:
        for when, action, _ in timeline.decisions:
            if action in ("rollout", "commit", "rollback"):
                color = {"rollout": "tab:purple", "commit": "tab:green", "rollback": "tab:red"}
                axis.axvline(when / 60.0, color=color[action], alpha=0.4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    if first is not None:
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
    lines += ["", "## Events on the VLLMDeployment", ""]
    for event in events:
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
