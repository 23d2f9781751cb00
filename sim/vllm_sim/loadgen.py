"""Load a vLLM (or vllm-sim) server over HTTP and measure it from the client's side.

Each request streams `/v1/completions` and the client notes the wall time of every chunk, so
TTFT and inter-token gaps are what a user would see, network and server overhead included. The
workload's arrival times are virtual seconds; against a server with time scale s they are sent
at arrival / s wall seconds (so the server's virtual request rate is the workload's rate), and the
summary converts client latencies back to virtual seconds (x s), comparable with engine records.

Requests carry the `vllm_sim` extension (exact prompt length and shared prefix) and, for a real
vLLM, a prompt of about the same number of tokens plus `ignore_eos`, so the output length is
`max_tokens` on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from vllm_sim.types import Request, RequestRecord
from vllm_sim.workload import Slo, Summary, WorkloadSpec, summarize


@dataclass
class ClientRecord:
    """One request as the client saw it; times are wall seconds since the run started."""

    request_id: str
    prompt_len: int
    max_tokens: int
    scheduled_time: float  # when the workload wanted it sent
    send_time: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float = 0.0
    output_len: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def to_record(self, time_scale: float = 1.0) -> RequestRecord:
        """As an engine-style record in virtual seconds (wall x time_scale)."""
        s = time_scale
        gaps = [(b - a) * s for a, b in zip(self.token_times, self.token_times[1:], strict=False)]
        return RequestRecord(
            request_id=self.request_id,
            arrival_time=self.send_time * s,
            prompt_len=self.prompt_len,
            output_len=self.output_len,
            max_tokens=self.max_tokens,
            first_scheduled_time=None,
            first_token_time=None if self.first_token_time is None else self.first_token_time * s,
            finish_time=self.finish_time * s,
            finish_reason="error" if self.error else (self.finish_reason or "length"),
            itl=gaps,
        )


@dataclass
class LoadResult:
    records: list[ClientRecord]
    summary: Summary
    wall_duration: float
    not_sent: int = 0  # requests the time or count bound cut off

    def as_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary.as_dict(),
            "wall_duration": self.wall_duration,
            "not_sent": self.not_sent,
            "records": [r.__dict__ for r in self.records],
        }


def prompt_text(request: Request) -> str:
    """About `prompt_len` tokens of text for a real tokenizer (one short word per token), with
    the shared prefix identical across its group so a real prefix cache can hit too."""
    shared = request.prefix_len if request.prefix_id else 0
    head = f"{request.prefix_id} " + "sys " * max(shared - 1, 0) if shared else ""
    return head + "hi " * max(request.prompt_len - shared, 1)


def request_body(request: Request, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt_text(request),
        "max_tokens": request.max_tokens,
        "min_tokens": request.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "vllm_sim": {"prompt_tokens": request.prompt_len},
    }
    if model is not None:
        body["model"] = model
    if request.prefix_id:
        body["vllm_sim"].update(prefix_id=request.prefix_id, prefix_len=request.prefix_len)
    return body


async def served_model(session: aiohttp.ClientSession, url: str) -> str | None:
    async with session.get(f"{url}/v1/models") as response:
        response.raise_for_status()
        data = await response.json()
    models = data.get("data") or []
    return str(models[0]["id"]) if models else None


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    record: ClientRecord,
    start: float,
) -> None:
    record.send_time = time.monotonic() - start
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                now = time.monotonic() - start
                chunk = json.loads(payload)
                if "error" in chunk:
                    record.error = str(chunk["error"])
                    continue
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        if record.first_token_time is None:
                            record.first_token_time = now
                        record.token_times.append(now)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    record.output_len = int(usage.get("completion_tokens", record.output_len))
            if not record.output_len:
                record.output_len = len(record.token_times)
            if record.finish_reason == "abort":
                record.error = "aborted by the server"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        record.error = "cancelled at the time limit"
        raise
    finally:
        record.finish_time = time.monotonic() - start


async def _cancel_all(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel the tasks still running and wait for them (each records its cancellation as
    an error, `_one`)."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


async def run_http(
    url: str,
    workload: WorkloadSpec | Sequence[Request],
    *,
    time_scale: float = 1.0,
    concurrency: int | None = None,
    max_requests: int | None = None,
    duration: float | None = None,
    timeout: float | None = None,
    model: str | None = None,
    slo: Slo | None = None,
    progress: Callable[[float, int, int], None] | None = None,
    progress_every: float = 10.0,
    on_done: Callable[[ClientRecord], None] | None = None,
) -> LoadResult:
    """Send the workload's requests at their arrival times (wall = virtual / time_scale).

    Bounded: at most `max_requests`, none sent after `duration` wall seconds, and everything
    still open `timeout` wall seconds after the start is cancelled (counted as errors).
    `concurrency` caps requests in flight; later ones wait for a slot, and their latency counts
    from when they were actually sent (as `vllm bench serve --max-concurrency`). `on_done` sees
    each request as it finishes (a live count of failures, while the run goes on).
    """
    requests = workload.generate() if isinstance(workload, WorkloadSpec) else list(workload)
    requests.sort(key=lambda r: r.arrival_time)
    if max_requests is not None:
        requests = requests[:max_requests]
    if duration is not None:
        requests = [r for r in requests if r.arrival_time / time_scale < duration]
    base = url.rstrip("/")
    connector = aiohttp.TCPConnector(limit=concurrency or 0)
    session_timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    records: list[ClientRecord] = []
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    async with aiohttp.ClientSession(connector=connector, timeout=session_timeout) as session:
        if model is None:
            model = await served_model(session, base)
        start = time.monotonic()

        async def send(request: Request, record: ClientRecord) -> None:
            try:
                if slots is None:
                    await _one(session, base, request_body(request, model), record, start)
                    return
                async with slots:
                    await _one(session, base, request_body(request, model), record, start)
            finally:
                if on_done is not None:
                    on_done(record)

        tasks: list[asyncio.Task[None]] = []

        async def launch() -> None:
            next_report = progress_every
            for request in requests:
                due = request.arrival_time / time_scale
                delay = due - (time.monotonic() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                record = ClientRecord(
                    request.request_id, request.prompt_len, request.max_tokens, due
                )
                records.append(record)
                tasks.append(asyncio.create_task(send(request, record)))
                elapsed = time.monotonic() - start
                if progress is not None and elapsed >= next_report:
                    finished = sum(1 for t in tasks if t.done())
                    progress(elapsed, finished, len(requests))
                    next_report = elapsed + progress_every

        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(launch(), timeout)
            left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
            if tasks:
                await asyncio.wait(tasks, timeout=left)
        finally:
            # At the time limit, or when the run itself is cancelled (the demo stops its
            # traffic so): end every request before the session closes under it (aiohttp
            # would fail the read with a bare RuntimeError that no one retrieves).
            await _cancel_all(tasks)
        wall = time.monotonic() - start
    client_records = [r.to_record(time_scale) for r in records]
    summary = summarize(client_records, duration=wall * time_scale, slo=slo, submitted=len(records))
    return LoadResult(records, summary, wall, not_sent=len(requests) - len(records))
