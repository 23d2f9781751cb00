"""The three knobs move latency, queueing and capacity the way vLLM's physics says."""

from __future__ import annotations

import dataclasses

import numpy as np

from vllm_sim.engine import Engine
from vllm_sim.types import EngineConfig, Request, RequestRecord

BASE = EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", max_model_len=8192)


def mixed_workload(n: int = 300, rate: float = 6.0, seed: int = 0) -> list[Request]:
    """Chat decodes with a long document prompt every few requests."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    reqs = []
    for i in range(n):
        long = i % 5 == 0
        prompt = int(rng.integers(5000, 7000)) if long else int(rng.integers(100, 600))
        reqs.append(Request(f"r{i}", prompt, int(rng.integers(100, 300)), float(t[i])))
    return reqs


def p99_itl(records: list[RequestRecord]) -> float:
    return float(np.percentile(np.concatenate([r.itl for r in records]), 99))


def mean_ttft(records: list[RequestRecord]) -> float:
    """Of the long prompts: the ones a token budget chunks."""
    return float(np.mean([r.ttft for r in records if r.prompt_len >= 5000]))


def run(cfg: EngineConfig, reqs: list[Request]) -> tuple[Engine, list[RequestRecord]]:
    eng = Engine(cfg, record_itl=True)
    return eng, eng.run(reqs)


def test_smaller_token_budget_trades_ttft_for_itl() -> None:
    # Busy enough that ~100 requests decode at once: their tokens come out of the same budget.
    reqs = mixed_workload(rate=30.0)
    _, big = run(dataclasses.replace(BASE, max_num_batched_tokens=8192), reqs)
    _, small = run(dataclasses.replace(BASE, max_num_batched_tokens=512), reqs)
    assert p99_itl(small) < 0.5 * p99_itl(big)
    assert mean_ttft(small) > 1.3 * mean_ttft(big)


def test_too_few_seqs_queue_requests() -> None:
    reqs = mixed_workload(rate=8.0)
    _, roomy = run(dataclasses.replace(BASE, max_num_seqs=256), reqs)
    _, tight = run(dataclasses.replace(BASE, max_num_seqs=4), reqs)
    q_roomy = np.mean([r.queue_time for r in roomy])
    q_tight = np.mean([r.queue_time for r in tight])
    assert q_tight > 10 * max(q_roomy, 1e-3)


def chat(n: int, rate: float, seed: int = 1) -> list[Request]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [
        Request(f"c{i}", int(rng.integers(400, 1200)), int(rng.integers(300, 700)), float(t[i]))
        for i in range(n)
    ]


def throughput(records: list[RequestRecord]) -> float:
    start = min(r.arrival_time for r in records)
    end = max(r.finish_time for r in records)
    return sum(r.output_len for r in records) / (end - start)


def test_too_little_kv_memory_preempts_then_collapses() -> None:
    reqs = chat(500, 25.0)
    cfg = dataclasses.replace(BASE, max_model_len=4096, max_num_batched_tokens=2048,
                              max_num_seqs=256)  # fmt: skip
    ample_eng, ample = run(dataclasses.replace(cfg, gpu_memory_utilization=0.92), reqs)
    tight_eng, tight = run(dataclasses.replace(cfg, gpu_memory_utilization=0.235), reqs)
    assert tight_eng.kv.num_gpu_blocks < ample_eng.kv.num_gpu_blocks / 10
    assert ample_eng.metrics.num_preemptions.value() == 0
    assert tight_eng.metrics.num_preemptions.value() > 50
    assert sum(r.num_preemptions for r in tight) == tight_eng.metrics.num_preemptions.value()
    assert throughput(tight) < 0.7 * throughput(ample)
    assert all(r.output_len == q.max_tokens for r, q in zip(
        sorted(tight, key=lambda r: r.request_id), sorted(reqs, key=lambda q: q.request_id),
        strict=True))  # fmt: skip


def test_fp8_kv_doubles_capacity_and_concurrency() -> None:
    bf16 = Engine(BASE)
    fp8 = Engine(dataclasses.replace(BASE, kv_cache_dtype="fp8"))
    ratio = fp8.kv.num_gpu_blocks / bf16.kv.num_gpu_blocks
    assert abs(ratio - 2.0) < 0.04
    assert abs(fp8.kv.kv_cache_size_tokens / bf16.kv.kv_cache_size_tokens - 2.0) < 0.04
