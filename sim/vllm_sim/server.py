"""A simulated vLLM OpenAI-compatible server: the engine, driven in real time, behind HTTP.

The operator and its tests talk to this exactly as to vLLM: the same endpoints, the same
streaming shapes, `/metrics` with vLLM's names, and vLLM's life cycle (the port refuses
connections while the model "loads", a startup error exits non-zero with vLLM's message, a
run-time CUDA OOM kills the process, SIGTERM shuts down as `--shutdown-timeout` says and exits 0).

Shutdown follows vLLM's API server (`vllm/entrypoints/launchers/launcher.py`, `serve_http`:
on SIGTERM it calls `engine_client.shutdown(timeout)` and only then stops the HTTP server) and
EngineCore (`vllm/v1/engine/core.py`, `_handle_shutdown` and `_reject_add_in_shutdown`): with
timeout 0 every in-flight request is aborted at once; with N > 0 the server keeps listening and
/health keeps answering 200 (it fails only for a dead engine), in-flight requests run on for up
to N seconds, and a request that arrives meanwhile is answered at once as an aborted completion
(HTTP 200, finish_reason "abort", no tokens; a stream sends no choice chunk, only [DONE]).
Whatever is unfinished after N seconds is aborted, then the process exits.

Time: virtual = (wall - t0) x time_scale, where t0 is when the server became ready. The driver
advances the engine to "now" and then sleeps until the engine's next event (or a new request), so
an idle server costs no CPU. With a time scale s, latency histograms and gauges are in virtual
seconds (what the simulated GPU would show), while counters count events, so a Prometheus rate()
per wall second equals the virtual rate x s, and client-side latencies are virtual ones / s.

Prompt length comes from the request: the `vllm_sim` extension object
`{"prompt_tokens": N, "prefix_id": "sys-1", "prefix_len": 200}` when present (load generators use
it to control lengths and shared prefixes exactly), a list of token ids, or else the text at
about 4 characters per token (plus a few template tokens per chat message). Output length is
`max_tokens` (ignore_eos semantics: the simulated model never stops early), default 16.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from aiohttp import web

from vllm_sim import VLLM_VERSION
from vllm_sim.flags import ServeOptions
from vllm_sim.types import EngineConfig, EngineCrashed, Reality, Request, StartupError, TokenEvent

CHARS_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4  # role header and separators of a typical chat template
CHAT_TOKENS_REPLY_PRIMER = 3  # the assistant header the template appends
DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions
MIN_SLEEP_S = 0.001
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs")


class SimEngine(Protocol):
    """What the server needs from `vllm_sim.engine.Engine`."""

    @property
    def now(self) -> float: ...

    @property
    def resolved(self) -> EngineConfig: ...

    @property
    def metrics(self) -> Any: ...

    def add_request(self, request: Request) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def run_until(
        self, t: float, on_tokens: Callable[[list[TokenEvent]], None] | None = None
    ) -> None: ...

    def next_event_time(self) -> float | None: ...

    def has_unfinished(self) -> bool: ...

    def pop_finished(self) -> list[Any]: ...

    def begin_drain(self, timeout_s: float, at: float | None = None) -> None: ...


EngineFactory = Callable[[EngineConfig, Reality, int], SimEngine]


def default_engine_factory(
    config: EngineConfig, reality: Reality, seed: int, record_itl: bool = False
) -> SimEngine:
    """The real engine; a server reports through metrics, so per-request ITL lists are off."""
    from vllm_sim.engine import Engine

    return Engine(config, reality, seed=seed, record_itl=record_itl)


def text_tokens(text: str) -> int:
    """A deterministic stand-in for a tokenizer (about 4 characters per token)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN)) if text else 0


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def chat_prompt_tokens(messages: object) -> int:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    total = CHAT_TOKENS_REPLY_PRIMER
    for message in messages:
        if not isinstance(message, Mapping):
            raise RequestError("each message must be an object")
        total += CHAT_TOKENS_PER_MESSAGE + text_tokens(_content_text(message.get("content")))
    return total


def completion_prompt_tokens(prompt: object) -> int:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("The prompt cannot be empty.")
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return completion_prompt_tokens(prompt[0])
    raise RequestError("prompt must be a string, a list of token ids, or a list of one string")


