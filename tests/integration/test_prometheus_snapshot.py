"""PrometheusSource against the real Prometheus server.

Exporters we control serve counters and histograms that grow linearly with wall time, so the
expected rates and percentiles follow from their constants by hand (see `expected` comments):
a mistake in the queries, the escaping, the summing over pods or the percentile maths shows as
a wrong number. One exporter speaks `vllm_` names (the prometheus_client >= 0.23 escaping), so
discovery must read both spellings. The simulator test (slow) checks against vllm-sim's own
/metrics deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.support.waiting import async_wait_for, wait_for
from vllm_autotuner.adapters.prometheus import PrometheusSource, SnapshotTarget
from vllm_autotuner.core.snapshot import Snapshot, histogram_quantile
from vllm_autotuner.core.tuning_types import Knobs, SLOTarget
from vllm_localcluster.prometheus import PrometheusServer, free_port

try:
    from vllm_localcluster.prometheus import find_prometheus_binary

    find_prometheus_binary()
    HAVE_PROMETHEUS = True
except Exception:
    HAVE_PROMETHEUS = False

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(not HAVE_PROMETHEUS, reason="the Prometheus binary is not installed"),
]

WINDOW_S = 8  # seconds of data every static-exporter test reads
KNOBS = Knobs(2048, 128, 0.9)
TTFT_SLO = SLOTarget(95, 100.0)

# ---------------------------------------------------------------------- exporters we control


@dataclass(frozen=True)
class PodSpec:
    """A fake vLLM pod: `rate` requests finish per wall second, each with the same profile."""

    rate: float
    running: float
    kv_usage: float
    preempt_rate: float = 0.0


# Per request: 3/4 of TTFTs in (0.05, 0.1] s, 1/4 in (0.1, 0.25] s, mean 0.11 s; 10 output
# tokens with ITLs in (0.01, 0.025] s, mean 0.02 s. Prefix cache: 30 of 100 tokens hit.
TTFT_CUM = ((0.05, 0.0), (0.1, 0.75), (0.25, 1.0), (0.5, 1.0), (float("inf"), 1.0))
TTFT_MEAN_S = 0.11
ITL_PER_REQUEST = 10


def exposition(t: float, pod: PodSpec, prefix: str) -> str:
    n = pod.rate * t
    lab = 'model_name="m",engine="0"'
    lines = [
        f'{prefix}request_success_total{{{lab},finished_reason="stop"}} {n}',
        f'{prefix}request_success_total{{{lab},finished_reason="abort"}} 0',
        f"{prefix}num_preemptions_total{{{lab}}} {pod.preempt_rate * t}",
        f"{prefix}prefix_cache_hits_total{{{lab}}} {30 * n}",
        f"{prefix}prefix_cache_queries_total{{{lab}}} {100 * n}",
        f"{prefix}num_requests_running{{{lab}}} {pod.running}",
        f"{prefix}num_requests_waiting{{{lab}}} 0",
        f"{prefix}kv_cache_usage_perc{{{lab}}} {pod.kv_usage}",
        f'{prefix}cache_config_info{{block_size="16",gpu_memory_utilization="0.9",'
        f'num_gpu_blocks="2001",kv_cache_size_tokens="32000",engine="0"}} 1',
    ]
    for le, frac in TTFT_CUM:
        le_text = "+Inf" if le == float("inf") else repr(le)
        lines.append(
            f'{prefix}time_to_first_token_seconds_bucket{{{lab},le="{le_text}"}} {frac * n}'
        )
    lines.append(f"{prefix}time_to_first_token_seconds_sum{{{lab}}} {TTFT_MEAN_S * n}")
    lines.append(f"{prefix}time_to_first_token_seconds_count{{{lab}}} {n}")
    tokens = ITL_PER_REQUEST * n
    for le_text, v in (("0.01", 0.0), ("0.025", tokens), ("+Inf", tokens)):
        lines.append(f'{prefix}inter_token_latency_seconds_bucket{{{lab},le="{le_text}"}} {v}')
    lines.append(f"{prefix}inter_token_latency_seconds_sum{{{lab}}} {0.02 * tokens}")
    lines.append(f"{prefix}inter_token_latency_seconds_count{{{lab}}} {tokens}")
    return "\n".join(lines) + "\n"


class StaticExporter:
    """An HTTP /metrics on 127.0.0.1 whose counters grow linearly from its start."""

    def __init__(self, pod: PodSpec, prefix: str = "vllm:") -> None:
        t0 = time.monotonic()
        spec, pre = pod, prefix

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = exposition(time.monotonic() - t0, spec, pre).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


PODS = {
    ("team-a", "pod-0"): (PodSpec(rate=4.0, running=3, kv_usage=0.25, preempt_rate=0.5), "vllm:"),
    ("team-a", "pod-1"): (PodSpec(rate=2.0, running=5, kv_usage=0.75), "vllm:"),
    ("team-u", "pod-u"): (PodSpec(rate=3.0, running=1, kv_usage=0.5), "vllm_"),
}


@pytest.fixture(scope="module")
def fleet() -> Iterator[PrometheusServer]:
    """Prometheus scraping the three static pods, once it holds WINDOW_S+2 s of every pod."""
    exporters = {key: StaticExporter(spec, prefix) for key, (spec, prefix) in PODS.items()}
    prom = PrometheusServer(scrape_interval="1s")
    try:
        prom.start()
        prom.set_targets(
            [
                {"targets": [e.address], "labels": {"namespace": ns, "pod": pod}}
                for (ns, pod), e in exporters.items()
            ]
        )
        need = WINDOW_S + 3

        def enough() -> bool:
            rows = prom.query(f"count_over_time(up[{need + 5}s]) >= {need}")
            return len(rows) == len(PODS)

        wait_for(enough, timeout=60, interval=0.5, message=f"{need} scrapes of every pod")
        yield prom
    finally:
        prom.stop()
        for e in exporters.values():
            e.stop()


def target(ns: str, name: str, pods: tuple[str, ...], **kw: Any) -> SnapshotTarget:
    args: dict[str, Any] = {
        "since": None,
        "knobs": KNOBS,
        "revision": "r1",
        "window_s": float(WINDOW_S),
        "slo": (TTFT_SLO, None, None),
        "model_name": "m",
    }
    args.update(kw)
    return SnapshotTarget(namespace=ns, name=name, pods=pods, **args)


def source(url: str, **kw: Any) -> PrometheusSource:
    return PrometheusSource(url, min_window_s=2, window_grid_s=1, **kw)


def ttft_quantile_s(q: float) -> float:
    """Expected TTFT quantile of the per-request profile, by linear interpolation in buckets."""
    value = histogram_quantile(q, TTFT_CUM)
    assert value is not None
    return value


async def test_fleet_snapshots_match_the_exporters(fleet: PrometheusServer) -> None:
    src = source(fleet.url)
    now = datetime.now(UTC)
    out = await src.snapshots(
        [target("team-a", "chat", ("pod-0", "pod-1")), target("team-u", "esc", ("pod-u",))], now
    )
    a, u = out[("team-a", "chat")], out[("team-u", "esc")]
    assert a.available, a.reason
    assert a.num_pods == 2 and a.window_s == WINDOW_S and a.knobs == KNOBS
    assert a.request_rate == pytest.approx(4.0 + 2.0, rel=0.05)
    assert a.completed_requests == pytest.approx(6.0 * WINDOW_S, rel=0.05)
    # 3/4 of requests at or under 0.1 s: p50 = 0.05 + 0.05 * (0.5 / 0.75) s.
    assert a.ttft.p50_ms == pytest.approx((0.05 + 0.05 * 0.5 / 0.75) * 1000, rel=0.02)
    assert a.ttft.p50_ms == pytest.approx(ttft_quantile_s(0.5) * 1000, rel=0.02)
    # p95 = 0.1 + 0.15 * (0.95 - 0.75) / 0.25 s, and the SLO asks for p95.
    assert a.ttft.p95_ms == pytest.approx((0.1 + 0.15 * 0.2 / 0.25) * 1000, rel=0.02)
    assert a.ttft.at_slo_ms == pytest.approx(a.ttft.p95_ms)
    assert a.ttft.mean_ms == pytest.approx(TTFT_MEAN_S * 1000, rel=0.02)
    assert a.ttft_attainment == pytest.approx(0.75, rel=0.02)
    assert a.itl.mean_ms == pytest.approx(20.0, rel=0.02)
    assert 10.0 < (a.itl.p50_ms or 0) <= 25.0
    assert a.running_mean == pytest.approx(4.0) and a.running_max == pytest.approx(5.0)
    assert a.kv_usage_mean == pytest.approx(0.5) and a.kv_usage_max == pytest.approx(0.75)
    assert a.waiting_max == pytest.approx(0.0)  # exported as 0: a real zero
    assert a.preemption_rate == pytest.approx(0.5, rel=0.05)
    assert a.prefix_cache_hit_rate == pytest.approx(0.3, rel=0.01)
    assert a.kv_cache.num_gpu_blocks == 2001 and a.kv_cache.kv_cache_size_tokens == 32000
    # Counters that grow linearly: the same count every 1 s scrape, no burstiness at all (the
    # subquery reads every scrape interval of both pods, less the window's first).
    assert a.arrival_dispersion is not None and a.arrival_dispersion < 0.2
    assert a.arrival_intervals >= 2 * (WINDOW_S - 2 - 4)  # less 4 segment means a pod
    # Not exported at all: missing, not zero.
    assert a.e2e.p50_ms is None and a.queue_time.mean_ms is None and a.prompt_len.mean is None
    # The `vllm_` pod is read by the same queries.
    assert u.available, u.reason
    assert u.request_rate == pytest.approx(3.0, rel=0.05)
    assert u.ttft.p50_ms == pytest.approx(a.ttft.p50_ms, rel=0.02)
    assert src.names is not None
    assert src.names.spellings("requests") == (
        "vllm:request_success_total",
        "vllm_request_success_total",
    )


async def test_rate_scale_turns_wall_rates_into_virtual_ones(fleet: PrometheusServer) -> None:
    now = datetime.now(UTC)
    t = [target("team-a", "chat", ("pod-0", "pod-1"))]
    plain = (await source(fleet.url).snapshots(t, now))[("team-a", "chat")]
    scaled = (await source(fleet.url, rate_scale=5.0).snapshots(t, now))[("team-a", "chat")]
    assert scaled.request_rate == pytest.approx(plain.request_rate / 5.0)
    assert scaled.ttft == plain.ttft


async def test_underscore_only_prometheus_is_discovered(fleet: PrometheusServer) -> None:
    """A Prometheus that only ever saw `vllm_` names (no colon series at all)."""
    exporter = StaticExporter(PodSpec(rate=1.0, running=1, kv_usage=0.1), prefix="vllm_")
    prom = PrometheusServer(scrape_interval="1s")
    try:
        prom.start()
        prom.set_targets(
            [{"targets": [exporter.address], "labels": {"namespace": "n", "pod": "p"}}]
        )
        src = source(prom.url, rediscover_on_empty_s=0)
        t = [target("n", "d", ("p",), window_s=3.0)]

        async def available() -> Snapshot | None:
            snap = (await src.snapshots(t, datetime.now(UTC)))[("n", "d")]
            return snap if snap.available and snap.completed_requests > 0 else None

        snap: Snapshot | None = await async_wait_for(
            available, timeout=40, interval=0.5, message="vllm_ data"
        )
        assert snap is not None
        assert src.names is not None and src.names.get("ttft") == "vllm_time_to_first_token_seconds"
        assert snap.ttft.p50_ms is not None and snap.kv_usage_max == pytest.approx(0.1)
    finally:
        prom.stop()
        exporter.stop()


def test_sync_path_discovers_targets_and_agrees(fleet: PrometheusServer) -> None:
    src = source(fleet.url)
    found = src.discover_targets_sync(namespace="team-a", window_s=float(WINDOW_S))
    assert [(t.namespace, t.name, t.pods, t.model_name) for t in found] == [
        ("team-a", "m", ("pod-0", "pod-1"), "m")
    ]
    regex = src.discover_targets_sync(pod_regex="pod-[u1]", window_s=float(WINDOW_S))
    assert sorted(p for t in regex for p in t.pods) == ["pod-1", "pod-u"]
    snaps = src.snapshots_sync(found)
    snap = snaps[("team-a", "m")]
    assert snap.available, snap.reason
    assert snap.request_rate == pytest.approx(6.0, rel=0.05)


HOSTILE = ['a"b', "back\\slash", "new\nline", "x|y", ".*", "}{", 'pod-0"} or vector(1) #']


async def test_hostile_names_query_fine_and_match_nothing(fleet: PrometheusServer) -> None:
    src = source(fleet.url)
    targets = [
        target(ns, f"d{i}", (pod, "pod-0"))
        for i, (ns, pod) in enumerate(zip(HOSTILE, HOSTILE[::-1], strict=True))
    ]
    out = await src.snapshots(targets, datetime.now(UTC))
    for snap in out.values():
        # Not "query failed": Prometheus parsed every query and found no such pods.
        assert not snap.available and snap.reason.startswith("no vllm metrics for pods"), (
            snap.reason
        )
    # A hostile name next to a real deployment in the same batch does not disturb it.
    mixed = await src.snapshots(
        [targets[-1], target("team-a", "chat", ("pod-0", "pod-1"))], datetime.now(UTC)
    )
    assert mixed[("team-a", "chat")].request_rate == pytest.approx(6.0, rel=0.05)


async def test_stopped_prometheus_gives_unavailable_not_exceptions() -> None:
    prom = PrometheusServer(scrape_interval="1s").start()
    url = prom.url
    prom.stop()
    src = source(url, timeout_s=2)
    out = await src.snapshots([target("n", "d", ("p",))], datetime.now(UTC))
    snap = out[("n", "d")]
    assert not snap.available
    assert snap.reason.startswith(f"Prometheus unreachable at {url}"), snap.reason
    sync = (await asyncio.to_thread(src.snapshots_sync, [target("n", "d", ("p",))]))[("n", "d")]
    assert sync.reason.startswith(f"Prometheus unreachable at {url}"), sync.reason


async def test_silent_prometheus_is_bounded_by_the_timeout() -> None:
    """A server that accepts connections and never answers (a hung proxy)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        src = source(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=1)
        started = time.monotonic()
        out = await src.snapshots(
            [target("n", f"d{i}", ("p",)) for i in range(5)], datetime.now(UTC)
        )
        elapsed = time.monotonic() - started
        assert elapsed < 5, elapsed
        for snap in out.values():
            assert not snap.available and "no answer within 1s" in snap.reason, snap.reason
    finally:
        listener.close()


