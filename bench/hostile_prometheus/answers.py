"""The hostile answers the benchmark serves, built once as bytes (with their encoding).

Each one is something a broken proxy, a hostile Prometheus or a scraped pod that exports junk
could make the operator read. Samples name the benchmark's own pods, so nothing is dropped for
naming a stranger: what bounds memory is the reading itself.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

NAMESPACE = "bench"
DEPLOYMENTS = 10
PODS_PER_DEPLOYMENT = 2
MB = 1024 * 1024


def pods() -> list[tuple[str, str]]:
    """(deployment, pod) for every pod the benchmark's operator asks about."""
    return [
        (f"llama-{d}", f"llama-{d}-pod{p}")
        for d in range(DEPLOYMENTS)
        for p in range(PODS_PER_DEPLOYMENT)
    ]


def sample(pod: str, value: str = "600", **labels: str) -> bytes:
    metric = {"namespace": NAMESPACE, "pod": pod, "model_name": "m", **labels}
    return json.dumps({"metric": metric, "value": [1700000000.0, value]}).encode()


HEAD = b'{"status":"success","data":{"resultType":"vector","result":['
TAIL = b"]}}"


def _samples(total_bytes: int) -> Iterator[bytes]:
    """Valid samples for our own pods, about `total_bytes` of them, comma-separated."""
    names = [p for _, p in pods()]
    written, i = 0, 0
    while written < total_bytes:
        piece = sample(names[i % len(names)], engine=str(i)) + b","
        written += len(piece)
        i += 1
        yield piece


def _vector(parts: Iterator[bytes]) -> Iterator[bytes]:
    yield HEAD
    yield from parts
    yield sample(pods()[0][1])
    yield TAIL


def _joined(chunks: Iterator[bytes]) -> bytes:
    return b"".join(chunks)


def _compressed(chunks: Iterator[bytes], wbits: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    out = [packer.compress(c) for c in chunks]
    out.append(packer.flush())
    return b"".join(out)


def _repeat(piece: bytes, total: int) -> Iterator[bytes]:
    block = piece * max(1, MB // len(piece))
    for _ in range(max(1, total // len(block))):
        yield block


@dataclass(frozen=True)
class Answer:
    """A body, its Content-Encoding, and how fast to send it (bytes per second, 0: at once)."""

    body: bytes
    encoding: str | None = None
    drip_bytes_per_s: float = 0.0
    chunked: bool = False  # no Content-Length: the reader only learns the size by reading


def clean() -> Answer:
    return Answer(_joined(_vector(iter([sample(p) + b"," for _, p in pods()]))))


def gzip_bomb() -> Answer:
    """About 150 MB of valid samples in well under a megabyte of gzip."""
    return Answer(_compressed(_vector(_repeat(sample(pods()[0][1]) + b",", 150 * MB)), 31), "gzip")


def deflate_bomb() -> Answer:
    return Answer(
        _compressed(_vector(_repeat(sample(pods()[1][1]) + b",", 150 * MB)), 15), "deflate"
    )


def huge_body() -> Answer:
    """100 MB of valid samples, sent as fast as the socket takes them."""
    return Answer(_joined(_vector(_samples(100 * MB))))


def series_flood() -> Answer:
    """A million series for one of our own pods (a pod exporting a million model names)."""
    pod = pods()[0][1]
    parts = (sample(pod, model_name=f"m{i}") + b"," for i in range(1_000_000))
    return Answer(_compressed(_vector(parts), 31), "gzip")


def container_bomb() -> Answer:
    """30 MB of empty lists: 64 bytes of Python object per 3 bytes of JSON."""
    return Answer(HEAD + b"[]," * (10 * MB) + b"[]" + TAIL)


def container_bomb_gzip() -> Answer:
    body = HEAD + b"[]," * (60 * MB) + b"[]" + TAIL
    return Answer(_compressed(iter([body]), 31), "gzip")


def deep_nesting() -> Answer:
    depth = 2 * MB
    return Answer(b'{"status":"success","data":{"result":' + b"[" * depth + b"]" * depth + TAIL[1:])


def huge_label() -> Answer:
    """One sample whose model_name is 64 MB long."""
    return Answer(_joined(_vector(iter([sample(pods()[0][1], model_name="m" * 64 * MB) + b","]))))


def huge_body_chunked() -> Answer:
    return Answer(huge_body().body, chunked=True)


def gzip_bomb_chunked() -> Answer:
    return Answer(gzip_bomb().body, "gzip", chunked=True)


def container_bomb_chunked() -> Answer:
    return Answer(container_bomb().body, chunked=True)


def slow_drip() -> Answer:
    """A valid answer at 200 bytes per second: it outlives any query timeout."""
    return Answer(clean().body, drip_bytes_per_s=200.0)


SCENARIOS: dict[str, Callable[[], Answer]] = {
    "clean": clean,
    "gzip-bomb": gzip_bomb,
    "deflate-bomb": deflate_bomb,
    "huge-body-100MB": huge_body,
    "series-flood-1M": series_flood,
    "container-bomb": container_bomb,
    "container-bomb-gzip": container_bomb_gzip,
    "deep-nesting": deep_nesting,
    "huge-label-64MB": huge_label,
    "huge-body-100MB-chunked": huge_body_chunked,
    "gzip-bomb-chunked": gzip_bomb_chunked,
    "container-bomb-chunked": container_bomb_chunked,
    "slow-drip": slow_drip,
}
