"""Replaying a recorded run: its traffic, determinism, client timeouts and the KV sizing check."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from vllm_sim.engine import Engine
from vllm_sim.replay import ClientModel, build_requests, engine_config, replay, scaled_stages
from vllm_sim.runs import Measured, Run, calibration_runs_path, load_runs, parse_runs


def small_run(rate: float = 4.0, duration: float = 20.0, timeout: float | None = 300.0) -> Run:
    [run] = parse_runs(
        {
            "runs": [
                {
                    "id": "small",
                    "model": "meta-llama/Llama-2-7b-hf",
                    "gpu": "H100",
                    "knobs": {"max_num_seqs": 32, "max_num_batched_tokens": 1024},
                    "client_timeout_s": timeout,
                    "workload": {
                        "system_prompt_tokens": 64,
                        "question_tokens": 200,
                        "prompt_tokens": 280,
                        "output_tokens": 40,
                        "groups": 3,
                        "stages": [
                            {"rate": rate, "duration": duration},
                            {"rate": 2 * rate, "duration": duration / 2},
                        ],
                    },
                    "results": [{"segment": 0}, {"segment": 1}, {"segment": "all"}],
                }
            ]
        }
    )
    return run


def test_requests_follow_the_stages_back_to_back() -> None:
    run = small_run()
    reqs = build_requests(run, seed=3)
    times = np.array([r.arrival_time for r in reqs])
    assert np.all(np.diff(times) >= 0)
    s0, s1 = run.workload.stages
    assert sum(1 for t in times if 0 <= t < s0.duration) == s0.requests
    assert sum(1 for t in times if s0.duration <= t < s0.duration + s1.duration) == s1.requests
    assert len(reqs) == s0.requests + s1.requests
    assert {r.prompt_len for r in reqs} == {280}
    assert {r.max_tokens for r in reqs} == {40}
    assert {r.prefix_len for r in reqs} == {64}
    assert len({r.prefix_id for r in reqs}) == 3  # one shared system prompt per group


def test_arrivals_are_poisson() -> None:
    run = small_run(rate=50.0, duration=200.0)
    reqs = [r for r in build_requests(run, seed=1) if r.arrival_time < 200.0]
    gaps = np.diff([r.arrival_time for r in reqs])
    assert abs(gaps.mean() - 1 / 50.0) < 0.05 / 50.0
    assert 0.95 < gaps.std() / gaps.mean() < 1.05  # exponential gaps: CV 1


def test_the_same_seed_gives_the_same_requests_and_replay() -> None:
    run = small_run()
    assert build_requests(run, seed=7) == build_requests(run, seed=7)
    assert build_requests(run, seed=7) != build_requests(run, seed=8)
    a, b = replay(run, seed=7), replay(run, seed=7)
    assert [dataclasses.astuple(r) for r in a.records] == [
        dataclasses.astuple(r) for r in b.records
    ]
    for m in run.results:
        assert a.stats(m) == b.stats(m)
    c = replay(run, seed=8)
    assert a.stats(run.results[2]) != c.stats(run.results[2])


def test_segments_bin_by_arrival_and_drop_the_warm_up() -> None:
    run = small_run()
    result = replay(run, seed=0)
    arrivals = np.array([r.arrival_time for r in result.records])
    s = result.stats(Measured(segment=0, exclude_first_s=5.0))
    assert s.sent == int(np.sum((arrivals >= 5.0) & (arrivals < 20.0)))
    everything = result.stats(Measured(segment=None))
    assert everything.sent == len(build_requests(run, seed=0)) == everything.ok
    assert everything.throughput_rps is not None
    # Unsaturated: completions keep up with arrivals.
    total = run.workload.total_requests / run.workload.duration
    assert everything.throughput_rps == pytest.approx(total, rel=0.1)


def test_client_overhead_moves_ttft_and_e2e_not_tpot() -> None:
    run = small_run()
    base = replay(run, seed=0, client=ClientModel(overhead_s=0.0))
    shifted = dataclasses.replace(base, client=ClientModel(overhead_s=0.02))
    m = Measured(segment=None)
    a, b = base.stats(m), shifted.stats(m)
    for stat in ("mean", "p50", "p99"):
        assert b.ttft_ms[stat] == pytest.approx(a.ttft_ms[stat] + 20.0)
        assert b.e2e_ms[stat] == pytest.approx(a.e2e_ms[stat] + 20.0)
        assert b.tpot_ms[stat] == pytest.approx(a.tpot_ms[stat])


def test_requests_past_the_client_timeout_are_aborted() -> None:
    # Far beyond what 32 sequences can serve: the queue grows until the client gives up.
    run = small_run(rate=400.0, duration=6.0, timeout=2.0)
    result = replay(run, seed=0)
    reasons = {r.finish_reason for r in result.records}
    assert reasons == {"length", "abort"}
    assert len(result.records) == run.workload.total_requests
    for r in result.records:
        if r.finish_reason == "abort":
            assert r.finish_time >= r.arrival_time + 2.0
    stats = result.stats(Measured(segment=None))
    assert 0 < stats.ok < stats.sent
    # Completed requests finish within the timeout, up to the step that was running then.
    assert stats.e2e_ms["p99"] < 2.0e3 + 200.0
    no_timeout = replay(dataclasses.replace(run, client_timeout_s=None), seed=0)
    assert {r.finish_reason for r in no_timeout.records} == {"length"}


def test_quick_mode_cuts_long_stages_at_the_same_rate() -> None:
    run = small_run(rate=4.0, duration=20.0)
    cut = scaled_stages(run.workload, 5.0)
    assert [s.duration for s in cut] == [5.0, 5.0]
    assert [s.effective_rate for s in cut] == pytest.approx([4.0, 8.0])
    assert scaled_stages(run.workload, None) == run.workload.stages


def test_kv_blocks_of_every_calibration_model_are_within_5_percent_of_the_log() -> None:
    checked = set()
    for run in load_runs(calibration_runs_path()):
        if run.kv_blocks is None:
            continue
        blocks = Engine(engine_config(run)).kv.num_gpu_blocks
        assert abs(blocks - run.kv_blocks) / run.kv_blocks <= 0.05, (run.id, blocks)
        checked.add(run.model)
    assert len(checked) == 4


def test_repeated_prompts_are_whole_prompt_prefixes() -> None:
    run = small_run()
    wl = dataclasses.replace(run.workload, repeat_prompts=True, prompts_per_group=2)
    reqs = build_requests(dataclasses.replace(run, workload=wl), seed=0)
    assert {r.prefix_len for r in reqs} == {wl.prompt_tokens}
    assert len({r.prefix_id for r in reqs}) == wl.groups * 2
    cached = replay(dataclasses.replace(run, workload=wl), seed=0)
    unique = replay(run, seed=0)
    hits = sum(r.cached_tokens for r in cached.records)
    assert hits > sum(r.cached_tokens for r in unique.records)
    assert hits > 0.5 * wl.prompt_tokens * len(reqs)


def test_the_fidelity_harness_reports_sim_against_measured(tmp_path: Path) -> None:
    from bench.fidelity.__main__ import main

    run = small_run()
    result = replay(run, seed=0)
    truth = result.stats(Measured(segment=0))
    # A "measurement" 10% faster than the simulation on TPOT and equal on TTFT p50.
    runs_file = tmp_path / "runs.json"
    runs_file.write_text(
        json.dumps(
            {
                "runs": [
                    {
                        "id": "tiny",
                        "model": "meta-llama/Llama-2-7b-hf",
                        "gpu": "H100",
                        "knobs": {"max_num_seqs": 32, "max_num_batched_tokens": 1024},
                        "client_timeout_s": 300,
                        "kv_blocks": result.num_gpu_blocks,
                        "workload": {
                            "system_prompt_tokens": 64,
                            "question_tokens": 200,
                            "prompt_tokens": 280,
                            "output_tokens": 40,
                            "groups": 3,
                            "stages": [{"rate": 4, "duration": 20}, {"rate": 8, "duration": 10}],
                        },
                        "results": [
                            {
                                "segment": 0,
                                "tpot_ms": {"mean": truth.tpot_ms["mean"] / 1.1},
                                "ttft_ms": {"p50": truth.ttft_ms["p50"]},
                            }
                        ],
                    }
                ]
            }
        )
    )
    out = tmp_path / "out"
    assert main([str(runs_file), "--out", str(out)]) == 0
    data = json.loads((out / "fidelity.json").read_text())
    [rep] = data["runs"]
    cells = rep["rows"][0]["cells"]
    assert cells["TPOT mean"]["error"] == pytest.approx(0.1)
    assert cells["TTFT p50"]["error"] == pytest.approx(0.0, abs=1e-9)
    assert rep["kv_blocks"]["error"] == 0
    assert data["median_abs_error"]["TPOT mean"]["median"] == pytest.approx(0.1)
    assert "tiny" in (out / "fidelity.md").read_text()


def test_llama4_scout_fp8_replays_from_its_config_json(tmp_path: Path) -> None:
    """A held-out architecture: FP8 weights with a BF16 KV cache, a shared expert beside 16
    routed ones, the language model nested under text_config, TP2 on H100."""
    from tests.unit.sim.test_catalog import SCOUT_FP8

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SCOUT_FP8))
    data = {
        "format": "vllm-sim-runs/v1",
        "runs": [{
            "id": "scout", "model": str(path), "gpu": "H100", "tp": 2, "quantization": "fp8",
            "knobs": {"max_num_seqs": 128, "max_num_batched_tokens": 2048,
                      "kv_cache_dtype": "auto"},
            "workload": {"system_prompt_tokens": 100, "question_tokens": 447,
                         "output_tokens": 64, "groups": 3, "prompts_per_group": 3,
                         "repeat_prompts": True, "stages": [{"rate": 4, "duration": 20}]},
            "results": [{"segment": 0, "tpot_ms": {"mean": 10.0}}],
        }],
    }  # fmt: skip
    [run] = parse_runs(data)
    cfg = engine_config(run)
    assert cfg.quantization is None  # the checkpoint's own config says FP8
    result = replay(run, seed=0)
    assert len(result.records) == 80 and all(r.finish_reason == "length" for r in result.records)
    engine = Engine(cfg)
    assert engine.model.quant.compute == "fp8" and engine.kv.kv_dtype_bytes == 2
    tpot = result.stats(run.results[0]).tpot_ms["mean"]
    # two H100s read ~17 GB of FP8 weights per step between them: a few ms per token
    assert 3.0 < tpot < 15.0
