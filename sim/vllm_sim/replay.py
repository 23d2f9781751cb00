"""Replay a recorded real run (`vllm_sim.runs.Run`) through the engine, as its client drove it.

The point is a like-for-like comparison with the measurement, so the replay copies what the
client did rather than what would be convenient:

- Arrivals are Poisson (the measured inter-arrival CV is ~1.0) with exactly the stage's request
  count: a Poisson process conditioned on its count is uniform order statistics, so each stage
  gets `requests` uniform arrival times in its window. Stages run back to back with no drain.
- Every prompt is its group's system prompt plus a question; its length is the measured mean
  prompt length. Each request draws one of the groups x prompts_per_group prompts uniformly.
  With `repeat_prompts` (inference-perf's shared_prefix data: a fixed set of prompts, reused)
  the whole prompt repeats and prefix caching can hit all of it but the last token; without it
  only the system prompt is shared (`prefix_id`/`prefix_len`) and the question is unique.
  Outputs are exactly `output_tokens` long (ignore_eos).
- A request the client gave up on (`client_timeout_s`) is aborted in the engine at that moment,
  as vLLM does when the HTTP connection closes; it frees its slot and KV blocks and counts as a
  failure, which is what makes the completion-based throughput of an overloaded run comparable.
- Client-side latency = engine latency + `ClientModel.overhead_s` (HTTP, tokenization, the
  API-server/engine-core hop, streaming and detokenization), the same for every run: it is a
  property of the serving stack, never a per-row correction.
- Segments are binned by arrival time like the measurement; `exclude_first_s` drops warm-up.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_sim.catalog import load_model
from vllm_sim.engine import Engine
from vllm_sim.runs import Measured, Run, Stage, Workload
from vllm_sim.steptime import Calibration, FloatArray
from vllm_sim.types import EngineConfig, Request, RequestRecord


@dataclass(frozen=True)
class ClientModel:
    """What the measuring client adds on top of the engine's own timings.

    `overhead_s` (HTTP, streaming, detokenization in the client) is fitted with
    `python -m bench.fidelity --fit-client-overhead` on the unsaturated runs of
    calibration-h100.yaml (inference-perf in the same cluster as vLLM v0.15.1), given the
    engine's own frontend cost `Calibration.c_frontend_s` (4 ms) and async scheduling: only
    their sum is identified by client-side data. The measured intercept of TTFT against TPOT
    across the four models is 4.6 ms; the fit gives 3.5 ms.
    """

    overhead_s: float = 0.0035


CLIENT = ClientModel()


def engine_config(run: Run) -> EngineConfig:
    """The run's server flags. Its weight precision is applied as `--quantization` only to an
    unquantized checkpoint; a quantized config.json already says how its weights are stored."""
    k = run.knobs
    quantization = run.quantization
    if quantization is not None and load_model(run.model).quant.quantized:
        quantization = None
    return EngineConfig(
        model=run.model,
        gpu=run.gpu,
        tensor_parallel_size=run.tp,
        max_num_seqs=k.max_num_seqs,
        max_num_batched_tokens=k.max_num_batched_tokens,
        gpu_memory_utilization=k.gpu_memory_utilization,
        max_model_len=k.max_model_len,
        block_size=k.block_size,
        enable_prefix_caching=k.enable_prefix_caching,
        kv_cache_dtype=k.kv_cache_dtype,
        quantization=quantization,
    )


def scaled_stages(workload: Workload, max_stage_s: float | None) -> tuple[Stage, ...]:
    """Stages cut to at most `max_stage_s` seconds each, at the same rate (the quick mode)."""
    if max_stage_s is None:
        return workload.stages
    out = []
    for s in workload.stages:
        if s.duration <= max_stage_s:
            out.append(s)
        else:
            n = max(1, round(s.requests * max_stage_s / s.duration))
            out.append(Stage(s.rate, max_stage_s, n))
    return tuple(out)


def build_requests(run: Run, seed: int = 0, stages: Sequence[Stage] | None = None) -> list[Request]:
    """The run's requests in arrival order; the same run and seed always give the same list."""
    wl = run.workload
    stages = wl.stages if stages is None else stages
    rng = np.random.default_rng(seed)
    out: list[Request] = []
    start = 0.0
    shared = wl.system_prompt_tokens > 0
    for si, stage in enumerate(stages):
        times = start + np.sort(rng.uniform(0.0, stage.duration, size=stage.requests))
        prompts = rng.integers(0, wl.distinct_prompts, size=stage.requests)
        for i, (t, p) in enumerate(zip(times.tolist(), prompts.tolist(), strict=True)):
            prefix_id: str | None = None
            prefix_len = 0
            if wl.repeat_prompts:  # the whole prompt is one of a fixed set
                prefix_id, prefix_len = f"{wl.name}/prompt-{p}", wl.prompt_tokens
            elif shared:  # only the group's system prompt is common
                prefix_id = f"{wl.name}/system-{p // wl.prompts_per_group}"
                prefix_len = wl.system_prompt_tokens
            out.append(
                Request(
                    request_id=f"s{si}-{i}",
                    prompt_len=wl.prompt_tokens,
                    max_tokens=wl.output_tokens,
                    arrival_time=t,
                    prefix_id=prefix_id,
                    prefix_len=prefix_len,
                )
            )
        start += stage.duration
    return out


