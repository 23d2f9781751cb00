"""`vllm-sim serve` as a process with the real engine: life cycle, OpenAI streaming, metrics."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.sim.simproc import MODEL, running_sim, start_sim, stop_sim
from tests.support.waiting import WaitTimeout, wait_for
from vllm_sim.engine import Engine
from vllm_sim.types import EngineConfig, StartupError


def stream_chat(url: str, max_tokens: int, timeout: float = 30.0) -> list[Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about GPUs."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[Any] = []
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=timeout) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                payload = line[len(b"data: ") :]
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    # Prometheus 2.x's Accept header: the server must still answer in text 0.0.4.
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    response = requests.get(f"{url}/metrics", headers={"Accept": accept}, timeout=5)
    assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def connection_refused(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_refuses_connections_while_loading_then_streams(tmp_path: Path) -> None:
    load_time = 1.5
    started = time.monotonic()
    sim = start_sim(tmp_path, load_time=load_time)
    try:
        assert connection_refused(sim.port)
        sim.wait_healthy()
        assert time.monotonic() - started >= load_time
        events = stream_chat(sim.url, max_tokens=12)
    finally:
        stop_sim(sim)
    assert events[-1] == "[DONE]"
    content = [e for e in events[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(content) == 12
    assert events[-2]["usage"]["completion_tokens"] == 12
    assert sim.process.returncode == 0


def test_metrics_have_vllm_names_and_count_what_was_served(tmp_path: Path) -> None:
    with running_sim(tmp_path, "--served-model-name", "llama") as sim:
        before = samples(sim.url)
        label = (("engine", "0"), ("model_name", "llama"))
        assert ("vllm:num_requests_running", label) in before
        assert any(name == "vllm:cache_config_info" for name, _ in before)
        body: dict[str, Any] = {"model": "llama", "prompt": "x", "max_tokens": 9}
        body["vllm_sim"] = {"prompt_tokens": 50}
        response = requests.post(f"{sim.url}/v1/completions", json=body, timeout=30)
        assert response.json()["usage"]["completion_tokens"] == 9
        after = samples(sim.url)
    generated = ("vllm:generation_tokens_total", label)
    assert after[generated] - before.get(generated, 0.0) == 9
    prompt = ("vllm:prompt_tokens_total", label)
    assert after[prompt] - before.get(prompt, 0.0) == 50
    assert after[("vllm:time_to_first_token_seconds_count", label)] == 1
    assert all(name.startswith("vllm:") for name, _ in after)


def test_sigterm_aborts_in_flight_requests_and_exits_zero(tmp_path: Path) -> None:
    with running_sim(tmp_path) as sim:
        events: list[Any] = []
        reader = threading.Thread(target=lambda: events.extend(stream_chat(sim.url, 100_000)))
        reader.start()
        wait_for(
            lambda: samples(sim.url).get(
                ("vllm:num_requests_running", (("engine", "0"), ("model_name", MODEL)))
            ),
            timeout=10,
            message="the long request is running",
        )
        sim.process.send_signal(signal.SIGTERM)
        assert sim.wait_exit() == 0
        reader.join(timeout=10)
    assert not reader.is_alive()
    assert events[-1] == "[DONE]"
    finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finish[-1] == "abort"
    assert "shutting down" in sim.log()


@pytest.mark.parametrize(
    "args",
    [
        ("--gpu-memory-utilization", "0.2"),  # weights leave no room for the KV cache
        ("--max-num-batched-tokens", "512", "--no-enable-chunked-prefill"),
    ],
)
def test_startup_failure_exits_nonzero_with_the_engines_message(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    config = EngineConfig(
        model=MODEL,
        gpu_memory_utilization=float(args[1]) if args[0] == "--gpu-memory-utilization" else 0.92,
        max_num_batched_tokens=int(args[1]) if args[0] == "--max-num-batched-tokens" else None,
        enable_chunked_prefill="--no-enable-chunked-prefill" not in args,
    )
    with pytest.raises(StartupError) as raised:
        Engine(config)
    sim = start_sim(tmp_path, *args, load_time=0)
    try:
        code = sim.wait_exit()
    finally:
        stop_sim(sim)
    assert code != 0
    assert str(raised.value).splitlines()[0] in sim.log()


def test_unknown_model_exits_nonzero(tmp_path: Path) -> None:
    sim = start_sim(tmp_path, model="nobody/no-such-model", load_time=0)
    try:
        assert sim.wait_exit() != 0
    finally:
        stop_sim(sim)
    assert "no-such-model" in sim.log()


def test_runtime_oom_kills_the_server_with_the_crash_exit_code(tmp_path: Path) -> None:
    sim = start_sim(
        tmp_path,
        "--gpu-memory-utilization", "0.95",
        "--sim-oom-above-utilization", "0.9",
        "--sim-oom-mean-time", "0.3",
        "--sim-crash-exit-code", "137",
    )  # fmt: skip
    try:
        sim.wait_healthy()

        def crashed() -> bool:
            if sim.process.poll() is not None:
                return True
            # Keep the engine busy: the OOM strikes while it runs.
            with contextlib.suppress(requests.RequestException):
                requests.post(f"{sim.url}/v1/completions", json={"prompt": "x"}, timeout=5)
            return sim.process.poll() is not None

        try:
            wait_for(crashed, timeout=30, interval=0.05, message="the simulated OOM")
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}\n--- server log ---\n{sim.log()}") from exc
    finally:
        stop_sim(sim)
    assert sim.process.returncode == 137
    assert "CUDA out of memory" in sim.log()
