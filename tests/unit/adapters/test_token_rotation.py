"""A rotated service-account token reaches every request, ours and kopf's, without a restart."""

from __future__ import annotations

import datetime
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from vllm_autotuner.adapters.kube import KubeClient
from vllm_autotuner.adapters.kubeconfig import (
    BearerToken,
    KubeCredentials,
    load_incluster,
    load_kubeconfig,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_token_file_is_re_read_after_the_refresh_interval(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    clock = Clock()
    bearer = BearerToken(
        KubeCredentials(server="https://k", token="first", token_file=str(token)),
        refresh_s=60.0,
        clock=clock,
    )
    token.write_text("second\n")
    clock.now += 59.0
    assert bearer.current() == "first"  # not yet due
    clock.now += 1.0
    assert bearer.current() == "second"


def test_a_failed_re_read_keeps_the_last_good_token_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = tmp_path / "token"
    token.write_text("good")
    clock = Clock()
    bearer = BearerToken(
        KubeCredentials(server="https://k", token="good", token_file=str(token)), clock=clock
    )
    token.unlink()
    clock.now += 61.0
    with caplog.at_level(logging.WARNING):
        assert bearer.current() == "good"
    assert "cannot re-read the token file" in caplog.text
    token.write_text("")  # an empty file is no token either
    clock.now += 61.0
    assert bearer.current() == "good"


def test_an_inline_token_is_never_re_read() -> None:
    clock = Clock()
    bearer = BearerToken(KubeCredentials(server="https://k", token="inline"), clock=clock)
    clock.now += 1e6
    assert bearer.current() == "inline"


def test_the_loaders_say_which_tokens_come_from_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token\n")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    incluster = load_incluster(sa)
    assert (incluster.token, incluster.token_file) == ("sa-token", str(sa / "token"))

    (tmp_path / "tok").write_text("file-token\n")
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        """
apiVersion: v1
kind: Config
current-context: a
contexts:
- {name: a, context: {cluster: c, user: from-file}}
- {name: b, context: {cluster: c, user: inline}}
clusters:
- {name: c, cluster: {server: "http://127.0.0.1:1"}}
users:
- {name: from-file, user: {tokenFile: tok}}
- {name: inline, user: {token: inline-token}}
"""
    )
    from_file = load_kubeconfig([kubeconfig])
    assert (from_file.token, from_file.token_file) == ("file-token", str(tmp_path / "tok"))
    text = kubeconfig.read_text().replace("current-context: a", "current-context: b")
    kubeconfig.write_text(text)
    inline = load_kubeconfig([kubeconfig])
    assert (inline.token, inline.token_file) == ("inline-token", None)


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[str, list[str | None]]]:
    seen: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"kind": "Status", "status": "Success"})

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_the_client_sends_the_rotated_token_on_its_open_session(
    tmp_path: Path, recorder: tuple[str, list[str | None]]
) -> None:
    url, seen = recorder
    token = tmp_path / "token"
    token.write_text("before")
    creds = KubeCredentials(server=url, token="before", token_file=str(token))
    client = KubeClient(creds)
    clock = Clock()
    client.bearer = BearerToken(creds, refresh_s=60.0, clock=clock)
    try:
        await client.get("/api/v1/namespaces/default")
        token.write_text("after")
        clock.now += 60.0
        await client.get("/api/v1/namespaces/default")
    finally:
        await client.close()
    assert seen == ["Bearer before", "Bearer after"]


def test_kopf_logs_in_again_before_a_file_token_can_go_stale(tmp_path: Path) -> None:
    from vllm_autotuner.operator import LOGIN_TTL, OperatorConfig, build_registry

    def login_info(creds: KubeCredentials) -> object:
        registry, _ = build_registry(OperatorConfig(credentials=creds))
        handlers = registry._activities.get_all_handlers()
        (handler,) = [h for h in handlers if h.id.endswith(".login")]
        return handler.fn()

    token = tmp_path / "token"
    token.write_text("t1")
    info = login_info(KubeCredentials(server="https://k", token="t1", token_file=str(token)))
    assert info.token == "t1"  # type: ignore[attr-defined]
    left = info.expiration - datetime.datetime.now(datetime.UTC)  # type: ignore[attr-defined]
    assert datetime.timedelta(0) < left <= LOGIN_TTL
    static = login_info(KubeCredentials(server="https://k", token="t1"))
    assert static.expiration is None  # type: ignore[attr-defined]