@dataclass
class SegmentStats:
    """Client-side statistics of one segment of a replay (milliseconds, requests/s)."""

    sent: int
    ok: int
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)
    throughput_rps: float | None = None
    preempted_requests: int = 0


def _describe(values: FloatArray, keys: Sequence[str]) -> dict[str, float]:
    if values.size == 0:
        return {}
    out: dict[str, float] = {}
    for k in keys:
        if k == "mean":
            out[k] = float(values.mean())
        else:
            out[k] = float(np.percentile(values, float(k[1:])))
    return out


@dataclass
class ReplayResult:
    """Every request of one replay with the client model it is judged under."""

    run: Run
    stages: tuple[Stage, ...]
    records: list[RequestRecord]
    client: ClientModel
    num_gpu_blocks: int
    wall_s: float

    def segment_bounds(self, m: Measured) -> tuple[float, float]:
        starts = np.cumsum([0.0] + [s.duration for s in self.stages])
        if m.segment is None:
            lo, hi = 0.0, float(starts[-1])
        else:
            lo, hi = float(starts[m.segment]), float(starts[m.segment + 1])
        return max(lo, m.exclude_first_s), hi

    def stats(self, m: Measured) -> SegmentStats:
        """The same statistics the measurement reports, for the same segment."""
        lo, hi = self.segment_bounds(m)
        seg = [r for r in self.records if lo <= r.arrival_time < hi]
        ok = [r for r in seg if r.finish_reason == "length" and r.first_token_time is not None]
        over = self.client.overhead_s
        ttft = np.array([r.ttft for r in ok], dtype=np.float64) + over
        e2e = np.array([r.e2e for r in ok], dtype=np.float64) + over
        out_len = np.array([r.output_len for r in ok], dtype=np.float64)
        multi = out_len > 1
        tpot = (e2e[multi] - ttft[multi]) / (out_len[multi] - 1)
        thpt = None
        if ok:
            # inference-perf's completion-based rate: completions over the benchmark's span,
            # which ends with the last response or timeout (~1500 s for a 1200 s overload run).
            span = max(r.finish_time for r in seg) - min(r.arrival_time for r in seg)
            thpt = len(ok) / span if span > 0 else None
        return SegmentStats(
            sent=len(seg),
            ok=len(ok),
            ttft_ms=_describe(ttft * 1e3, ("mean", "p50", "p90", "p99")),
            tpot_ms=_describe(tpot * 1e3, ("mean", "p50", "p99")),
            e2e_ms=_describe(e2e * 1e3, ("mean", "p50", "p90", "p99")),
            throughput_rps=thpt,
            preempted_requests=sum(1 for r in seg if r.num_preemptions > 0),
        )


def replay(
    run: Run,
    seed: int = 0,
    client: ClientModel = CLIENT,
    max_stage_s: float | None = None,
    progress: Callable[[float], None] | None = None,
    calibration: Calibration | None = None,
    on_engine: Callable[[Engine], None] | None = None,
) -> ReplayResult:
    """Drive a fresh engine with the run's traffic, aborting requests the client gave up on.

    `progress` is called with the fraction of the run's virtual time done (for long runs);
    `calibration` replaces the engine's step-time constants (for fitting them); `on_engine` sees
    the engine before it runs (to observe its steps).
    """
    t0 = time.perf_counter()
    stages = scaled_stages(run.workload, max_stage_s)
    requests = build_requests(run, seed, stages)
    engine = Engine(engine_config(run), seed=seed, record_itl=False, calibration=calibration)
    if on_engine is not None:
        on_engine(engine)
    for req in requests:
        engine.add_request(req)
    timeout = run.client_timeout_s
    deadlines: list[tuple[float, str]] = []
    if timeout is not None:
        deadlines = [(r.arrival_time + timeout, r.request_id) for r in requests]
        heapq.heapify(deadlines)
    done: dict[str, RequestRecord] = {}
    total = sum(s.duration for s in stages)
    next_report = 0.0
    while engine.has_unfinished():
        horizon = deadlines[0][0] if deadlines else math.inf
        engine.run_until(horizon)
        for rec in engine.pop_finished():
            done[rec.request_id] = rec
        while deadlines and deadlines[0][0] <= engine.now:
            _, rid = heapq.heappop(deadlines)
            if rid not in done:
                engine.abort_request(rid)
        for rec in engine.pop_finished():
            done[rec.request_id] = rec
        if progress is not None and engine.now >= next_report:
            progress(min(1.0, engine.now / total))
            next_report = engine.now + total / 20
        if not deadlines and engine.has_unfinished():
            engine.run_until(math.inf)
    for rec in engine.pop_finished():
        done[rec.request_id] = rec
    records = [done[r.request_id] for r in requests if r.request_id in done]
    return ReplayResult(
        run=run,
        stages=stages,
        records=records,
        client=client,
        num_gpu_blocks=engine.kv.num_gpu_blocks,
        wall_s=time.perf_counter() - t0,
    )


__all__ = [
    "CLIENT",
    "ClientModel",
    "ReplayResult",
    "SegmentStats",
    "build_requests",
    "engine_config",
    "replay",
    "scaled_stages",
]
