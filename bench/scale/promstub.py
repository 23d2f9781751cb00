"""A stand-in Prometheus that answers the adapter's queries for any number of simulated pods.

The scale benchmark is about the operator, not about Prometheus: a real server scraping 1,000
simulated vLLM pods would need 1,000 processes. This stub answers the two endpoints the adapter
uses (`/api/v1/label/__name__/values` and `/api/v1/query`) with a plausible, constant answer for
every pod the query's `pod` matcher names, and records every request with its arrival time, so
the benchmark can count queries per metrics cycle.

The answer shapes follow what `adapters.promql.build_query` asks for (bucket rows with `le`, the
`_sum` under `le="sum"`, gauge halves and the burstiness query's segments tagged with
`autotuner_part`, the cache-config info series), so the adapter assembles available
snapshots through its production code path.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web

# vLLM's metric names as the adapter discovers them (vLLM loggers.py); one spelling is enough here.
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2),
    "vllm:inter_token_latency_seconds": (0.01, 0.02, 0.03, 0.04, 0.06, 0.1, 0.2),
    "vllm:e2e_request_latency_seconds": (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0),
    "vllm:request_queue_time_seconds": (0.001, 0.01, 0.1, 0.5, 1.0, 5.0),
    "vllm:request_prompt_tokens": (128, 256, 512, 1024, 2048, 4096),
    "vllm:request_generation_tokens": (32, 64, 128, 256, 512, 1024),
    "vllm:iteration_tokens_total": (64, 256, 1024, 2048, 4096, 8192),
}
COUNTERS = (
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
)
GAUGES = {
    "vllm:kv_cache_usage_perc": 0.35,
    "vllm:num_requests_running": 24.0,
    "vllm:num_requests_waiting": 0.0,
}
INFO = "vllm:cache_config_info"
REQUEST_RATE = 2.0  # finished requests per second per pod

_POD_MATCHER = re.compile(r'\bpod(=~|=)"((?:[^"\\]|\\.)*)"')
_WINDOW = re.compile(r"\[(\d+)s\]")


def all_series_names() -> list[str]:
    names = [f"{h}{s}" for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")]
    return [*names, *COUNTERS, *GAUGES, INFO]


def _unescape(value: str) -> str:
    """Undo the string-literal and QuoteMeta escaping the adapter applies (pod names here are
    plain DNS labels, so dropping each escaping backslash is exact)."""
    return re.sub(r"\\(.)", r"\1", value)


def pods_in(expr: str) -> list[str]:
    m = _POD_MATCHER.search(expr)
    if m is None:
        return []
    text = _unescape(m.group(2))
    return text.split("|") if m.group(1) == "=~" else [text]


def _fractions(n: int) -> list[float]:
    """A unimodal cumulative shape over n finite buckets, ending at 1."""
    return [min(1.0, ((i + 1) / n) ** 0.5) for i in range(n)]


@dataclass
class Hit:
    time: float
    path: str
    expr: str
    authorized: bool = True


@dataclass
class StubPrometheus:
    """`pod_namespace` maps each simulated pod to its namespace (the benchmark's kubelet fills
    it); unknown pods get no rows, as in a real Prometheus that never scraped them."""

    pod_namespace: dict[str, str] = field(default_factory=dict)
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None  # when set, requests must carry "Authorization: Bearer <token>"
    echo_credentials: bool = False  # a careless proxy: a 401 body repeats what it was sent
    hits: list[Hit] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _thread: threading.Thread | None = None
    _ready: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ answers

    def _rows(self, expr: str) -> list[dict[str, Any]]:
        m = _WINDOW.search(expr)
        window = float(m.group(1)) if m else 300.0
        rows: list[dict[str, Any]] = []
        pods = [(p, self.pod_namespace.get(p)) for p in pods_in(expr)]
        known = [(p, ns) for p, ns in pods if ns is not None]
        now = time.time()

        def row(labels: dict[str, str], value: float) -> dict[str, Any]:
            return {"metric": labels, "value": [now, repr(value)]}

        for name, bounds in HISTOGRAMS.items():
            if name + "_bucket" in expr:
                count = REQUEST_RATE * window
                mid = bounds[len(bounds) // 2]
                for pod, ns in known:
                    base = {"namespace": ns, "pod": pod, "model_name": self.model}
                    for bound, frac in zip(bounds, _fractions(len(bounds)), strict=True):
                        rows.append(row({**base, "le": repr(float(bound))}, count * frac))
                    rows.append(row({**base, "le": "+Inf"}, count))
                    rows.append(row({**base, "le": "sum"}, count * mid))
                return rows
        if INFO in expr:
            for pod, ns in known:
                labels = {
                    "__name__": INFO,
                    "namespace": ns,
                    "pod": pod,
                    "num_gpu_blocks": "30000",
                    "block_size": "16",
                    "gpu_memory_utilization": "0.92",
                }
                rows.append(row(labels, 1.0))
            return rows
        for name, level in GAUGES.items():
            if name in expr:
                for pod, ns in known:
                    base = {"namespace": ns, "pod": pod, "model_name": self.model}
                    rows.append(row({**base, "autotuner_part": "mean"}, level))
                    rows.append(row({**base, "autotuner_part": "max"}, level * 1.5))
                return rows
        if "idelta(" in expr:  # burstiness: per segment, Poisson counts per 15 s scrape
            per_scrape = REQUEST_RATE * 15.0
            per_segment = window / 15.0 / 4  # a population variance: (m - 1) / m of Poisson's
            for pod, ns in known:
                base = {"namespace": ns, "pod": pod, "model_name": self.model}
                rows.append(row({**base, "autotuner_part": "n"}, window / 15.0 + 1.0))
                var = per_scrape * (per_segment - 1) / per_segment
                for j in range(4):
                    rows.append(row({**base, "autotuner_part": f"var{j}"}, var))
                    rows.append(row({**base, "autotuner_part": f"mean{j}"}, per_scrape))
            return rows
        if "prefix_cache_hits" in expr:
            for pod, ns in known:
                base = {"namespace": ns, "pod": pod, "model_name": self.model}
                rows.append(row({**base, "autotuner_part": "num"}, 10 * window))
                rows.append(row({**base, "autotuner_part": "den"}, 100 * window))
            return rows
        value = 0.0 if "preemptions" in expr else REQUEST_RATE * window
        for pod, ns in known:
            rows.append(row({"namespace": ns, "pod": pod, "model_name": self.model}, value))
        return rows

    async def _handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        form: dict[str, str] = dict(request.query)
        if request.method == "POST":
            form.update({k: str(v) for k, v in (await request.post()).items()})
        expr = form.get("query", "")
        sent = request.headers.get("Authorization", "")
        authorized = self.token is None or sent == f"Bearer {self.token}"
        with self._lock:
            self.hits.append(Hit(time.monotonic(), request.path, expr, authorized))
        if not authorized:
            error = f"invalid credentials {sent!r}" if self.echo_credentials else "unauthorized"
            body = {"status": "error", "errorType": "unauthorized", "error": error}
            return aiohttp.web.json_response(body, status=401)
        if request.path.startswith("/api/v1/label/"):
            data: Any = all_series_names()
        elif request.path == "/api/v1/query":
            data = {"resultType": "vector", "result": self._rows(expr)}
        else:
            return aiohttp.web.json_response({"status": "error", "error": "unknown"}, status=404)
        return aiohttp.web.json_response({"status": "success", "data": data})

    # ------------------------------------------------------------------ counting

    def query_hits(self) -> list[Hit]:
        with self._lock:
            return list(self.hits)

    def clear(self) -> None:
        with self._lock:
            self.hits.clear()

    # ------------------------------------------------------------------ serving

    def start(self, timeout: float = 10.0) -> StubPrometheus:
        self._thread = threading.Thread(target=self._main, name="prom-stub", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the Prometheus stub did not start")
        return self

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = aiohttp.web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = aiohttp.web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.port = int(runner.addresses[0][1])
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)


def cycles(hits: list[Hit], gap_s: float = 2.0) -> list[list[Hit]]:
    """Group requests into metrics cycles: the observer sends a cycle's queries together, and
    cycles are a reconcile interval apart, so a quiet gap separates them."""
    groups: list[list[Hit]] = []
    for hit in sorted(hits, key=lambda h: h.time):
        if groups and hit.time - groups[-1][-1].time <= gap_s:
            groups[-1].append(hit)
        else:
            groups.append([hit])
    return groups