# ------------------------------------------------------------------ TLS and the bearer token


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="openssl not installed")  # fmt: skip
async def test_tls_and_rotating_bearer_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key = _self_signed(tmp_path)
    seen: list[str] = []

    async def labels(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"status": "success", "data": ["vllm:request_success_total"]})

    async def query(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        metric = {"namespace": "n", "pod": "p"}
        result = [{"metric": metric, "value": [time.time(), "30"]}]
        return web.json_response(
            {"status": "success", "data": {"resultType": "vector", "result": result}}
        )

    app = web.Application()
    app.router.add_get("/api/v1/label/__name__/values", labels)
    app.router.add_post("/api/v1/query", query)
    runner = web.AppRunner(app)
    await runner.setup()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port, ssl_context=ctx)
    await site.start()
    try:
        token = tmp_path / "token"
        token.write_text("secret-one\n")
        url = f"https://127.0.0.1:{port}"
        caplog.set_level(logging.DEBUG)
        src = source(url, bearer_token_file=str(token), ca_file=str(cert))
        t = [target("n", "d", ("p",), window_s=30.0)]
        first = (await src.snapshots(t, datetime.now(UTC)))[("n", "d")]
        token.write_text("secret-two")
        second = (await src.snapshots(t, datetime.now(UTC)))[("n", "d")]
        assert first.available and second.available, (first.reason, second.reason)
        assert first.request_rate == pytest.approx(1.0)  # 30 requests over 30 s
        assert seen[0] == "Bearer secret-one" and seen[-1] == "Bearer secret-two"
        # Without the CA the certificate is refused: unavailable, with the reason.
        untrusted = source(url, bearer_token_file=str(token))
        refused = (await untrusted.snapshots(t, datetime.now(UTC)))[("n", "d")]
        assert not refused.available and "Prometheus unreachable" in refused.reason
        assert "certificate" in refused.reason.lower()
        # The sync path (prometheus-api-client) honours the CA bundle and the token too.
        seen.clear()
        sync = await asyncio.to_thread(src.snapshots_sync, t)
        assert sync[("n", "d")].available and seen and all(s == "Bearer secret-two" for s in seen)
        # A missing token file is a reason, not a crash.
        token.unlink()
        gone = (await src.snapshots(t, datetime.now(UTC)))[("n", "d")]
        assert not gone.available and "bearer token file" in gone.reason
        assert "secret" not in caplog.text and "secret" not in gone.reason
    finally:
        await runner.cleanup()


