"""How many simulated seconds vllm-sim's engine runs per wall-clock second, on one core.

Goal: >= 2000x real time for Llama-3.1-8B on H100 with a chat workload at saturation (the
highest rate the engine still keeps up with: 36 req/s with the current step-time model, where
~400 requests run, a few wait and none is preempted; at 37 the queue grows without bound over
20,000 requests), same outputs for the same seed. Measured as a
server runs the engine: metrics on (they always are), per-request ITL lists off; `--itl`
records them as bench/tuning's methods do. The other cases watch the regimes around it: 70B
TP4 past saturation (KV pressure, preemption, the scheduler's array path), a quarter of
capacity (long pure-decode stretches), and 1024 concurrent sequences.
Run: .venv/bin/python bench/sim_speed.py [--requests N] [--repeat N] [--itl] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from dataclasses import dataclass

import numpy as np

from vllm_sim.engine import Engine
from vllm_sim.types import EngineConfig, Request


def chat_workload(
    n: int,
    rate: float,
    seed: int = 0,
    prompt_mean: float = 600,
    output_mean: float = 250,
    max_prompt: int = 7000,
) -> list[Request]:
    """Poisson arrivals; prompt and output lengths log-normal (sigma 0.8) with the given means."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    prompts = rng.lognormal(np.log(prompt_mean) - sigma**2 / 2, sigma, n)
    outputs = rng.lognormal(np.log(output_mean) - sigma**2 / 2, sigma, n)
    return [
        Request(f"r{i}", int(np.clip(prompts[i], 1, max_prompt)), int(np.clip(outputs[i], 1, 1000)),
                float(arrivals[i]))
        for i in range(n)
    ]  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    config: EngineConfig
    rate: float
    prompt_mean: float = 600
    output_mean: float = 250


CASES = [
    Case("Llama-3.1-8B H100 TP1, chat at saturation",
         EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="H100", max_model_len=8192),
         rate=36.0),
    Case("Llama-3.1-70B H100 TP4, chat at saturation",
         EngineConfig(model="meta-llama/Llama-3.1-70B-Instruct", gpu="H100",
                      tensor_parallel_size=4, max_model_len=8192),
         rate=16.0),
    Case("Llama-3.1-8B H100 TP1, chat at ~25% of capacity (skip-ahead regime)",
         EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="H100", max_model_len=8192),
         rate=10.0),
    Case("Llama-3.1-8B H200 TP1, 1024 concurrent sequences",
         EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="H200", max_model_len=4096,
                      kv_cache_dtype="fp8"),
         rate=60.0, prompt_mean=300, output_mean=900),
]  # fmt: skip


def run_case(case: Case, n: int, record_itl: bool) -> float:
    max_prompt = (case.config.max_model_len or 8192) - 1000
    reqs = chat_workload(n, case.rate, prompt_mean=case.prompt_mean,
                         output_mean=case.output_mean, max_prompt=max_prompt)  # fmt: skip
    eng = Engine(case.config, record_itl=record_itl)
    for r in reqs:
        eng.add_request(r)
    t0 = time.perf_counter()
    c0 = time.process_time()
    eng.run_until(reqs[-1].arrival_time)  # the loaded part; the drain is not saturation
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    sim = eng.now
    recs = eng.pop_finished()
    tput = sum(r.output_len for r in recs) / sim
    print(
        f"{case.name}: {sim:8.1f} s simulated in {wall:6.2f} s wall = {sim / wall:7.0f}x real "
        f"time ({sim / cpu:.0f}x per CPU second) | {len(recs)} finished, "
        f"{len(eng.sched.running)} running, "
        f"{len(eng.sched.waiting)} waiting at the end, {eng.sched.step_index} steps "
        f"({wall / max(eng.sched.step_index, 1) * 1e6:.0f} us/step), {tput:.0f} output tok/s"
    )
    return sim / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--itl", action="store_true", help="record per-request ITL lists")
    ap.add_argument("--repeat", type=int, default=1, help="runs per case; the best is reported")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    for case in CASES:
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(run_case, case, args.requests, args.itl)
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
            continue
        best = max(run_case(case, args.requests, args.itl) for _ in range(args.repeat))
        if args.repeat > 1:
            print(f"  best of {args.repeat}: {best:.0f}x real time per CPU second")


if __name__ == "__main__":
    main()