class RequestError(Exception):
    """A client error, answered in vLLM's error shape."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind

    def response(self) -> web.Response:
        error = {"message": self.message, "type": self.kind, "param": None, "code": self.status}
        return web.json_response({"error": error}, status=self.status)


@dataclass(frozen=True)
class Generation:
    """One parsed generation request."""

    prompt_len: int
    max_tokens: int
    stream: bool
    include_usage: bool
    prefix_id: str | None = None
    prefix_len: int = 0


def _int_field(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{key} must be an integer")
    return value


def parse_generation(body: object, chat: bool) -> Generation:
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    extension = body.get("vllm_sim") or {}
    if not isinstance(extension, Mapping):
        raise RequestError("vllm_sim must be an object")
    if extension.get("prompt_tokens") is not None:
        prompt_len = _int_field(extension, "prompt_tokens", None) or 0
    elif chat:
        prompt_len = chat_prompt_tokens(body.get("messages"))
    else:
        prompt_len = completion_prompt_tokens(body.get("prompt"))
    if prompt_len < 1:
        raise RequestError("the prompt must have at least one token")
    max_tokens = _int_field(body, "max_completion_tokens", None) if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None or max_tokens < 1:
        raise RequestError("max_tokens must be at least 1")
    n = body.get("n", 1)
    if n != 1:
        raise RequestError("vllm-sim supports only n=1")
    prefix_len = _int_field(extension, "prefix_len", 0) or 0
    prefix_id = extension.get("prefix_id")
    stream_options = body.get("stream_options") or {}
    return Generation(
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=bool(
            isinstance(stream_options, Mapping) and stream_options.get("include_usage")
        ),
        prefix_id=None if prefix_id is None else str(prefix_id),
        prefix_len=min(max(prefix_len, 0), prompt_len) if prefix_id is not None else 0,
    )


def token_text(index: int) -> str:
    return f" {_WORDS[index % len(_WORDS)]}"


_END = object()  # sentinel put in a stream when the request ends without a final token


class SimServer:
    """The HTTP application around one engine; `start()` begins the virtual clock."""

    def __init__(
        self,
        engine: SimEngine,
        *,
        time_scale: float = 1.0,
        metrics_enabled: bool = True,
        crash_exit_code: int = 1,
        clock: Callable[[], float] = time.monotonic,
        log: TextIO | None = None,
    ) -> None:
        self.engine = engine
        resolved = engine.resolved
        self.model = resolved.model
        self.model_name = resolved.served_model_name or resolved.model
        self.max_model_len = resolved.max_model_len
        self.time_scale = time_scale
        self.metrics_enabled = metrics_enabled
        self.crash_exit_code = crash_exit_code
        self._clock = clock
        self._log = log or sys.stderr
        self._t0: float | None = None
        self._created = int(time.time())
        self._streams: dict[str, asyncio.Queue[TokenEvent | object]] = {}
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.dead = False
        self.closing = False
        self.draining = False
        self.exit_code: asyncio.Future[int] | None = None
        self.app = web.Application()
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/ping", self.health),
                web.post("/ping", self.health),
                web.get("/version", self.version),
                web.get("/load", self.load),
                web.get("/metrics", self.metrics),
                web.get("/v1/models", self.models),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
            ]
        )
        self.app.on_startup.append(self._on_startup)
        self.app.on_shutdown.append(self._on_shutdown)

    # --- clock and driver ---

    def virtual_now(self) -> float:
        if self._t0 is None:
            return self.engine.now
        return max((self._clock() - self._t0) * self.time_scale, self.engine.now)

    async def start(self) -> None:
        if self._driver is not None:
            return
        self._t0 = self._clock() - self.engine.now / self.time_scale
        self.exit_code = asyncio.get_running_loop().create_future()
        self._driver = asyncio.create_task(self._drive(), name="vllm-sim-driver")

    async def _on_startup(self, _app: web.Application) -> None:
        await self.start()

    async def _on_shutdown(self, _app: web.Application) -> None:
        await self.close()

    async def close(self) -> None:
        """Abort what is in flight (vLLM's --shutdown-timeout 0) and stop the driver."""
        self.closing = True
        for request_id, queue in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
            queue.put_nowait(_END)
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None

    async def drain(self, timeout_s: float) -> bool:
        """vLLM's SIGTERM with --shutdown-timeout > 0 (see the module doc): refuse new requests,
        let in-flight ones finish for up to `timeout_s` wall seconds. True if all finished."""
        self.draining = True
        self.engine.begin_drain(timeout_s * self.time_scale, at=self.virtual_now())
        self._wake.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _advance(self) -> float | None:
        """Run the engine's events that are due by now, one at a time, and return the next one.

        `run_until(t)` completes every step that *starts* before t, so calling it with the
        wall-derived time would deliver the following step's tokens early; stepping to each
        event time exactly keeps tokens from reaching clients before their virtual time.
        """
        engine = self.engine
        while True:
            upcoming = engine.next_event_time()
            if upcoming is None or upcoming > self.virtual_now():
                engine.pop_finished()  # the server reports through metrics, not records
                return upcoming
            engine.run_until(upcoming, on_tokens=self._dispatch)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for event in events:
            queue = self._streams.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)

    async def _drive(self) -> None:
        while not self.dead:
            try:
                upcoming = self._advance()
            except EngineCrashed as exc:
                self._crash(exc)
                return
            self._wake.clear()
            timeout = None
            if upcoming is not None:
                timeout = max((upcoming - self.virtual_now()) / self.time_scale, MIN_SLEEP_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _crash(self, exc: BaseException) -> None:
        """Die like a vLLM whose GPU ran out of memory mid-step."""
        self.dead = True
        print(
            f"ERROR vllm-sim: EngineCore encountered a fatal error.\n"
            f"torch.OutOfMemoryError: CUDA out of memory. {exc}\n"
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
            "See stack trace (above) for the root cause.",
            file=self._log,
            flush=True,
        )
        for queue in self._streams.values():
            queue.put_nowait(_END)
        if self.exit_code is not None and not self.exit_code.done():
            self.exit_code.set_result(self.crash_exit_code)

    # --- small endpoints ---

    async def health(self, _request: web.Request) -> web.Response:
        if self.dead:
            return web.Response(status=503)
        return web.Response(status=200)

    async def version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def load(self, _request: web.Request) -> web.Response:
        return web.json_response({"server_load": self.in_flight})

    async def metrics(self, request: web.Request) -> web.Response:
        # prometheus_client's exposition and content negotiation, as vLLM's /metrics mount
        # (see vllm_sim.metrics): a Prometheus 2.x negotiating OpenMetrics gets `vllm_` names.
        accept = request.headers.get("Accept", "")
        encoding = request.headers.get("Accept-Encoding", "")
        names = request.query.getall("name[]", [])
        if self.metrics_enabled:
            body, headers = self.engine.metrics.exposition(accept, encoding, names)
        else:  # --disable-log-stats: vLLM registers no engine metrics, only the defaults
            body, headers = _default_exposition(accept, encoding, names)
        return web.Response(body=body, headers=headers)

    async def models(self, _request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    # --- generation ---

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def _check(self, body: Mapping[str, Any], gen: Generation) -> None:
        model = body.get("model")
        if model is not None and model not in (self.model_name, self.model):
            raise RequestError(
                f"The model `{model}` does not exist.", status=404, kind="NotFoundError"
            )
        limit = self.max_model_len
        if limit is not None and gen.prompt_len + gen.max_tokens > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{gen.prompt_len + gen.max_tokens} tokens ({gen.prompt_len} in the messages, "
                f"{gen.max_tokens} in the completion). Please reduce the length of the messages "
                "or completion."
            )

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return RequestError("the request body is not valid JSON").response()
        # Checked after the body is read: the engine may have died meanwhile.
        if self.dead or self.closing:
            return RequestError(
                "EngineCore encountered an issue.", 503 if self.closing else 500, "EngineDeadError"
            ).response()
        try:
            gen = parse_generation(body, chat)
            self._check(body, gen)
        except RequestError as exc:
            return exc.response()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        queue: asyncio.Queue[TokenEvent | object] = asyncio.Queue()
        self._streams[request_id] = queue
        # A draining engine finishes a new request at once as aborted (module doc).
        rejected = self.draining
        finished = rejected
        self.in_flight += 1
        self._idle.clear()
        try:
            # The driver brings the engine up to date; the request joins at the next step.
            try:
                self.engine.add_request(
                    Request(
                        request_id=request_id,
                        prompt_len=gen.prompt_len,
                        max_tokens=gen.max_tokens,
                        arrival_time=self.virtual_now(),
                        prefix_id=gen.prefix_id,
                        prefix_len=gen.prefix_len,
                    )
                )
            except ValueError as exc:  # e.g. the prompt alone exceeds max_model_len
                finished = True
                return RequestError(str(exc)).response()
            if rejected:
                queue.put_nowait(_END)
            self._wake.set()
            writer = _StreamWriter if gen.stream else _JsonWriter
            handler = writer(self, request, request_id, chat, gen)
            finished = await handler.run(queue) or rejected
            return handler.response
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
            self._streams.pop(request_id, None)
            if not finished and not self.dead:
                with contextlib.suppress(Exception):
                    self.engine.abort_request(request_id)


class _Writer:
    """Turns a request's token events into an OpenAI response."""

    def __init__(
        self, server: SimServer, request: web.Request, request_id: str, chat: bool, gen: Generation
    ) -> None:
        self.server = server
        self.request = request
        self.request_id = request_id
        self.chat = chat
        self.gen = gen
        self.created = int(time.time())
        self.tokens = 0
        self.finish_reason: str | None = None
        self.response: web.StreamResponse = web.Response(status=500)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.gen.prompt_len,
            "total_tokens": self.gen.prompt_len + self.tokens,
            "completion_tokens": self.tokens,
            "prompt_tokens_details": None,
        }

    async def run(self, queue: asyncio.Queue[TokenEvent | object]) -> bool:
        """Consume events until the request ends; True when it finished in the engine."""
        await self.begin()
        while True:
            item = await queue.get()
            if not isinstance(item, TokenEvent):
                self.finish_reason = "abort"
                await self.end()
                return False
            self.tokens += 1
            if item.finished:
                self.finish_reason = item.finish_reason or "length"
            await self.token(item)
            if item.finished:
                await self.end()
                return True

    async def begin(self) -> None:
        pass

    async def token(self, event: TokenEvent) -> None:
        pass

    async def end(self) -> None:
        pass


class _JsonWriter(_Writer):
    async def end(self) -> None:
        text = "".join(token_text(i) for i in range(self.tokens))
        if self.server.dead:
            self.response = RequestError(
                "EngineCore encountered an issue.", 500, "EngineDeadError"
            ).response()
            return
        choice: dict[str, Any]
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": self.finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": self.finish_reason,
                "stop_reason": None,
            }
        body = {
            "id": self.request_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.model_name,
            "choices": [choice],
            "usage": self.usage(),
        }
        self.response = web.json_response(body)