# ----------------------------------------------------------------- the simulator, end to end

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SIM_SCALE = 5.0


def _scrape(port: int) -> dict[str, float]:
    """Sample name with labels -> value, from a sim's own /metrics (the ground truth)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _ttft_buckets(before: dict[str, float], after: dict[str, float]) -> list[tuple[float, float]]:
    out = []
    for key, v in after.items():
        if key.startswith("vllm:time_to_first_token_seconds_bucket"):
            le = key.split('le="')[1].split('"')[0]
            out.append((float(le), v - before.get(key, 0.0)))
    return sorted(out)


def _requests(before: dict[str, float], after: dict[str, float]) -> float:
    return sum(
        v - before.get(k, 0.0)
        for k, v in after.items()
        if k.startswith("vllm:request_success_total")
    )


def _bucket_of(value_s: float, bounds: list[float]) -> float:
    return next(b for b in bounds if value_s <= b + 1e-12)


@contextlib.contextmanager
def _sims(n: int) -> Iterator[list[int]]:
    ports = [free_port() for _ in range(n)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm_sim.cli",
                "serve",
                MODEL,
                "--host",
                "127.0.0.1",
                "--port",
                str(p),
                "--sim-time-scale",
                str(SIM_SCALE),
                "--sim-load-time",
                "0",
                "--sim-seed",
                str(i),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ},
        )
        for i, p in enumerate(ports)
    ]
    try:
        for port in ports:
            wait_for(
                functools.partial(_scrape, port),
                timeout=60,
                interval=0.2,
                message=f"vllm-sim on {port}",
                ignore=(OSError,),
            )
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("burstiness", [1.0, 0.3])
async def test_simulated_pods_match_their_own_metrics(burstiness: float) -> None:
    """Two vllm-sim pods under load, Poisson or bursty (`vllm bench serve --burstiness`): the
    Snapshot agrees with the sims' own counters, and its burstiness with the arrivals'."""
    window = 20
    load_wall_s = window + 60  # enough for Prometheus history, then the window
    with _sims(2) as ports, PrometheusServer(scrape_interval="1s") as prom:
        prom.set_targets(
            [
                {"targets": [f"127.0.0.1:{p}"], "labels": {"namespace": "sim", "pod": f"sim-{i}"}}
                for i, p in enumerate(ports)
            ]
        )
        loads = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vllm_sim.cli",
                    "load",
                    "--url",
                    f"http://127.0.0.1:{p}",
                    "--time-scale",
                    str(SIM_SCALE),
                    "--rate",
                    "2",
                    "--duration",
                    str(load_wall_s * SIM_SCALE),  # virtual seconds of arrivals
                    "--seed",
                    str(i),
                    "--workload",
                    "chat",
                    "--burstiness",
                    str(burstiness),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for i, p in enumerate(ports)
        ]
        try:
            # Steady load first, then the ground-truth window: scrape, wait `window`, scrape.
            need = window + 5
            wait_for(
                lambda: len(prom.query(f"count_over_time(up[{need + 5}s]) >= {need}")) == 2,
                timeout=90, interval=0.5, message="Prometheus history",
            )  # fmt: skip
            before = [_scrape(p) for p in ports]
            start = time.monotonic()
            await async_wait_for(lambda: time.monotonic() - start >= window, timeout=window + 5)
            after = [_scrape(p) for p in ports]
            now = datetime.now(UTC)
            src = source(prom.url, rate_scale=SIM_SCALE)
            t = target("sim", "d", ("sim-0", "sim-1"), window_s=float(window), model_name=MODEL)
            snap = (await src.snapshots([t], now))[("sim", "d")]
        finally:
            for load in loads:
                load.terminate()
                load.wait(timeout=10)
    assert snap.available, snap.reason
    true_requests = sum(_requests(b, a) for b, a in zip(before, after, strict=True))
    assert true_requests > 50
    print(
        f"sim: {true_requests:.0f} requests, rate {snap.request_rate:.3f} vs "
        f"{true_requests / window / SIM_SCALE:.3f} (virtual req/s)"
    )
    # Counters count events per wall second; the snapshot reports virtual seconds.
    assert snap.request_rate == pytest.approx(true_requests / window / SIM_SCALE, rel=0.05)
    # Well below saturation, first tokens per 1 s scrape follow the arrivals: Poisson counts
    # within the estimate's noise (about 0.25 for 2 x 15 intervals; x 3 is a generous bound),
    # gamma arrivals of shape 0.3 (cv2 3.3) well above it. Bursts that strong also spread a
    # pod's segment means beyond Poisson noise about 3 times in 10, and such a pod is left
    # out as if its load had moved (adapters/promql.py `_dispersion`): both pods, about 1 in
    # 10, leave no reading, which is the model's Poisson fallback.
    print(f"sim: arrival dispersion {snap.arrival_dispersion} over {snap.arrival_intervals}")
    if burstiness == 1.0:
        assert snap.arrival_dispersion is not None and snap.arrival_intervals >= 20
        assert abs(snap.arrival_dispersion - 1.0) < 0.75
    elif snap.arrival_dispersion is not None:
        assert snap.arrival_intervals >= 10
        assert snap.arrival_dispersion > 1.75
    buckets: dict[float, float] = {}
    for b, a in zip(before, after, strict=True):
        for le, v in _ttft_buckets(b, a):
            buckets[le] = buckets.get(le, 0.0) + v
    truth = sorted(buckets.items())
    bounds = [le for le, _ in truth]
    for q, got in ((0.5, snap.ttft.p50_ms), (0.9, snap.ttft.p90_ms)):
        expected = histogram_quantile(q, truth)
        assert expected is not None and got is not None
        print(f"sim: ttft p{q * 100:.0f} {got:.1f} ms vs truth {expected * 1000:.1f} ms")
        assert _bucket_of(got / 1000, bounds) == _bucket_of(expected, bounds), (q, got, expected)
