"""A deliberately trivial engine with the real Engine's API, so the server and the load
generator can be tested without depending on the step-time model: every step takes exactly
`step_s` virtual seconds and gives one token to every running request (the first token of a
request comes at the end of its first step), with at most `max_num_seqs` running.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from vllm_sim.types import (
    EngineConfig,
    EngineCrashed,
    Reality,
    Request,
    RequestRecord,
    StartupError,
    TokenEvent,
)


@dataclass
class _Running:
    request: Request
    produced: int = 0
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class FakeKV:
    num_gpu_blocks: int = 1000
    block_size: int = 16

    @property
    def kv_cache_size_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


class FakeMetrics:
    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine

    def exposition(
        self, accept: str = "", accept_encoding: str = "", names: object = ()
    ) -> tuple[bytes, dict[str, str]]:
        """Always text 0.0.4 (the real engine negotiates; see vllm_sim.metrics)."""
        return self.render().encode(), {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}

    def render(self) -> str:
        e = self._engine
        labels = f'model_name="{e.model_name}",engine="0"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {len(e.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {len(e.waiting)}",
            # prometheus_client's text format names a counter's family with its _total suffix.
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {e.generation_tokens}",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
        ]
        cumulative = 0
        for bound, count in zip(e.ttft_bounds, e.ttft_counts, strict=True):
            cumulative += count
            lines.append(
                f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{bound}"}} {cumulative}'
            )
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {e.ttft_n}')
        lines.append(f"vllm:time_to_first_token_seconds_count{{{labels}}} {e.ttft_n}")
        lines.append(f"vllm:time_to_first_token_seconds_sum{{{labels}}} {e.ttft_sum}")
        return "\n".join(lines) + "\n"


class FakeEngine:
    def __init__(
        self,
        config: EngineConfig,
        reality: Reality | None = None,
        seed: int = 0,
        record_itl: bool = True,
        *,
        step_s: float = 0.01,
        crash_at: float | None = None,
    ) -> None:
        if config.gpu_memory_utilization < 0.05:
            raise StartupError(
                "No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine."
            )
        self.resolved = replace(
            config,
            max_num_seqs=config.max_num_seqs or 8,
            max_num_batched_tokens=config.max_num_batched_tokens or 2048,
            max_model_len=config.max_model_len or 4096,
        )
        self.reality = reality or Reality()
        self.model_name = config.served_model_name or config.model
        self.kv = FakeKV()
        self.metrics = FakeMetrics(self)
        self.step_s = step_s
        self.crash_at = crash_at
        self.record_itl = record_itl
        self.now = 0.0
        self.waiting: list[Request] = []
        self.running: dict[str, _Running] = {}
        self.finished: list[RequestRecord] = []
        self.finished_log: list[RequestRecord] = []  # never popped, for tests to inspect
        self.added: list[Request] = []
        self.step_end: float | None = None
        self.generation_tokens = 0
        self.ttft_bounds = (0.01, 0.05, 0.1, 0.5, 1.0)
        self.ttft_counts = [0] * len(self.ttft_bounds)
        self.ttft_n = 0
        self.ttft_sum = 0.0
        self.steps = 0
        self.drain_at: float | None = None
        self.drain_deadline: float | None = None

    def add_request(self, request: Request) -> None:
        self.added.append(request)
        if self.drain_at is not None and request.arrival_time >= self.drain_at:
            self._finish(_Running(request), max(self.now, request.arrival_time), "abort")
            return
        self.waiting.append(request)
        if self.step_end is None:
            self._start_step(max(self.now, request.arrival_time))

    def abort_request(self, request_id: str) -> None:
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        state = self.running.pop(request_id, None)
        if state is not None:
            self._finish(state, self.now, "abort")

    def begin_drain(self, timeout_s: float, at: float | None = None) -> None:
        """The real engine's shutdown contract: refuse new requests, abort at the deadline."""
        self.drain_at = self.now if at is None else at
        self.drain_deadline = self.drain_at + timeout_s
        self._abort_after_deadline()

    def _abort_after_deadline(self) -> None:
        if self.drain_deadline is not None and self.now >= self.drain_deadline:
            for request in list(self.waiting):
                self._finish(_Running(request), self.now, "abort")
            self.waiting.clear()
            for request_id in list(self.running):
                self.abort_request(request_id)
            self.step_end = None

    def _start_step(self, start: float) -> None:
        while self.waiting and len(self.running) < (self.resolved.max_num_seqs or 8):
            request = self.waiting.pop(0)
            self.running[request.request_id] = _Running(request, first_scheduled=start)
        self.step_end = start + self.step_s if self.running else None

    def _finish(self, state: _Running, time: float, reason: str) -> None:
        times = state.token_times
        self.finished.append(
            record := RequestRecord(
                request_id=state.request.request_id,
                arrival_time=state.request.arrival_time,
                prompt_len=state.request.prompt_len,
                output_len=state.produced,
                max_tokens=state.request.max_tokens,
                first_scheduled_time=state.first_scheduled,
                first_token_time=times[0] if times else None,
                finish_time=time,
                finish_reason=reason,
                itl=[b - a for a, b in itertools.pairwise(times)] if self.record_itl else [],
            )
        )
        self.finished_log.append(record)

    def _step(self, on_tokens: Callable[[list[TokenEvent]], None] | None) -> None:
        assert self.step_end is not None
        self.now = end = self.step_end
        self.steps += 1
        events = []
        for request_id, state in list(self.running.items()):
            index = state.produced
            state.produced += 1
            state.token_times.append(end)
            self.generation_tokens += 1
            if index == 0:
                ttft = end - state.request.arrival_time
                self.ttft_n += 1
                self.ttft_sum += ttft
                for i, bound in enumerate(self.ttft_bounds):
                    if ttft <= bound:
                        self.ttft_counts[i] += 1
                        break
            done = state.produced >= state.request.max_tokens
            events.append(TokenEvent(request_id, index, end, done, "length" if done else None))
            if done:
                del self.running[request_id]
                self._finish(state, end, "length")
        self._start_step(end)
        if on_tokens is not None and events:
            on_tokens(events)

    def run_until(
        self, t: float, on_tokens: Callable[[list[TokenEvent]], None] | None = None
    ) -> None:
        if self.crash_at is not None and t >= self.crash_at:
            self.now = self.crash_at
            raise EngineCrashed("CUDA out of memory (fake)")
        while self.step_end is not None and self.step_end <= t:
            self._step(on_tokens)
            self._abort_after_deadline()
        if t != float("inf"):
            self.now = max(self.now, t)
        self._abort_after_deadline()

    def next_event_time(self) -> float | None:
        return self.step_end

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_finished(self) -> list[RequestRecord]:
        done, self.finished = self.finished, []
        return done

    def run(self, requests: Iterable[Request]) -> list[RequestRecord]:
        records: list[RequestRecord] = []
        for request in sorted(requests, key=lambda r: r.arrival_time):
            self.run_until(request.arrival_time)
            self.add_request(request)
        while self.has_unfinished():
            upcoming = self.next_event_time()
            assert upcoming is not None
            self.run_until(upcoming)
        records.extend(self.pop_finished())
        return records
