"""ControlPlane.request retries a 429 that carries Retry-After, as client-go does.

A fresh kube-apiserver on a loaded machine can answer "429 Too Many Requests, Retry-After: 1"
(seen in the local-cluster test's first call after start); a client that gives up on it fails
where kubectl would have waited. Served here by a local HTTPS server with the run's own PKI.
"""

from __future__ import annotations

import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_localcluster.controlplane import pki as pki_mod
from vllm_localcluster.controlplane.launcher import (
    TOO_MANY_REQUESTS_RETRIES,
    ControlPlane,
    retry_after_s,
)


class Busy(http.server.BaseHTTPRequestHandler):
    """429 with Retry-After: 0 for the first `busy` requests, then 200 with a JSON body."""

    busy = 0
    seen = 0
    retry_after: str | None = "0"

    def do_GET(self) -> None:
        type(self).seen += 1
        if type(self).seen <= type(self).busy:
            self.send_response(429)
            if self.retry_after is not None:
                self.send_header("Retry-After", self.retry_after)
            body = b'{"kind": "Status", "code": 429}'
        else:
            self.send_response(200)
            body = json.dumps({"seen": type(self).seen}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ControlPlane]:
    pki = pki_mod.generate(tmp_path / "pki")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.serving_cert, pki.serving_key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    cp = ControlPlane(tmp_path / "cp")
    cp.pki, cp.port = pki, httpd.server_address[1]
    Busy.seen = 0
    try:
        yield cp
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_429_with_retry_after_is_retried(server: ControlPlane) -> None:
    Busy.busy, Busy.retry_after = 2, "0"
    assert server.request("GET", "/api") == (200, {"seen": 3})


def test_retries_are_bounded(server: ControlPlane) -> None:
    Busy.busy, Busy.retry_after = 1000, "0"
    status, _ = server.request("GET", "/api")
    assert status == 429
    assert Busy.seen == TOO_MANY_REQUESTS_RETRIES


def test_a_429_without_retry_after_is_answered_as_is(server: ControlPlane) -> None:
    Busy.busy, Busy.retry_after = 1, None
    assert server.request("GET", "/api")[0] == 429
    assert Busy.seen == 1


@pytest.mark.parametrize(
    ("header", "seconds"), [(None, None), ("1", 1.0), ("0", 0.0), ("600", 10.0), ("soon", None)]
)
def test_retry_after_in_seconds(header: str | None, seconds: float | None) -> None:
    assert retry_after_s(header) == seconds
