"""Simulated vs measured, per run and segment, and the error summary the calibration goals use.

Relative error is (sim - measured) / measured. Medians of |error| are taken over the per-stage
points of runs that were not overloaded (the "all" rows overlap their stages, and latencies of an
overloaded run are queueing artefacts of its 300 s client timeout); points whose stage rates are
assumed (general-lite) are summarised separately. Overloaded runs are judged as overload points:
does the simulation overload too, and how close is its completion-based throughput.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from vllm_sim.kv import engine_model
from vllm_sim.replay import ClientModel, ReplayResult, SegmentStats
from vllm_sim.runs import Measured, Run
from vllm_sim.types import EngineConfig

# (column, metric attribute, statistic) in table order.
METRICS: tuple[tuple[str, str, str], ...] = (
    ("TTFT mean", "ttft_ms", "mean"),
    ("TTFT p50", "ttft_ms", "p50"),
    ("TTFT p90", "ttft_ms", "p90"),
    ("TTFT p99", "ttft_ms", "p99"),
    ("TPOT mean", "tpot_ms", "mean"),
    ("E2E mean", "e2e_ms", "mean"),
    ("E2E p50", "e2e_ms", "p50"),
    ("E2E p99", "e2e_ms", "p99"),
    ("thpt", "throughput_rps", ""),
)
GOALS = {"KV blocks": 0.05, "TPOT mean": 0.10, "E2E p50": 0.10, "E2E mean": 0.10, "TTFT p50": 0.20}
OVERLOAD_THROUGHPUT_GOAL = 0.15


@dataclass
class Cell:
    sim: float | None
    measured: float

    @property
    def error(self) -> float | None:
        if self.sim is None or self.measured == 0:
            return None
        return (self.sim - self.measured) / self.measured


@dataclass
class Row:
    """One measured segment next to its simulation."""

    run_id: str
    segment: str
    stage_point: bool  # a per-stage segment (not "all")
    overloaded: bool
    rates_assumed: bool
    sent: int
    ok: int
    measured_ok: int | None
    measured_sent: int | None
    preempted_requests: int
    cells: dict[str, Cell] = field(default_factory=dict)


@dataclass
class RunReport:
    run_id: str
    model: str
    gpu: str
    tp: int
    workload: str
    kv_blocks: Cell | None
    wall_s: float
    rows: list[Row]
    arch: str = ""


def architecture(model: str, tp: int, quantization: str | None) -> str:
    """A run's architecture class: dense or MoE (with shared experts), attention kind, weight
    precision, TP degree."""
    m = engine_model(EngineConfig(model=model, quantization=quantization))
    kind = "MoE" if m.is_moe else "dense"
    if m.shared_expert_intermediate_size:
        kind += "+shared"
    attn = "MHA" if m.num_key_value_heads == m.num_attention_heads else "GQA"
    weights = m.quant.method if m.quant.quantized else "bf16"
    return f"{kind} {attn} {weights} TP{tp}"


def _sim_value(s: SegmentStats, attr: str, stat: str) -> float | None:
    if attr == "throughput_rps":
        return s.throughput_rps
    d: dict[str, float] = getattr(s, attr)
    return d.get(stat)


def _measured_value(m: Measured, attr: str, stat: str) -> float | None:
    if attr == "throughput_rps":
        return m.throughput_rps
    d = getattr(m, attr)
    v = d.get(stat)
    return None if v is None else float(v)


def compare(result: ReplayResult) -> RunReport:
    run: Run = result.run
    rows = []
    for m in run.results:
        s = result.stats(m)
        row = Row(
            run_id=run.id,
            segment=m.label,
            stage_point=m.segment is not None,
            overloaded=run.overloaded,
            rates_assumed=run.workload.rates_assumed,
            sent=s.sent,
            ok=s.ok,
            measured_ok=m.ok,
            measured_sent=m.sent,
            preempted_requests=s.preempted_requests,
        )
        for col, attr, stat in METRICS:
            meas = _measured_value(m, attr, stat)
            if meas is not None:
                row.cells[col] = Cell(_sim_value(s, attr, stat), meas)
        rows.append(row)
    kv = None if run.kv_blocks is None else Cell(float(result.num_gpu_blocks), run.kv_blocks)
    return RunReport(
        run_id=run.id,
        model=run.model,
        gpu=run.gpu,
        tp=run.tp,
        workload=run.workload.name,
        kv_blocks=kv,
        wall_s=result.wall_s,
        rows=rows,
        arch=architecture(run.model, run.tp, run.quantization),
    )


def sim_overloaded(row: Row) -> bool:
    """The queue grew without bound: many requests timed out or the median wait is seconds."""
    ttft = row.cells.get("TTFT p50")
    slow = ttft is not None and ttft.sim is not None and ttft.sim > 5_000.0
    return slow or (row.sent > 0 and row.ok < 0.95 * row.sent)


def median_errors(reports: list[RunReport], assumed: bool) -> dict[str, tuple[float, int]]:
    """Median |relative error| and point count per metric over steady per-stage points."""
    errs: dict[str, list[float]] = {}
    for rep in reports:
        if rep.kv_blocks is not None and rep.kv_blocks.error is not None and not assumed:
            errs.setdefault("KV blocks", []).append(abs(rep.kv_blocks.error))
        for row in rep.rows:
            if not row.stage_point or row.overloaded or row.rates_assumed != assumed:
                continue
            for col, cell in row.cells.items():
                if cell.error is not None:
                    errs.setdefault(col, []).append(abs(cell.error))
    order = ["KV blocks"] + [c for c, _, _ in METRICS]
    return {k: (statistics.median(errs[k]), len(errs[k])) for k in order if k in errs}


def fit_client_overhead(
    results: list[ReplayResult],
    base: ClientModel,
    grid_ms: tuple[float, float, float] = (0.0, 40.0, 0.5),
) -> ClientModel:
    """The one overhead, shared by every run, that minimises the median |TTFT error|.

    TTFT is where a constant latency shows most (E2E is seconds long), and a constant is all the
    client adds; the engine's own frontend cost (`Calibration.c_frontend_s`) sits inside the
    engine's TTFT already, so only the two together are identified by client-side data.
    """
    lo, hi, step = grid_ms
    best: tuple[float, float] | None = None
    ms = lo
    while ms <= hi + 1e-9:
        client = replace(base, overhead_s=ms / 1e3)
        reports = [compare(replace(r, client=client)) for r in results]
        med = median_errors(reports, assumed=False)
        score = statistics.fmean(med[k][0] for k in ("TTFT mean", "TTFT p50") if k in med)
        if best is None or score < best[0]:
            best = (score, ms)
        ms += step
    assert best is not None
    return replace(base, overhead_s=best[1] / 1e3)


def _pct(e: float | None) -> str:
    return "n/a" if e is None else f"{e * 100:+.0f}%"


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 10_000:
        return f"{v / 1000:.1f}k"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def _cell(c: Cell | None) -> str:
    if c is None:
        return ""
    return f"{_num(c.sim)} / {_num(c.measured)} ({_pct(c.error)})"


def markdown(reports: list[RunReport], client: ClientModel, seed: int, quick: bool) -> str:
    cols = [c for c, _, _ in METRICS]
    lines = [
        "Each cell: simulated / measured (relative error). Latencies in ms, throughput in "
        f"completed req/s. Client overhead {client.overhead_s * 1e3:.1f} ms, seed {seed}"
        + (", QUICK mode (stages cut short)" if quick else "")
        + ".",
        "",
        "| run | seg | KV blocks | " + " | ".join(cols) + " | ok/sent sim (meas) |",
        "|" + "---|" * (len(cols) + 4),
    ]
    for rep in reports:
        for i, row in enumerate(rep.rows):
            kv = _cell(rep.kv_blocks) if i == 0 else ""
            flag = " (overload)" if row.overloaded else (" (rates assumed)" * row.rates_assumed)
            meas_ok = (
                f" ({row.measured_ok}/{row.measured_sent})" if row.measured_sent is not None else ""
            )
            name = f"{rep.run_id}{flag}" if i == 0 else ""
            lines.append(
                f"| {name} | {row.segment} | {kv} | "
                + " | ".join(_cell(row.cells.get(c)) for c in cols)
                + f" | {row.ok}/{row.sent}{meas_ok} |"
            )
    lines += [
        "",
        summary_markdown(reports),
        "",
        "Per GPU:",
        "",
        group_markdown(reports, "gpu", "GPU"),
    ]
    lines += ["", "Per architecture:", "", group_markdown(reports, "arch", "architecture")]
    return "\n".join(lines) + "\n"


def summary_markdown(reports: list[RunReport]) -> str:
    lines = ["Median |error| over steady per-stage points (goal where one is set):", ""]
    lines += ["| metric | median abs error | points | goal |", "|---|---|---|---|"]
    for k, (med, n) in median_errors(reports, assumed=False).items():
        goal = GOALS.get(k)
        ok = "" if goal is None else (f"<= {goal:.0%} " + ("met" if med <= goal else "MISSED"))
        lines.append(f"| {k} | {med * 100:.1f}% | {n} | {ok} |")
    assumed = median_errors(reports, assumed=True)
    if assumed:
        lines += ["", "Points with assumed stage rates (general-lite), median |error|:", ""]
        lines.append(", ".join(f"{k} {m * 100:.1f}% (n={n})" for k, (m, n) in assumed.items()))
    lines += ["", "Overload points:", ""]
    lines += [
        "| run | overloaded in sim | ok/sent sim | ok/sent measured | throughput sim / measured |",
        "|---|---|---|---|---|",
    ]
    for rep in reports:
        for row in rep.rows:
            if not row.overloaded:
                continue
            thpt = row.cells.get("thpt")
            verdict = ""
            if thpt is not None and thpt.error is not None:
                good = abs(thpt.error) <= OVERLOAD_THROUGHPUT_GOAL
                verdict = " within 15%" if good else " OFF by more than 15%"
            lines.append(
                f"| {rep.run_id} | {'yes' if sim_overloaded(row) else 'NO'} | {row.ok}/{row.sent}"
                f" | {row.measured_ok}/{row.measured_sent} | {_cell(thpt)}{verdict} |"
            )
    return "\n".join(lines)


# Per-group goals of the GPU-transfer work: median |error| and median signed error (bias).
GROUP_GOALS = {"TTFT mean": 0.10, "TPOT mean": 0.07, "E2E mean": 0.07}
BIAS_GOAL = 0.03


def group_errors(
    reports: list[RunReport], key: str
) -> dict[str, dict[str, tuple[float, float, int]]]:
    """Per group (`key`: "gpu" or "arch"): metric -> (median |error|, median signed error, n) over
    the steady per-stage points, assumed-rate ones included (every off-H100 run has them)."""
    errs: dict[str, dict[str, list[float]]] = {}
    for rep in reports:
        group = str(getattr(rep, key))
        for row in rep.rows:
            if not row.stage_point or row.overloaded:
                continue
            for col in GROUP_GOALS:
                cell = row.cells.get(col)
                if cell is not None and cell.error is not None:
                    errs.setdefault(group, {}).setdefault(col, []).append(cell.error)
    return {
        g: {
            col: (statistics.median(abs(e) for e in v), statistics.median(v), len(v))
            for col, v in cols.items()
        }
        for g, cols in sorted(errs.items())
    }


def group_markdown(reports: list[RunReport], key: str, title: str) -> str:
    cols = list(GROUP_GOALS)
    lines = [
        f"| {title} | points | "
        + " | ".join(f"{c} median abs (goal {GROUP_GOALS[c]:.0%}) / bias" for c in cols)
        + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for group, by_col in group_errors(reports, key).items():
        n = max(v[2] for v in by_col.values())
        cells = []
        for c in cols:
            if c not in by_col:
                cells.append("")
                continue
            med, bias, _ = by_col[c]
            ok = med <= GROUP_GOALS[c] and abs(bias) <= BIAS_GOAL
            cells.append(f"{med * 100:.1f}% / {bias * 100:+.1f}%{'' if ok else ' (missed)'}")
        lines.append(f"| {group} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_json(reports: list[RunReport], client: ClientModel, seed: int, quick: bool) -> Any:
    def enc(rep: RunReport) -> dict[str, Any]:
        d = asdict(rep)
        if rep.kv_blocks is not None:
            d["kv_blocks"]["error"] = rep.kv_blocks.error
        for row_d, row in zip(d["rows"], rep.rows, strict=True):
            row_d["sim_overloaded"] = sim_overloaded(row)
            for col, cell in row.cells.items():
                row_d["cells"][col]["error"] = cell.error
        return d

    return {
        "client": asdict(client),
        "seed": seed,
        "quick": quick,
        "median_abs_error": {
            k: {"median": m, "points": n} for k, (m, n) in median_errors(reports, False).items()
        },
        "median_abs_error_assumed_rates": {
            k: {"median": m, "points": n} for k, (m, n) in median_errors(reports, True).items()
        },
        "per_gpu": group_errors(reports, "gpu"),
        "per_architecture": group_errors(reports, "arch"),
        "runs": [enc(r) for r in reports],
    }
