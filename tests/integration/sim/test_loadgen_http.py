"""The HTTP load generator against an in-process vllm-sim server (fake engine, 10 ms steps)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from tests.unit.sim.fake_engine import FakeEngine
from vllm_sim.loadgen import request_body, run_http
from vllm_sim.server import SimServer
from vllm_sim.types import EngineConfig, Request
from vllm_sim.workload import WorkloadSpec

STEP = 0.01


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, SimServer, FakeEngine]]:
    engine = FakeEngine(EngineConfig(model="fake/model", max_num_seqs=64), step_s=STEP)
    server = SimServer(engine, time_scale=1.0)
    test_server = TestServer(server.app, host="127.0.0.1")
    await test_server.start_server()
    try:
        yield str(test_server.make_url("")).rstrip("/"), server, engine
    finally:
        await test_server.close()


def small_workload(**overrides: Any) -> WorkloadSpec:
    spec: dict[str, Any] = {
        "prompt": {"dist": "uniform", "min": 10, "max": 50},
        "output": {"dist": "uniform", "min": 3, "max": 12},
        "rate": 40,
        "duration": 1.0,
        "seed": 11,
    }
    spec.update(overrides)
    return WorkloadSpec.from_dict(spec)


async def test_every_request_streams_its_tokens(
    served: tuple[str, SimServer, FakeEngine],
) -> None:
    url, _, engine = served
    workload = small_workload()
    requests = workload.generate()
    result = await run_http(url, workload, timeout=30)
    assert len(result.records) == len(requests) > 10
    by_id = {r.request_id: r for r in requests}
    for record in result.records:
        assert record.error is None, record.error
        assert record.output_len == by_id[record.request_id].max_tokens
        assert len(record.token_times) == record.output_len
        assert record.first_token_time is not None
        # The fake engine's first token comes at the end of a 10 ms step at the earliest.
        assert record.first_token_time - record.send_time >= STEP * 0.9
    # What the engine saw matches what was sent (lengths from the vllm_sim extension).
    sent = sorted((r.prompt_len, r.max_tokens) for r in engine.added)
    assert sent == sorted((r.prompt_len, r.max_tokens) for r in requests)
    summary = result.summary
    assert summary.completed == len(requests)
    assert summary.ttft["p50"] >= STEP * 0.9
    assert summary.itl["p50"] >= STEP * 0.5


async def test_arrivals_follow_the_workload_in_wall_time(
    served: tuple[str, SimServer, FakeEngine],
) -> None:
    url, _, _ = served
    workload = small_workload(rate=20, duration=1.0)
    requests = workload.generate()
    result = await run_http(url, workload, time_scale=2.0, timeout=30)
    sends = sorted(r.send_time for r in result.records)
    # At time scale 2, arrival t (virtual) is sent at t / 2 wall seconds, never earlier.
    expected = sorted(r.arrival_time / 2.0 for r in requests)
    assert all(s >= e - 1e-3 for s, e in zip(sends, expected, strict=True))
    assert sends[-1] < expected[-1] + 0.5


async def test_concurrency_cap(served: tuple[str, SimServer, FakeEngine]) -> None:
    url, server, _ = served
    seen: list[int] = []
    original = server.engine.add_request

    def spy(request: Request) -> None:
        seen.append(server.in_flight)
        original(request)

    server.engine.add_request = spy  # type: ignore[method-assign]
    workload = small_workload(rate=100, duration=0.2, output=5)
    result = await run_http(url, workload, concurrency=2, timeout=30)
    assert all(r.error is None for r in result.records)
    assert len(seen) == len(result.records) > 4
    assert max(seen) <= 2


async def test_bounds_cut_the_run(served: tuple[str, SimServer, FakeEngine]) -> None:
    url, _, _ = served
    long = small_workload(rate=10, duration=1.0, output=10_000 // 4)
    result = await run_http(url, long, max_requests=3, timeout=0.5)
    assert len(result.records) == 3
    assert all(r.error and "cancelled" in r.error for r in result.records)
    assert result.summary.completed == 0
    assert result.wall_duration < 5


def test_request_body_carries_exact_lengths_and_prefix() -> None:
    request = Request("r1", prompt_len=300, max_tokens=40, prefix_id="g1", prefix_len=120)
    body = request_body(request, "m")
    assert body["vllm_sim"] == {"prompt_tokens": 300, "prefix_id": "g1", "prefix_len": 120}
    assert body["max_tokens"] == 40 and body["ignore_eos"] is True and body["stream"] is True
    # For a real server the text is about one token per word, and the prefix is shared text.
    assert len(body["prompt"].split()) == pytest.approx(300, abs=2)
    other = request_body(Request("r2", 500, 10, prefix_id="g1", prefix_len=120), "m")
    shared = len(" ".join(body["prompt"].split()[:120]))
    assert body["prompt"][:shared] == other["prompt"][:shared]


async def test_each_request_is_seen_as_it_finishes(
    served: tuple[str, SimServer, FakeEngine],
) -> None:
    url, _, _ = served
    seen: list[tuple[str, bool]] = []
    workload = small_workload(rate=20, duration=0.5)
    result = await run_http(
        url, workload, timeout=30, on_done=lambda r: seen.append((r.request_id, r.finish_time > 0))
    )
    # Every request, once, each already finished when it was seen.
    assert sorted(i for i, _ in seen) == sorted(r.request_id for r in result.records)
    assert len(seen) > 5 and all(done for _, done in seen)


async def test_a_cancelled_run_ends_every_request_before_its_session_closes(
    served: tuple[str, SimServer, FakeEngine],
) -> None:
    """Cancelling the run (the demo stops its traffic so) cancels the requests in flight and
    waits for them: none is left reading from a closed session (aiohttp then raises a bare
    RuntimeError that no one retrieves), and each one reports its cancellation."""
    url, _, engine = served
    seen: list[str | None] = []
    long = small_workload(rate=20, duration=0.5, output=10_000 // 4)
    run = asyncio.ensure_future(
        run_http(url, long, timeout=60, on_done=lambda r: seen.append(r.error))
    )
    deadline = asyncio.get_running_loop().time() + 10
    while len(engine.added) < 3:
        assert asyncio.get_running_loop().time() < deadline, "no request reached the engine"
        await asyncio.sleep(0.01)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    left = [t for t in asyncio.all_tasks() if "run_http" in t.get_coro().__qualname__]
    assert left == []
    assert len(seen) >= 3 and all(e is not None and "cancelled" in e for e in seen)
