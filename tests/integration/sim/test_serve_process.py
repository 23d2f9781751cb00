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
    # A client that asks for nothing in particular gets text 0.0.4 and vLLM's colons.
    response = requests.get(f"{url}/metrics", timeout=5)
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
        # Prometheus 2.x's Accept header negotiates OpenMetrics, and prometheus_client escapes.
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        om = requests.get(f"{sim.url}/metrics", headers={"Accept": accept}, timeout=5)
    assert om.headers["Content-Type"].startswith("application/openmetrics-text")
    assert "\nvllm_generation_tokens_total{" in om.text
    generated = ("vllm:generation_tokens_total", label)
    assert after[generated] - before.get(generated, 0.0) == 9
    prompt = ("vllm:prompt_tokens_total", label)
    assert after[prompt] - before.get(prompt, 0.0) == 50
    assert after[("vllm:time_to_first_token_seconds_count", label)] == 1
    assert not any(name.startswith("vllm_") for name, _ in after)


class Streams:
    """Streaming chat requests read on threads, for SIGTERM tests."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.events: list[list[Any]] = [[] for _ in range(n)]
        self.threads = [
            threading.Thread(target=self._read, args=(url, max_tokens, i)) for i in range(n)
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, url: str, max_tokens: int, i: int) -> None:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me about GPUs."}],
            "max_tokens": max_tokens,
            "stream": True,
        }
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    payload = line[len(b"data: ") :]
                    event = "[DONE]" if payload == b"[DONE]" else json.loads(payload)
                    self.events[i].append(event)

    def all_streaming(self) -> bool:
        return all(len(e) >= 3 for e in self.events)  # role chunk and two tokens at least

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=30)
        assert not any(t.is_alive() for t in self.threads)

    def outcomes(self) -> list[tuple[int, str | None]]:
        """(content tokens, last finish_reason) per stream, each checked to end with [DONE]."""
        out = []
        for events in self.events:
            assert events and events[-1] == "[DONE]"
            choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
            tokens = sum(1 for c in choices if c["delta"].get("content"))
            out.append((tokens, choices[-1]["finish_reason"]))
        return out


def post_completion(url: str) -> requests.Response:
    body: dict[str, Any] = {"model": MODEL, "prompt": "x", "max_tokens": 5}
    return requests.post(f"{url}/v1/completions", json=body, timeout=10)


def test_sigterm_with_shutdown_timeout_zero_aborts_every_in_flight_stream(tmp_path: Path) -> None:
    with running_sim(tmp_path) as sim:
        streams = Streams(sim.url, 3, 100_000)
        wait_for(streams.all_streaming, timeout=10, message="three streams under way")
        sim.process.send_signal(signal.SIGTERM)
        assert sim.wait_exit() == 0
        streams.join()
    outcomes = streams.outcomes()
    assert all(reason == "abort" and 0 < tokens < 100_000 for tokens, reason in outcomes)
    assert "shutting down, aborting in-flight requests" in sim.log()


def test_sigterm_with_shutdown_timeout_drains_and_refuses_new_requests(tmp_path: Path) -> None:
    # ~300 decode steps of a few ms each: about a second and a half of wall time per stream.
    with running_sim(tmp_path, "--shutdown-timeout", "60") as sim:
        streams = Streams(sim.url, 3, 300)
        wait_for(streams.all_streaming, timeout=10, message="three streams under way")
        sent = time.monotonic()
        sim.process.send_signal(signal.SIGTERM)
        wait_for(lambda: "mode=drain" in sim.log(), timeout=10, message="the drain to begin")
        assert sim.process.poll() is None
        # What vLLM does while it drains: /health stays 200, a new request comes back at
        # once as an aborted, empty completion.
        assert requests.get(f"{sim.url}/health", timeout=5).status_code == 200
        refused = post_completion(sim.url)
        assert refused.status_code == 200
        assert refused.json()["choices"][0]["finish_reason"] == "abort"
        assert refused.json()["usage"]["completion_tokens"] == 0
        assert sim.wait_exit(timeout=30) == 0
        waited = time.monotonic() - sent
        streams.join()
    assert streams.outcomes() == [(300, "length")] * 3
    assert waited < 30  # it left as soon as the streams were done, not at the timeout
    assert "every in-flight request finished" in sim.log()


def test_drain_that_runs_out_of_time_aborts_the_rest(tmp_path: Path) -> None:
    with running_sim(tmp_path, "--shutdown-timeout", "1") as sim:
        streams = Streams(sim.url, 2, 100_000)
        wait_for(streams.all_streaming, timeout=10, message="two streams under way")
        sent = time.monotonic()
        sim.process.send_signal(signal.SIGTERM)
        assert sim.wait_exit(timeout=30) == 0
        waited = time.monotonic() - sent
        streams.join()
    outcomes = streams.outcomes()
    assert all(reason == "abort" and 0 < tokens < 100_000 for tokens, reason in outcomes)
    assert 1.0 <= waited < 10
    assert "drain timed out: aborting 2 in-flight requests" in sim.log()


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
