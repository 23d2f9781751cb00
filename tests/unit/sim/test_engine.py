"""The engine's clock, API contract, reality knobs and failure modes."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from vllm_sim.engine import Engine
from vllm_sim.types import (
    EngineConfig,
    EngineCrashed,
    Reality,
    Request,
    StartupError,
    TokenEvent,
)

CFG = EngineConfig(model="meta-llama/Llama-3.1-8B-Instruct", max_model_len=4096)


def test_a_lone_request_prefills_in_one_step_then_decodes_one_token_per_step() -> None:
    eng = Engine(CFG)
    [rec] = eng.run([Request("a", 1000, 20, 0.5)])
    # the API server hands it to the engine core after the frontend delay
    assert rec.first_scheduled_time == pytest.approx(0.5 + eng.frontend_delay)
    prefill = eng.steptime.step_time(1000, 1, 0, 1000 * 1001 / 2)
    assert rec.ttft == pytest.approx(eng.frontend_delay + prefill)
    assert rec.output_len == 20 and len(rec.itl) == 19
    expected = [eng.steptime.step_time(1, 1, 1000 + i, 1001 + i) for i in range(19)]
    np.testing.assert_allclose(rec.itl, expected, rtol=1e-9)
    assert rec.finish_time == pytest.approx(rec.first_token_time + sum(expected))  # type: ignore[operator]
    assert eng.now == rec.finish_time


def test_requests_stop_at_max_model_len() -> None:
    eng = Engine(dataclasses.replace(CFG, max_model_len=2048))
    [rec] = eng.run([Request("a", 2000, 500)])
    assert rec.output_len == 48 and rec.finish_reason == "length"


def test_run_until_runs_steps_that_start_before_t() -> None:
    eng = Engine(CFG)
    eng.add_request(Request("a", 100, 50, 1.0))
    eng.run_until(0.5)
    assert eng.now == 0.5 and eng.has_unfinished()
    seen = 1.0 + eng.frontend_delay
    assert eng.next_event_time() == seen  # idle: the next thing is the request reaching the core
    eng.run_until(seen)  # the step at `seen` does not start before `seen`
    assert eng.now == seen
    end = eng.next_event_time()
    assert end == pytest.approx(seen + eng.steptime.step_time(100, 1, 0, 100 * 101 / 2))
    eng.run_until(seen + 1e-9)
    assert eng.now == end  # the step that started ran to its end
    events: list[TokenEvent] = []
    eng.run_until(100.0, on_tokens=events.extend)
    assert eng.now == 100.0 and not eng.has_unfinished()
    assert [e.index for e in events] == list(range(1, 50))  # token 0 came before we listened
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert all(a.time <= b.time for a, b in itertools.pairwise(events))
    assert eng.next_event_time() is None
    [rec] = eng.pop_finished()
    assert rec.request_id == "a" and eng.pop_finished() == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_late_arrival_joins_a_later_step_and_keeps_its_arrival_time(
    async_scheduling: bool,
) -> None:
    eng = Engine(dataclasses.replace(CFG, async_scheduling=async_scheduling))
    eng.add_request(Request("a", 2000, 5, 0.0))
    eng.run_until(eng.frontend_delay + 1e-6)  # runs the first step past its start
    assert eng.now > eng.frontend_delay + 0.01
    eng.add_request(Request("b", 10, 2, 0.001))  # arrived while that step ran
    eng.run_until(10.0)
    recs = {r.request_id: r for r in eng.pop_finished()}
    a, b = recs["a"], recs["b"]
    assert a.first_token_time is not None and b.first_scheduled_time is not None
    if async_scheduling:  # step 2 was scheduled while step 1 ran: b waits for step 3
        assert b.first_scheduled_time == pytest.approx(a.first_token_time + a.itl[0])
    else:  # the very next step
        assert b.first_scheduled_time == pytest.approx(a.first_token_time)
    assert b.queue_time == pytest.approx(b.first_scheduled_time - 0.001)


def test_an_idle_engine_picks_work_up_at_once() -> None:
    eng = Engine(CFG)
    [a] = eng.run([Request("a", 100, 3, 0.0)])
    eng.add_request(Request("b", 100, 3, a.finish_time + 0.5))
    eng.run_until(100.0)
    [b] = eng.pop_finished()
    assert b.first_scheduled_time == pytest.approx(b.arrival_time + eng.frontend_delay)


def test_invalid_requests_are_refused() -> None:
    eng = Engine(CFG)
    with pytest.raises(ValueError, match="maximum context length is 4096"):
        eng.add_request(Request("a", 4096, 1))
    eng.add_request(Request("b", 10, 1))
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request(Request("b", 10, 1))


def test_abort_frees_the_cache_and_is_recorded() -> None:
    eng = Engine(CFG)
    eng.add_request(Request("a", 3000, 1000))
    eng.add_request(Request("b", 3000, 1000, 5.0))
    eng.run_until(0.5)
    assert eng.sched.pool.usage() > 0
    eng.abort_request("a")
    eng.abort_request("b")  # not yet arrived
    assert eng.sched.pool.usage() == 0 and not eng.has_unfinished()
    recs = eng.pop_finished()
    assert {r.finish_reason for r in recs} == {"abort"}
    assert eng.metrics.request_success.value("abort") == 2


def test_startup_errors_surface_from_the_constructor() -> None:
    with pytest.raises(StartupError, match="No available memory for the cache blocks"):
        Engine(EngineConfig(model="meta-llama/Llama-2-70b-hf", tensor_parallel_size=2,
                            gpu_memory_utilization=0.8))  # fmt: skip


def workload(n: int, rate: float, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [
        Request(f"r{i}", int(rng.integers(100, 1500)), int(rng.integers(20, 300)), float(t[i]))
        for i in range(n)
    ]


def test_oom_hazard_is_seeded_and_only_above_the_threshold() -> None:
    reality = Reality(oom_above_utilization=0.93, oom_min_batched_tokens=4096, oom_mean_time_s=5)
    hot = dataclasses.replace(CFG, gpu_memory_utilization=0.95)
    crash_times = []
    for _ in range(2):
        eng = Engine(hot, reality, seed=11)
        for r in workload(400, 20):
            eng.add_request(r)
        with pytest.raises(EngineCrashed):
            eng.run_until(1000.0)
        crash_times.append(eng.now)
        with pytest.raises(EngineCrashed):  # dead stays dead
            eng.run_until(2000.0)
    assert crash_times[0] == crash_times[1]
    other = Engine(hot, reality, seed=12)
    with pytest.raises(EngineCrashed):
        other.run_until(1000.0)
    assert other.now != crash_times[0]
    # below the utilization threshold, or with a small token budget: no hazard
    Engine(CFG, reality).run(workload(100, 20))
    small = dataclasses.replace(hot, max_num_batched_tokens=2048)
    Engine(small, reality).run(workload(100, 20))


def test_per_request_overhead_and_jitter() -> None:
    reqs = workload(200, 10, seed=2)
    base = Engine(CFG).run(reqs)
    slow = Engine(CFG, Reality(per_request_overhead_s=0.01)).run(reqs)
    assert np.mean([r.ttft for r in slow]) > np.mean([r.ttft for r in base]) + 0.009  # type: ignore[misc]
    j1 = Engine(CFG, Reality(step_jitter=0.2), seed=1).run(reqs)
    j2 = Engine(CFG, Reality(step_jitter=0.2), seed=1).run(reqs)
    j3 = Engine(CFG, Reality(step_jitter=0.2), seed=2).run(reqs)
    assert [r.finish_time for r in j1] == [r.finish_time for r in j2]
    assert [r.finish_time for r in j1] != [r.finish_time for r in j3]
    # a lone decoding request shows the noise itself: relative std 0.2, mean kept
    [quiet] = Engine(CFG).run([Request("x", 100, 3000)])
    [noisy] = Engine(CFG, Reality(step_jitter=0.2), seed=3).run([Request("x", 100, 3000)])
    ratio = np.asarray(noisy.itl) / np.asarray(quiet.itl)
    assert np.std(ratio) == pytest.approx(0.2, rel=0.1)
    assert np.mean(ratio) == pytest.approx(1.0, abs=0.02)


def test_jitter_skip_ahead_equals_step_by_step() -> None:
    reqs = workload(150, 3, seed=4)
    fast = Engine(CFG, Reality(step_jitter=0.3), seed=5, fast=True).run(reqs)
    slow = Engine(CFG, Reality(step_jitter=0.3), seed=5, fast=False).run(reqs)
    np.testing.assert_allclose([r.finish_time for r in fast], [r.finish_time for r in slow],
                               rtol=1e-9)  # fmt: skip


def test_record_itl_off_keeps_timings() -> None:
    reqs = workload(50, 5, seed=6)
    on = Engine(CFG).run(reqs)
    off = Engine(CFG, record_itl=False).run(reqs)
    assert all(r.itl == [] for r in off)
    assert [r.finish_time for r in on] == [r.finish_time for r in off]


def test_next_event_time_points_at_a_pending_crash_and_never_raises() -> None:
    reality = Reality(oom_above_utilization=0.9, oom_mean_time_s=2.0)
    eng = Engine(dataclasses.replace(CFG, gpu_memory_utilization=0.95), reality, seed=3)
    crash = eng.next_event_time()
    assert crash is not None and crash > 0  # idle, yet something will happen
    eng.add_request(Request("a", 100, 100000 // 100, 0.0))
    t = eng.next_event_time()
    assert t is not None and t <= crash
    with pytest.raises(EngineCrashed):
        eng.run_until(crash + 1.0)
    assert eng.next_event_time() == eng.now  # dead: no raise here, run_until raises again
    with pytest.raises(EngineCrashed):
        eng.run_until(eng.now + 1.0)


def test_abort_during_a_scheduled_step_takes_effect_after_it() -> None:
    eng = Engine(CFG)
    for i in range(3):
        eng.add_request(Request(f"r{i}", 500, 50))
    eng.run_until(0.2)
    end = eng.next_event_time()  # schedules the next step
    assert end is not None
    eng.abort_request("r1")
    assert any(s.rid == "r1" for s in eng.sched.running)  # still in the scheduled step
    eng.run_until(end)  # that step started before `end`: it ran, then the abort applied
    assert not any(s.rid == "r1" for s in eng.sched.running)
    eng.run_until(100.0)
    recs = {r.request_id: r for r in eng.pop_finished()}
    assert recs["r1"].finish_reason == "abort" and recs["r1"].output_len < 50
    assert recs["r0"].output_len == 50 and recs["r2"].output_len == 50


def test_an_uncatalogued_model_and_gpu_run_from_their_spec_files(tmp_path: Path) -> None:
    model = tmp_path / "config.json"
    model.write_text(json.dumps({
        "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }))  # fmt: skip
    gpu = tmp_path / "L4.json"
    gpu.write_text(json.dumps({"memory_gib": 22.0, "hbm_tb_s": 0.3, "bf16_tflops": 121}))
    eng = Engine(EngineConfig(model=str(model), gpu=str(gpu)))
    assert eng.resolved.max_model_len == 8192
    assert (eng.resolved.max_num_batched_tokens, eng.resolved.max_num_seqs) == (2048, 256)
    # 16 layers x 8 KV heads x 64 dims x 2 (K, V) x 2 bytes
    assert eng.kv.kv_bytes_per_token == 16 * 8 * 64 * 2 * 2
    [rec] = eng.run([Request("a", 500, 10)])
    assert rec.output_len == 10 and rec.ttft is not None and rec.ttft > 0


# ---- shutdown drain (vLLM's --shutdown-timeout) ------------------------------------------------


def _loaded_engine(n: int = 8, out: int = 200) -> tuple[Engine, list[Request]]:
    eng = Engine(CFG)
    reqs = [Request(f"r{i}", 300, out, 0.01 * i) for i in range(n)]
    for r in reqs:
        eng.add_request(r)
    eng.run_until(0.5)
    assert len(eng.sched.running) == n
    return eng, reqs


def test_drain_with_timeout_zero_aborts_everything_at_once_and_refuses_new_requests() -> None:
    eng, reqs = _loaded_engine()
    eng.begin_drain(0.0)
    assert eng.draining and eng.drained and not eng.has_unfinished()
    records = eng.pop_finished()
    assert sorted(r.request_id for r in records) == sorted(r.request_id for r in reqs)
    assert {r.finish_reason for r in records} == {"abort"}
    assert all(r.finish_time == eng.now for r in records)
    eng.add_request(Request("late", 100, 10, eng.now + 1.0))
    [late] = eng.pop_finished()
    assert late.finish_reason == "abort" and late.first_token_time is None
    assert late.finish_time == eng.now + 1.0
    assert not eng.has_unfinished()
    reasons = eng.metrics.request_success.values
    assert reasons["abort"] == len(reqs) + 1


def test_drain_with_room_finishes_in_flight_requests_exactly_as_without_it() -> None:
    reference, _ = _loaded_engine()
    reference.run_until(math.inf)
    expected = {r.request_id: r for r in reference.pop_finished()}
    eng, _ = _loaded_engine()
    start = eng.now
    eng.begin_drain(600.0)
    eng.add_request(Request("new", 100, 10, eng.now))
    eng.run_until(math.inf)
    records = {r.request_id: r for r in eng.pop_finished()}
    assert records.pop("new").finish_reason == "abort"
    assert eng.drained and eng.drain_deadline == start + 600.0
    assert records.keys() == expected.keys()
    for rid, rec in records.items():
        assert rec.finish_reason == "length"
        assert rec.finish_time == expected[rid].finish_time
        assert rec.output_len == expected[rid].output_len


@pytest.mark.parametrize("fast", [True, False])
def test_drain_deadline_aborts_what_is_left_at_the_first_step_boundary(fast: bool) -> None:
    eng = Engine(CFG, fast=fast)
    eng.add_request(Request("short", 300, 20, 0.0))
    eng.add_request(Request("long", 300, 2000, 0.0))
    eng.run_until(0.05)
    eng.begin_drain(0.5)
    deadline = eng.drain_deadline
    assert deadline is not None
    eng.run_until(math.inf)
    records = {r.request_id: r for r in eng.pop_finished()}
    assert records["short"].finish_reason == "length"
    long = records["long"]
    assert long.finish_reason == "abort"
    step = eng.steptime.step_time(1, 1, 2000, 2001)
    assert deadline <= long.finish_time < deadline + step
    assert 1 < long.output_len < 2000
    assert eng.drained


def test_drain_deadline_reaches_requests_not_yet_seen_by_the_scheduler() -> None:
    eng = Engine(CFG)
    eng.add_request(Request("a", 100, 10, 1.0))  # seen at 1.0 + frontend delay
    eng.begin_drain(0.001, at=1.0)
    assert eng.next_event_time() == pytest.approx(1.001)  # the deadline comes first
    eng.run_until(1.001)
    [rec] = eng.pop_finished()
    assert rec.finish_reason == "abort" and rec.first_scheduled_time is None
    assert eng.drained and eng.next_event_time() is None


def test_drain_rejects_a_negative_timeout() -> None:
    with pytest.raises(ValueError, match="shutdown timeout"):
        Engine(CFG).begin_drain(-1.0)
