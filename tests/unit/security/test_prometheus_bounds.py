"""Class 4: Prometheus cannot exhaust the operator's memory or outlive the query timeout.

A local server on 127.0.0.1 answers every query with one hostile body; the operator's own
PrometheusSource reads it through both transports (aiohttp for `run`, prometheus-api-client for
`recommend`). Each answer has a budget that follows from the pods asked about (320 KiB and
20480 JSON values for the two pods here): a body past it, compressed or not, announced or not,
is refused as it is read, and the cycle reports it per deployment instead of crashing. The peak
memory these answers cost is measured by `python -m bench.hostile_prometheus` (goal < 256 MiB).
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from bench.hostile_prometheus.answers import Answer
from bench.hostile_prometheus.server import Server

from vllm_autotuner.adapters.prometheus import PrometheusSource
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.core.snapshot import Snapshot

NS = "team-a"
PODS = ("llama-a", "llama-b")
KIB = 1024
HEAD = b'{"status":"success","data":{"resultType":"vector","result":['
TAIL = b"]}}"


def _sample(pod: str, value: str = "600", **labels: str) -> bytes:
    metric = {"namespace": NS, "pod": pod, "model_name": "m", **labels}
    return json.dumps({"metric": metric, "value": [1.7e9, value]}).encode()


def _vector(samples: list[bytes]) -> bytes:
    return HEAD + b",".join(samples) + TAIL


def _zipped(body: bytes, wbits: int = 31) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return packer.compress(body) + packer.flush()


def _many(count: int, **labels: str) -> bytes:
    return _vector([_sample(PODS[i % 2], **labels) for i in range(count)])


CLEAN = Answer(_vector([_sample(p) for p in PODS]))
HOSTILE: dict[str, Callable[[], Answer]] = {
    "gzip-bomb": lambda: Answer(_zipped(_many(100_000)), "gzip"),
    "deflate-bomb": lambda: Answer(_zipped(_many(100_000), 15), "deflate"),
    "gzip-bomb-unannounced": lambda: Answer(_zipped(_many(100_000)), "gzip", chunked=True),
    "identity-20MB": lambda: Answer(_many(100_000)),
    "identity-20MB-unannounced": lambda: Answer(_many(100_000), chunked=True),
    "series-flood-own-pod": lambda: Answer(
        _zipped(_vector([_sample(PODS[0], model_name=f"m{i}") for i in range(50_000)])), "gzip"
    ),
    "empty-lists-within-bytes": lambda: Answer(HEAD + b"[]," * 90_000 + b"[]" + TAIL),
    "empty-maps-gzip": lambda: Answer(_zipped(HEAD + b"{}," * 2_000_000 + b"{}" + TAIL), "gzip"),
    "deep-nesting-wide": lambda: Answer(HEAD + b"[" * 100_000 + b"]" * 100_000 + TAIL),
    "huge-label-2MB": lambda: Answer(_vector([_sample(PODS[0], model_name="m" * 2_000_000)])),
    "unknown-encoding": lambda: Answer(_zipped(CLEAN.body), "br"),
    "corrupt-gzip": lambda: Answer(b"\x1f\x8b\x08\x00garbage" * 10, "gzip"),
    "truncated-gzip": lambda: Answer(_zipped(CLEAN.body)[:-20], "gzip"),
}
TRANSPORTS = ("aiohttp", "api-client")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = Server().start()
    try:
        yield running
    finally:
        running.stop()


def _targets() -> list[SnapshotTarget]:
    return [
        SnapshotTarget(
            namespace=NS,
            name=pod,
            pods=(pod,),
            since=None,
            knobs=None,
            revision=None,
            window_s=300,
            model_name="m",
        )
        for pod in PODS
    ]


def cycle(server: Server, transport: str, timeout_s: float = 10) -> dict[Any, Snapshot]:
    source = PrometheusSource(f"http://127.0.0.1:{server.port}", timeout_s=timeout_s)
    now = datetime.now(UTC)
    if transport == "aiohttp":
        return asyncio.run(source.snapshots(_targets(), now))
    return source.snapshots_sync(_targets(), now)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_clean_answer_is_read(server: Server, transport: str) -> None:
    server.answer = CLEAN
    snaps = cycle(server, transport)
    assert all(s.available and s.completed_requests == 600 for s in snaps.values()), snaps


CASES = [(name, t) for name in HOSTILE for t in TRANSPORTS]


@pytest.mark.parametrize(("name", "transport"), CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_a_hostile_answer_is_refused_within_its_budget(
    server: Server, name: str, transport: str
) -> None:
    server.answer = HOSTILE[name]()
    snaps = cycle(server, transport)
    for snap in snaps.values():
        assert not snap.available, f"{name} was read whole: {snap}"
        assert "internal error" not in snap.reason, snap.reason
        assert "Prometheus query failed" in snap.reason, snap.reason
        assert len(snap.reason) < 1000


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_slow_answer_never_outlives_the_timeout(server: Server, transport: str) -> None:
    """20 bytes every 0.1 s: each read is quick, the whole answer is not."""
    server.answer = Answer(CLEAN.body, drip_bytes_per_s=200.0)
    snaps = cycle(server, transport, timeout_s=1.0)
    for snap in snaps.values():
        assert not snap.available
        assert "within 1s" in snap.reason, snap.reason


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_pods_flood_of_series_leaves_the_other_pods_data(
    server: Server, transport: str
) -> None:
    """Within the budget, a pod exporting hundreds of model names is capped to its own share."""
    flood = [_sample(PODS[0], "1", model_name=f"m{i}") for i in range(900)]
    server.answer = Answer(_vector([*flood, _sample(PODS[1])]))
    snaps = cycle(server, transport)
    victim = snaps[(NS, PODS[1])]
    assert victim.available and victim.completed_requests == 600, victim.reason
