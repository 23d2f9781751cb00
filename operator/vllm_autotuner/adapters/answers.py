"""Reading a Prometheus answer with bounded memory, whatever the server sends.

An answer used to be read whole, decompressed without limit and parsed at once: about 150 KB of
gzip became a 491 MB peak (the chart's limit is 512 Mi), and a 100 MB body outlived the query
timeout. Here every answer has a budget that follows from what was asked (`AnswerLimits`):

- bytes on the wire and bytes after decompression, counted as they arrive: a compressed body is
  inflated piece by piece with zlib's ``max_length``, so a bomb stops at the budget, not after;
- the number of JSON values (every container and every comma), counted in C before parsing: the
  objects ``json.loads`` would build are bounded by it whatever the shape (a list of millions of
  empty lists costs 64 bytes per 3 bytes of input);
- nesting depth: a decoder that runs out of recursion gives no answer, not an exception.

Pure: the transports feed bytes in and get a decoded answer or `AnswerTooLarge` out.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

ANSWER_BASE_BYTES = 256 * 1024
"""Room every answer gets: the envelope, warnings, a few series of any kind."""
ANSWER_BYTES_PER_POD = 32 * 1024
"""What one pod's series can legitimately take in one answer: a histogram's ~20 buckets in two
spellings (``vllm:``/``vllm_``) and a few engines, at about 200 bytes per JSON sample."""
ANSWER_MAX_BYTES = 64 * 1024 * 1024
"""No answer is read past this, however many pods were asked about."""
BYTES_PER_VALUE = 16
"""A JSON sample spends ~18 bytes per value (labels, timestamp, value); garbage spends 2-3."""
SAMPLES_PER_POD = 512
"""Series one pod may contribute to one answer; beyond that, that pod's extra series are
dropped (a pod exporting thousands of model names cannot crowd out the others)."""
READ_CHUNK = 64 * 1024


class AnswerRefused(ValueError):
    """The answer broke its budget or its encoding; nothing of it is used."""


@dataclass(frozen=True)
class AnswerLimits:
    """The budget of one answer: `max_bytes` on the wire and after decompression alike,
    `max_values` JSON values."""

    max_bytes: int
    max_values: int

    @classmethod
    def for_pods(cls, pods: int) -> AnswerLimits:
        """An answer about `pods` pods (0 when unknown: a discovery query)."""
        size = min(ANSWER_MAX_BYTES, ANSWER_BASE_BYTES + max(0, pods) * ANSWER_BYTES_PER_POD)
        return cls(max_bytes=size, max_values=size // BYTES_PER_VALUE)

    @classmethod
    def fixed(cls, max_bytes: int) -> AnswerLimits:
        return cls(max_bytes=max_bytes, max_values=max_bytes // BYTES_PER_VALUE)


class Inflater:
    """Decodes a Content-Encoding incrementally into `out`, never past `limit` bytes."""

    def __init__(self, encoding: str | None, limit: int) -> None:
        kind = (encoding or "identity").strip().lower()
        if kind in ("", "identity"):
            self._zlib: Any = None
        elif kind in ("gzip", "x-gzip"):
            self._zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif kind == "deflate":
            self._zlib = zlib.decompressobj(32 + zlib.MAX_WBITS)  # zlib or gzip header
        else:
            raise AnswerRefused(f"unsupported Content-Encoding {kind[:40]!r}")
        self.limit = limit
        self.out = bytearray()

    def feed(self, chunk: bytes) -> None:
        if self._zlib is None:
            self._append(chunk)
            return
        data = chunk
        while data:
            room = self.limit - len(self.out) + 1  # one byte more tells "too large" apart
            try:
                piece = self._zlib.decompress(data, room)
            except zlib.error as exc:
                raise AnswerRefused(f"the compressed answer is corrupt ({exc})") from None
            self._append(piece)
            data = self._zlib.unconsumed_tail

    def finish(self) -> bytearray:
        if self._zlib is not None:
            try:
                self._append(self._zlib.flush())
            except zlib.error as exc:
                raise AnswerRefused(f"the compressed answer is corrupt ({exc})") from None
        return self.out

    def _append(self, piece: bytes) -> None:
        if len(self.out) + len(piece) > self.limit:
            raise AnswerRefused(f"the answer is larger than {self.limit} bytes")
        self.out += piece


def check_values(body: bytes | bytearray, limits: AnswerLimits) -> None:
    """AnswerRefused when `body` may hold more JSON values than `limits` allow.

    The count is an upper bound on the objects a parser creates (every value but the first in
    a container follows a comma), taken in C before any object exists.
    """
    values = body.count(b"[") + body.count(b"{") + body.count(b",")
    if values > limits.max_values:
        raise AnswerRefused(
            f"the answer holds up to {values} JSON values, more than the {limits.max_values} "
            "this query can need"
        )


def decode(body: bytes | bytearray, limits: AnswerLimits) -> Any:
    """The JSON of `body`, or None when it is not JSON; AnswerRefused when it is too big."""
    check_values(body, limits)
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None
