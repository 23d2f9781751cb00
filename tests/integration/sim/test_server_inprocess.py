"""The vllm-sim HTTP server in-process, over a fake engine with fixed 10 ms steps, so the
protocol (OpenAI shapes, SSE, metrics content type, life cycle) is tested apart from the model."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from tests.support.waiting import async_wait_for
from tests.unit.sim.fake_engine import FakeEngine
from vllm_sim import VLLM_VERSION
from vllm_sim.server import SimServer, text_tokens
from vllm_sim.types import EngineConfig

MODEL = "fake/model"
STEP = 0.01


def make_server(
    time_scale: float = 1.0, crash_at: float | None = None, **config: Any
) -> tuple[SimServer, FakeEngine]:
    engine = FakeEngine(EngineConfig(model=MODEL, **config), step_s=STEP, crash_at=crash_at)
    return SimServer(engine, time_scale=time_scale, crash_exit_code=3), engine


@pytest.fixture
async def client() -> AsyncIterator[tuple[TestClient[Any, Any], SimServer, FakeEngine]]:
    server, engine = make_server()
    async with TestClient(TestServer(server.app)) as test_client:
        yield test_client, server, engine


async def sse_events(response: ClientResponse) -> list[tuple[float, Any]]:
    """(arrival wall time, decoded payload or "[DONE]") for each SSE data line."""
    events = []
    async for raw in response.content:
        line = raw.strip()
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :]
            decoded = "[DONE]" if payload == b"[DONE]" else json.loads(payload)
            events.append((time.monotonic(), decoded))
    return events


async def test_small_endpoints(client: tuple[TestClient[Any, Any], SimServer, FakeEngine]) -> None:
    http, _, _ = client
    assert (await http.get("/health")).status == 200
    assert (await (await http.get("/version")).json()) == {"version": VLLM_VERSION}
    assert (await (await http.get("/load")).json()) == {"server_load": 0}
    models = await (await http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


async def test_streamed_chat_completion(
    client: tuple[TestClient[Any, Any], SimServer, FakeEngine],
) -> None:
    http, _, _ = client
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = [payload for _, payload in await sse_events(response)]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 7
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 7
    assert usage["usage"]["prompt_tokens"] > text_tokens("Say something.")  # template tokens


async def test_streamed_completion_tokens_are_paced_by_the_engine(
    client: tuple[TestClient[Any, Any], SimServer, FakeEngine],
) -> None:
    http, _, _ = client
    body = {"prompt": "hello", "max_tokens": 20, "stream": True}
    started = time.monotonic()
    response = await http.post("/v1/completions", json=body)
    events = await sse_events(response)
    tokens = [t for t, payload in events if payload != "[DONE]" and payload["choices"][0]["text"]]
    assert len(tokens) == 20
    # Token i is produced at the end of virtual step i+1; at time scale 1 it cannot arrive
    # earlier in wall time.
    assert tokens[-1] - started >= 20 * STEP * 0.95
    assert "usage" not in events[0][1]  # no include_usage: no usage field in chunks


async def test_time_scale_speeds_up_the_wall_clock() -> None:
    server, engine = make_server(time_scale=20.0)
    async with TestClient(TestServer(server.app)) as http:
        started = time.monotonic()
        response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 100})
        body = await response.json()
        elapsed = time.monotonic() - started
    assert body["usage"]["completion_tokens"] == 100
    assert engine.now >= 100 * STEP  # one virtual second went by...
    assert elapsed < 100 * STEP / 2  # ...in well under one wall second


async def test_non_streamed_completion_and_extension_lengths(
    client: tuple[TestClient[Any, Any], SimServer, FakeEngine],
) -> None:
    http, _, engine = client
    body = {
        "model": MODEL,
        "prompt": "ignored for length",
        "max_tokens": 5,
        "vllm_sim": {"prompt_tokens": 321, "prefix_id": "sys", "prefix_len": 100},
    }
    response = await http.post("/v1/completions", json=body)
    assert response.status == 200
    data = await response.json()
    assert data["object"] == "text_completion"
    assert data["usage"] == {
        "prompt_tokens": 321,
        "completion_tokens": 5,
        "total_tokens": 326,
        "prompt_tokens_details": None,
    }
    assert len(data["choices"][0]["text"].split()) == 5
    assert data["choices"][0]["finish_reason"] == "length"
    (request,) = engine.added
    assert (request.prompt_len, request.prefix_id, request.prefix_len) == (321, "sys", 100)


async def test_default_max_tokens_and_token_id_prompts(
    client: tuple[TestClient[Any, Any], SimServer, FakeEngine],
) -> None:
    http, _, _ = client
    data = await (await http.post("/v1/completions", json={"prompt": [1, 2, 3, 4]})).json()
    assert data["usage"]["prompt_tokens"] == 4
    assert data["usage"]["completion_tokens"] == 16  # vLLM's default max_tokens


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", {"model": "other", "prompt": "x"}, 404),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400),
        ("/v1/completions", {"prompt": ""}, 400),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400),
        ("/v1/chat/completions", {"messages": []}, 400),
        ("/v1/chat/completions", {"messages": "hi"}, 400),
    ],
)
async def test_bad_requests_get_vllm_style_errors(
    client: tuple[TestClient[Any, Any], SimServer, FakeEngine],
    path: str,
    body: dict[str, Any],
    status: int,
) -> None:
    http, _, _ = client
    response = await http.post(path, json=body)
    assert response.status == status
    error = (await response.json())["error"]
    assert error["code"] == status and error["message"]


async def test_invalid_json_is_a_400(
    client: tuple[TestClient[Any, Any], SimServer, FakeEngine],
) -> None:
    http, _, _ = client
    response = await http.post("/v1/completions", data=b"{not json")
    assert response.status == 400


async def test_metrics_keep_colons_whatever_the_accept_header(
    client: tuple[TestClient[Any, Any], SimServer, FakeEngine],
) -> None:
    http, _, _ = client
    await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    openmetrics = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;q=0.5"
    response = await http.get("/metrics", headers={"Accept": openmetrics})
    assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = {
        sample.name: sample
        for family in text_string_to_metric_families(await response.text())
        for sample in family.samples
    }
    assert "vllm:num_requests_running" in samples
    sample = samples["vllm:generation_tokens_total"]
    assert sample.value == 3
    assert sample.labels["model_name"] == MODEL


async def test_disable_log_stats_leaves_only_prometheus_clients_defaults() -> None:
    engine = FakeEngine(EngineConfig(model=MODEL))
    server = SimServer(engine, metrics_enabled=False)
    async with TestClient(TestServer(server.app)) as http:
        text = await (await http.get("/metrics")).text()
    assert "process_cpu_seconds_total" in text and "python_info" in text
    assert "vllm" not in text


async def test_load_counts_in_flight_and_a_disconnect_aborts() -> None:
    server, engine = make_server()
    async with TestClient(TestServer(server.app)) as http:
        body = {"prompt": "x", "max_tokens": 10_000 // 4, "stream": True}
        response = await http.post("/v1/completions", json=body)
        await response.content.readline()  # the stream is running
        load = await (await http.get("/load")).json()
        assert load == {"server_load": 1}
        assert engine.running
        response.close()  # the client goes away
        await async_wait_for(lambda: not engine.running, timeout=5, message="abort on disconnect")
        await async_wait_for(lambda: server.in_flight == 0, timeout=5, message="load back to 0")
        (record,) = engine.finished_log
        assert record.finish_reason == "abort"


async def test_close_aborts_streams_in_flight() -> None:
    server, engine = make_server()
    async with TestClient(TestServer(server.app)) as http:
        body = {"prompt": "x", "max_tokens": 2000, "stream": True}
        response = await http.post("/v1/completions", json=body)
        await response.content.readline()
        await server.close()
        events = [payload for _, payload in await sse_events(response)]
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        assert not engine.running


async def test_engine_crash_ends_streams_and_sets_the_exit_code() -> None:
    server, _ = make_server(crash_at=0.05)
    async with TestClient(TestServer(server.app)) as http:
        body = {"prompt": "x", "max_tokens": 1000, "stream": True}
        response = await http.post("/v1/completions", json=body)
        events = [payload for _, payload in await sse_events(response)]
        assert any("error" in e for e in events if isinstance(e, dict))
        assert server.exit_code is not None
        assert await asyncio.wait_for(server.exit_code, 5) == 3
        assert (await http.get("/health")).status == 503
        refused = await http.post("/v1/completions", json={"prompt": "x"})
        assert refused.status == 500


async def test_an_idle_server_does_not_poll() -> None:
    server, engine = make_server()
    calls = []
    original = engine.run_until

    def counting(t: float, on_tokens: Any = None) -> None:
        calls.append(t)
        original(t, on_tokens)

    engine.run_until = counting  # type: ignore[method-assign]
    async with TestClient(TestServer(server.app)) as http:
        await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        busy = len(calls)
        await asyncio.sleep(0.3)  # measuring the absence of work, not waiting for a state
        assert len(calls) - busy <= 1