class _StreamWriter(_Writer):
    """Server-sent events: one chunk per token, an optional usage chunk, then [DONE]."""

    def chunk(self, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.model_name,
            "choices": [] if choice is None else [choice],
        }
        if usage is not None or self.gen.include_usage:
            body["usage"] = usage
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    async def _write(self, data: bytes) -> None:
        await self.response.write(data)

    async def begin(self) -> None:
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await self.response.prepare(self.request)
        if self.chat:
            first = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            await self._write(self.chunk(first))

    async def token(self, event: TokenEvent) -> None:
        reason = (event.finish_reason or "length") if event.finished else None
        choice: dict[str, Any]
        if self.chat:
            choice = {
                "index": 0,
                "delta": {"content": token_text(event.index)},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            choice = {
                "index": 0,
                "text": token_text(event.index),
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
            }
        await self._write(self.chunk(choice))

    async def end(self) -> None:
        if self.finish_reason == "abort" and self.server.dead:
            error = {"error": {"message": "EngineCore encountered an issue.", "code": 500}}
            await self._write(b"data: " + json.dumps(error).encode() + b"\n\n")
        elif self.finish_reason == "abort" and self.tokens:
            # With no token yet, vLLM's stream generators skip the empty final chunk.
            choice: dict[str, Any] = {"index": 0, "finish_reason": "abort"}
            if self.chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            await self._write(self.chunk(choice))
        if self.gen.include_usage:
            await self._write(self.chunk(None, self.usage()))
        await self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()


def _default_exposition(
    accept: str, encoding: str, names: list[str]
) -> tuple[bytes, dict[str, str]]:
    from vllm_sim.metrics import default_registry_exposition

    return default_registry_exposition(accept, encoding, names)


def _print_startup_error(exc: Exception, log: TextIO) -> None:
    message = str(exc)
    # Messages that already name their exception (e.g. torch.OutOfMemoryError) keep it.
    if not re.match(r"^[\w.]+(Error|Exception): ", message):
        message = f"ValueError: {message}"
    print(
        f"ERROR vllm-sim: EngineCore failed to start.\n{message}\n"
        "RuntimeError: Engine core initialization failed. See root cause above.",
        file=log,
        flush=True,
    )


async def serve(
    options: ServeOptions,
    engine_factory: EngineFactory | None = None,
    log: TextIO | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> int:
    """Run the server until SIGTERM/SIGINT (exit status 0), a simulated crash (its exit code)
    or a startup failure (1). Port 0 picks a free port; it is logged and passed to `on_ready`."""
    out = log or sys.stderr
    factory = engine_factory or default_engine_factory
    try:
        engine = factory(options.config, options.reality, options.seed)
    except (StartupError, ValueError) as exc:  # ValueError: e.g. an unknown model or GPU
        _print_startup_error(exc, out)
        return 1
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        return await _serve_engine(engine, options, stop, out, on_ready)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


async def _serve_engine(
    engine: SimEngine,
    options: ServeOptions,
    stop: asyncio.Event,
    out: TextIO,
    on_ready: Callable[[int], None] | None,
) -> int:
    # Loading weights, profiling, CUDA graphs: vLLM does not listen before they are done.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), options.load_time)
    if stop.is_set():
        return 0
    server = SimServer(
        engine,
        time_scale=options.time_scale,
        metrics_enabled=not options.disable_log_stats,
        crash_exit_code=options.crash_exit_code,
        log=out,
    )
    runner = web.AppRunner(server.app, access_log=None, handle_signals=False, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, host=options.host, port=options.port)
    try:
        await site.start()
    except OSError as exc:
        print(f"ERROR vllm-sim: cannot listen on port {options.port}: {exc}", file=out, flush=True)
        await runner.cleanup()
        return 1
    port = options.port
    server_obj = getattr(site, "_server", None)
    sockets = getattr(server_obj, "sockets", None) or []
    if sockets:
        port = int(sockets[0].getsockname()[1])
    print(
        f"INFO vllm-sim: serving {server.model_name} (vLLM {VLLM_VERSION} simulated, "
        f"time scale {options.time_scale}) on http://{options.host or '0.0.0.0'}:{port}\n"
        "INFO:     Application startup complete.",
        file=out,
        flush=True,
    )
    if on_ready is not None:
        on_ready(port)
    exit_code = server.exit_code
    assert exit_code is not None
    exit_code.add_done_callback(lambda _future: stop.set())  # a crash ends the server too
    await stop.wait()
    code = exit_code.result() if exit_code.done() else 0
    if code == 0:
        await _shut_down(server, options.shutdown_timeout, out)
    await server.close()
    await runner.cleanup()
    return code


async def _shut_down(server: SimServer, timeout_s: int, out: TextIO) -> None:
    """SIGTERM: abort at once (timeout 0) or drain first; server.close() aborts the rest."""
    if timeout_s <= 0:
        print("INFO vllm-sim: shutting down, aborting in-flight requests", file=out, flush=True)
        return
    print(
        f"INFO vllm-sim: [shutdown] mode=drain timeout={timeout_s}s: finishing "
        f"{server.in_flight} in-flight requests, refusing new ones",
        file=out,
        flush=True,
    )
    if await server.drain(timeout_s):
        print("INFO vllm-sim: shutting down, every in-flight request finished", file=out)
    else:
        print(
            f"INFO vllm-sim: shutting down, drain timed out: aborting {server.in_flight} "
            "in-flight requests",
            file=out,
            flush=True,
        )


def main(options: ServeOptions) -> int:
    return asyncio.run(serve(options))
