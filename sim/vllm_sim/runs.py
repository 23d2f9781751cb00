"""Records of real vLLM serving runs, in a file format the fidelity benchmark can replay.

The simulator is only as good as its distance from measured reality, and that distance must be
measurable for any model and GPU someone has data for. So a run is written down with everything
needed to reproduce its traffic (knobs, workload, stages) next to what was measured, and nothing
in the format is specific to the calibration set.

Format (YAML or JSON; `docs/fidelity.md` has the full reference)::

    format: vllm-sim-runs/v1
    defaults:                      # optional: keys merged into every run (run keys win)
      gpu: H100
      knobs: {max_num_seqs: 128, max_num_batched_tokens: 2048, gpu_memory_utilization: 0.9}
    workloads:                     # optional: named workloads that runs refer to by name
      general:
        system_prompt_tokens: 100  # shared by every prompt of a group (prefix caching can hit)
        question_tokens: 447       # unique per request
        prompt_tokens: 573         # measured mean prompt length (template/BOS included);
        #                            defaults to system + question
        output_tokens: 248         # exact (ignore_eos)
        groups: 9                  # distinct system prompts
        prompts_per_group: 5
        repeat_prompts: false      # true: requests reuse the groups x prompts_per_group fixed
        #                            prompts (whole prompts repeat; prefix caching hits them)
        arrival: poisson           # only Poisson is supported
        stages:                    # back to back, no drain in between
          - {rate: 8, duration: 600}           # requests = rate x duration unless given
          - {rate: 20, duration: 600, requests: 12000}
        rates_assumed: false       # true when the stage rates are not documented
    runs:
      - id: llama2-7b-general      # unique
        source: A                  # free text: where the numbers come from
        model: meta-llama/Llama-2-7b-hf   # catalog name or config.json path
        gpu: H100                  # catalog name or GPU spec path
        tp: 1
        quantization: fp8          # weight precision: the --quantization the server ran with,
        #                            or the quantized checkpoint's method (recorded; its
        #                            config.json decides); omit for BF16/FP16 weights
        knobs: {max_num_batched_tokens: 2048, max_num_seqs: 128,
                gpu_memory_utilization: 0.9, max_model_len: 4096, block_size: 16,
                enable_prefix_caching: true, kv_cache_dtype: auto}   # auto | fp8
        kv_offload: true           # CPU KV offload was on (recorded; not simulated)
        kv_blocks: 7462            # logged num_gpu_blocks, optional
        workload: general          # a name from `workloads` or an inline mapping
        client_timeout_s: 300      # the client gave up (and vLLM aborted) after this
        overloaded: false          # the measured run could not keep up with its rate
        note: free text
        results:                   # one per measured segment
          - segment: 0             # stage index, or "all" for the whole run
            exclude_first_s: 30    # requests that arrived in the first N s were dropped
            ok: 4572               # completed / sent requests of the segment
            sent: 4572
            ttft_ms: {mean: 26.9, p50: 26.7, p90: 30.9, p99: 34.8}
            tpot_ms: {mean: 8.22, p50: 8.19, p99: 9.61}    # (E2E-TTFT)/(out-1), nominal out
            e2e_ms: {mean: 2057, p50: 2050, p90: 2227, p99: 2403}
            throughput_rps: 7.98   # completion-based requests/s

Every statistic is optional; missing ones are simply not compared. Errors name the offending
place, e.g. ``runs[3].results[0].ttft_ms.p50: expected a number, got 'fast'``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FORMAT = "vllm-sim-runs/v1"
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
STAT_KEYS = ("mean", "p50", "p90", "p99")
METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")


class RunsFileError(ValueError):
    """A runs file that cannot be used, with the path of the bad field in the message."""


@dataclass(frozen=True)
class Stage:
    """A stretch of constant average arrival rate."""

    rate: float
    duration: float
    requests: int

    @property
    def effective_rate(self) -> float:
        return self.requests / self.duration


@dataclass(frozen=True)
class Workload:
    """The traffic of a run: prompt structure, output length and the arrival stages."""

    name: str
    system_prompt_tokens: int
    question_tokens: int
    prompt_tokens: int
    output_tokens: int
    groups: int
    prompts_per_group: int
    stages: tuple[Stage, ...]
    arrival: str = "poisson"
    rates_assumed: bool = False
    repeat_prompts: bool = False

    @property
    def distinct_prompts(self) -> int:
        return self.groups * self.prompts_per_group

    @property
    def total_requests(self) -> int:
        return sum(s.requests for s in self.stages)

    def stage_start(self, index: int) -> float:
        return float(sum(s.duration for s in self.stages[:index]))

    @property
    def duration(self) -> float:
        return self.stage_start(len(self.stages))


@dataclass(frozen=True)
class Knobs:
    """The vLLM flags of a run that the engine models (vLLM's own names)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class Measured:
    """What the client measured over one segment of a run (milliseconds, requests/s)."""

    segment: int | None  # stage index, None = the whole run
    exclude_first_s: float = 0.0
    ok: int | None = None
    sent: int | None = None
    ttft_ms: Mapping[str, float] = field(default_factory=dict)
    tpot_ms: Mapping[str, float] = field(default_factory=dict)
    e2e_ms: Mapping[str, float] = field(default_factory=dict)
    throughput_rps: float | None = None

    @property
    def label(self) -> str:
        seg = "all" if self.segment is None else f"S{self.segment}"
        if self.exclude_first_s:
            seg += f" (excl. {self.exclude_first_s:g}s)"
        return seg


@dataclass(frozen=True)
class Run:
    """One real serving run: how it was configured and driven, and what was measured."""

    id: str
    source: str
    model: str
    gpu: str
    tp: int
    knobs: Knobs
    workload: Workload
    results: tuple[Measured, ...]
    kv_blocks: int | None = None
    kv_offload: bool = False
    client_timeout_s: float | None = None
    overloaded: bool = False
    note: str = ""
    quantization: str | None = None  # weight precision (vLLM's --quantization), None: BF16/FP16


# ---- reading ---------------------------------------------------------------------------------


class _Node:
    """A mapping plus its place in the file, so that every error can say where it happened."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, Mapping):
            raise RunsFileError(f"{where}: expected a mapping, got {_show(data)}")
        self.data: Mapping[str, Any] = data
        self.where = where
        self.used: set[str] = set()

    def at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str) -> object:
        self.used.add(key)
        if not self.has(key):
            raise RunsFileError(f"{self.at(key)}: missing")
        return self.data[key]

    def number(self, key: str, default: float | None = None, positive: bool = True) -> float:
        if not self.has(key) and default is not None:
            self.used.add(key)
            return default
        v = self.raw(key)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise RunsFileError(f"{self.at(key)}: expected a number, got {_show(v)}")
        if positive and not v > 0:
            raise RunsFileError(f"{self.at(key)}: must be > 0, got {v}")
        if not positive and v < 0:
            raise RunsFileError(f"{self.at(key)}: must be >= 0, got {v}")
        return float(v)

    def integer(self, key: str, default: int | None = None, positive: bool = True) -> int:
        if not self.has(key) and default is not None:
            self.used.add(key)
            return default
        v = self.raw(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise RunsFileError(f"{self.at(key)}: expected an integer, got {_show(v)}")
        if positive and v < 1:
            raise RunsFileError(f"{self.at(key)}: must be >= 1, got {v}")
        if not positive and v < 0:
            raise RunsFileError(f"{self.at(key)}: must be >= 0, got {v}")
        return v

    def text(self, key: str, default: str | None = None) -> str:
        if not self.has(key) and default is not None:
            self.used.add(key)
            return default
        v = self.raw(key)
        if not isinstance(v, str | int | float) or isinstance(v, bool) or v == "":
            raise RunsFileError(f"{self.at(key)}: expected a non-empty string, got {_show(v)}")
        return str(v)

    def flag(self, key: str, default: bool) -> bool:
        if not self.has(key):
            self.used.add(key)
            return default
        v = self.raw(key)
        if not isinstance(v, bool):
            raise RunsFileError(f"{self.at(key)}: expected true or false, got {_show(v)}")
        return v

    def child(self, key: str) -> _Node:
        return _Node(self.raw(key), self.at(key))

    def items(self, key: str) -> list[object]:
        v = self.raw(key)
        if not isinstance(v, list) or not v:
            raise RunsFileError(f"{self.at(key)}: expected a non-empty list, got {_show(v)}")
        return v

    def done(self) -> None:
        """Unknown keys are typos far more often than extensions; refuse them."""
        extra = sorted(set(self.data) - self.used)
        if extra:
            raise RunsFileError(f"{self.where or 'file'}: unknown key(s) {', '.join(extra)}")


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` wins; nested mappings (knobs) merge one level deep."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


def _stage(n: _Node) -> Stage:
    rate = n.number("rate")
    duration = n.number("duration")
    requests = n.integer("requests", default=max(1, round(rate * duration)))
    n.done()
    return Stage(rate, duration, requests)


def _workload(n: _Node, name: str) -> Workload:
    system = n.integer("system_prompt_tokens", default=0, positive=False)
    question = n.integer("question_tokens")
    prompt = n.integer("prompt_tokens", default=system + question)
    if prompt < system + 1:
        raise RunsFileError(
            f"{n.at('prompt_tokens')}: {prompt} leaves no room after the {system}-token system "
            "prompt"
        )
    arrival = n.text("arrival", default="poisson")
    if arrival != "poisson":
        raise RunsFileError(f"{n.at('arrival')}: only 'poisson' is supported, got {arrival!r}")
    stages = tuple(
        _stage(_Node(s, f"{n.at('stages')}[{i}]")) for i, s in enumerate(n.items("stages"))
    )
    w = Workload(
        name=n.text("name", default=name),
        system_prompt_tokens=system,
        question_tokens=question,
        prompt_tokens=prompt,
        output_tokens=n.integer("output_tokens"),
        groups=n.integer("groups", default=1),
        prompts_per_group=n.integer("prompts_per_group", default=1),
        stages=stages,
        arrival=arrival,
        rates_assumed=n.flag("rates_assumed", False),
        repeat_prompts=n.flag("repeat_prompts", False),
    )
    n.done()
    return w


def _knobs(n: _Node) -> Knobs:
    d = Knobs()
    util = n.number("gpu_memory_utilization", default=d.gpu_memory_utilization)
    if util > 1.0:
        raise RunsFileError(f"{n.at('gpu_memory_utilization')}: must be <= 1, got {util}")
    k = Knobs(
        max_num_batched_tokens=n.integer(
            "max_num_batched_tokens", default=d.max_num_batched_tokens
        ),
        max_num_seqs=n.integer("max_num_seqs", default=d.max_num_seqs),
        gpu_memory_utilization=util,
        max_model_len=n.integer("max_model_len", default=d.max_model_len),
        block_size=n.integer("block_size", default=d.block_size),
        enable_prefix_caching=n.flag("enable_prefix_caching", d.enable_prefix_caching),
        kv_cache_dtype=n.text("kv_cache_dtype", default=d.kv_cache_dtype),
    )
    if k.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise RunsFileError(
            f"{n.at('kv_cache_dtype')}: expected one of {', '.join(KV_CACHE_DTYPES)}, got "
            f"{k.kv_cache_dtype!r}"
        )
    n.done()
    return k


def _stats(n: _Node, key: str) -> dict[str, float]:
    if not n.has(key):
        n.used.add(key)
        return {}
    s = n.child(key)
    out = {k: s.number(k) for k in STAT_KEYS if s.has(k)}
    s.done()
    return out


def _measured(n: _Node, num_stages: int) -> Measured:
    seg_raw = n.raw("segment")
    segment: int | None
    if seg_raw == "all":
        segment = None
    elif isinstance(seg_raw, int) and not isinstance(seg_raw, bool) and 0 <= seg_raw < num_stages:
        segment = seg_raw
    else:
        raise RunsFileError(
            f"{n.at('segment')}: expected a stage index 0..{num_stages - 1} or 'all', got "
            f"{_show(seg_raw)}"
        )
    m = Measured(
        segment=segment,
        exclude_first_s=n.number("exclude_first_s", default=0.0, positive=False),
        ok=n.integer("ok", positive=False) if n.has("ok") else None,
        sent=n.integer("sent") if n.has("sent") else None,
        ttft_ms=_stats(n, "ttft_ms"),
        tpot_ms=_stats(n, "tpot_ms"),
        e2e_ms=_stats(n, "e2e_ms"),
        throughput_rps=n.number("throughput_rps") if n.has("throughput_rps") else None,
    )
    n.used.update({"ok", "sent", "throughput_rps"})
    if m.ok is not None and m.sent is not None and m.ok > m.sent:
        raise RunsFileError(f"{n.at('ok')}: {m.ok} completed of only {m.sent} sent")
    n.done()
    return m


def _run(n: _Node, workloads: Mapping[str, Workload]) -> Run:
    wl_raw = n.raw("workload")
    if isinstance(wl_raw, str):
        if wl_raw not in workloads:
            known = ", ".join(sorted(workloads)) or "none defined"
            raise RunsFileError(f"{n.at('workload')}: unknown workload {wl_raw!r} ({known})")
        workload = workloads[wl_raw]
    else:
        workload = _workload(_Node(wl_raw, n.at("workload")), "inline")
    knobs = _knobs(n.child("knobs")) if n.has("knobs") else Knobs()
    n.used.add("knobs")
    results = tuple(
        _measured(_Node(r, f"{n.at('results')}[{i}]"), len(workload.stages))
        for i, r in enumerate(n.items("results"))
    )
    timeout = n.number("client_timeout_s") if n.has("client_timeout_s") else None
    n.used.add("client_timeout_s")
    kv_blocks = n.integer("kv_blocks") if n.has("kv_blocks") else None
    n.used.add("kv_blocks")
    run = Run(
        id=n.text("id"),
        source=n.text("source", default="?"),
        model=n.text("model"),
        gpu=n.text("gpu"),
        tp=n.integer("tp", default=1),
        knobs=knobs,
        workload=workload,
        results=results,
        kv_blocks=kv_blocks,
        kv_offload=n.flag("kv_offload", False),
        client_timeout_s=timeout,
        overloaded=n.flag("overloaded", False),
        note=str(n.data.get("note") or ""),
        quantization=n.text("quantization") if n.has("quantization") else None,
    )
    n.used.add("quantization")
    n.used.add("note")
    n.done()
    return run


def parse_runs(data: object, where: str = "") -> list[Run]:
    """Runs from an already-decoded YAML/JSON document."""
    top = _Node(data, where)
    fmt = top.text("format", default=FORMAT)
    if fmt != FORMAT:
        raise RunsFileError(f"{top.at('format')}: expected {FORMAT!r}, got {fmt!r}")
    defaults: Mapping[str, Any] = {}
    if top.has("defaults"):
        defaults = top.child("defaults").data
    top.used.add("defaults")
    workloads: dict[str, Workload] = {}
    if top.has("workloads"):
        wl = top.child("workloads")
        for name in wl.data:
            workloads[str(name)] = _workload(wl.child(str(name)), str(name))
        wl.done()
    top.used.add("workloads")
    runs: list[Run] = []
    seen: set[str] = set()
    for i, raw in enumerate(top.items("runs")):
        place = f"{top.at('runs')}[{i}]"
        if not isinstance(raw, Mapping):
            raise RunsFileError(f"{place}: expected a mapping, got {_show(raw)}")
        run = _run(_Node(_merge(defaults, raw), place), workloads)
        if run.id in seen:
            raise RunsFileError(f"{place}.id: duplicate run id {run.id!r}")
        seen.add(run.id)
        runs.append(run)
    top.done()
    return runs


def load_runs(path: str | Path) -> list[Run]:
    """Runs from a .yaml/.yml or .json file."""
    p = Path(path)
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except Exception as exc:  # a syntax error: say which file
        raise RunsFileError(f"{p}: cannot parse: {exc}") from exc
    try:
        return parse_runs(data)
    except RunsFileError as exc:
        raise RunsFileError(f"{p}: {exc}") from exc


def calibration_runs_path() -> Path:
    """The H100 calibration set shipped with the simulator (the first of fit_runs_paths)."""
    return Path(__file__).parent / "data" / "runs" / "calibration-h100.yaml"


def fit_runs_paths() -> list[Path]:
    """The runs the step-time constants are fitted on (H100 only)."""
    here = Path(__file__).parent / "data" / "runs"
    return [here / "calibration-h100.yaml", here / "calibration-h100-llama3.yaml"]


def check_runs_path() -> Path:
    """Real runs never fitted on: other knobs and workloads on H100, every A100 and L40S run."""
    return Path(__file__).parent / "data" / "runs" / "check.yaml"


__all__ = [
    "FORMAT",
    "METRICS",
    "Knobs",
    "Measured",
    "Run",
    "RunsFileError",
    "Stage",
    "Workload",
    "calibration_runs_path",
    "check_runs_path",
    "fit_runs_paths",
    "load_runs",
    "parse_runs",
]
