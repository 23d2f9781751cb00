"""Credentials through the `kubernetes` package, and what we add to it: a kubeconfig token file
re-read every minute, a failed refresh that keeps the last token, refusals of what kopf's
connection cannot carry, and kopf logging in again before a rotating token goes stale.

Wire tests send real requests through `KubeClient` to a recorder on 127.0.0.1.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from aiohttp import web
from kubernetes.config import incluster_config

from vllm_autotuner.adapters.kube import (
    KubeClient,
    KubeconfigError,
    KubeCredentials,
    KubeError,
    NotFound,
    load_credentials,
    load_incluster,
    load_kubeconfig,
)

EXEC_V1 = "client.authentication.k8s.io/v1"
CERT = "-----BEGIN CERTIFICATE-----\nthe-client\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nthe-key\n-----END PRIVATE KEY-----\n"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def kubeconfig(
    path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None, server: str = ""
) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "ctx",
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": {"server": server or "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": user}],
    }
    doc["clusters"][0]["cluster"].update(cluster or {})  # type: ignore[index]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(autouse=True)
def _no_ambient_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Neither this machine's pod identity nor its kubeconfig may leak into a case."""
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBECONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """An HTTP server that records each request's method, path, query and headers."""
    seen: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "auth": request.headers.get("Authorization"),
                "type": request.headers.get("Content-Type"),
                "body": await request.text(),
            }
        )
        if request.path.endswith("/missing"):
            return web.json_response({"kind": "Status", "message": "not here"}, status=404)
        return web.json_response({"kind": "Thing", "metadata": {"name": "x"}, "items": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------------------ kubeconfig


def test_a_token_kubeconfig_reaches_the_configuration(tmp_path: Path) -> None:
    creds = load_credentials(str(kubeconfig(tmp_path / "kc", {"token": "s3"})))
    assert creds.server == "http://127.0.0.1:1"
    assert creds.authorization() == ("Bearer", "s3")
    assert not creds.rotating


def test_kubeconfig_env_merges_files_first_name_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = kubeconfig(tmp_path / "a", {"token": "from-a"}, server="http://first:1")
    second = kubeconfig(tmp_path / "b", {"token": "from-b"}, server="http://second:1")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'absent'}:{first}:{second}")
    creds = load_credentials()
    assert (creds.server, creds.authorization()[1]) == ("http://first:1", "from-a")


def test_explicit_path_must_exist(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match=r"kubeconfig .*/absent does not exist"):
        load_credentials(str(tmp_path / "absent"))


def test_kubeconfig_env_with_no_existing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(KubeconfigError, match="none of the files in KUBECONFIG exist"):
        load_credentials()


def test_nothing_to_load() -> None:
    with pytest.raises(KubeconfigError, match=r"KUBERNETES_SERVICE_HOST is unset.*\.kube/config"):
        load_credentials()


def test_an_unknown_context_names_the_file(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "kc", {"token": "t"})
    path.write_text(path.read_text().replace("current-context: ctx", "current-context: nope"))
    with pytest.raises(KubeconfigError, match=rf"kubeconfig {path}: .*nope"):
        load_credentials(str(path))


@pytest.mark.parametrize(
    ("user", "cluster", "fragment"),
    [
        ({"token": "t", "as": "admin"}, {}, "sets as: impersonation"),
        ({"token": "t", "as-groups": ["system:masters"]}, {}, "sets as-groups: impersonation"),
        ({"token": "t"}, {"tls-server-name": "kubernetes"}, "sets tls-server-name"),
    ],
)
def test_refuses_what_kopf_cannot_carry(
    user: dict[str, Any], cluster: dict[str, Any], fragment: str, tmp_path: Path
) -> None:
    path = kubeconfig(tmp_path / "kc", user, cluster)
    with pytest.raises(KubeconfigError, match=fragment) as error:
        load_credentials(str(path))
    assert str(path) in str(error.value) and "not supported" in str(error.value)


# ---------------------------------------------------------------------------- exec plugins

# Prints an ExecCredential whose token counts the runs (a file beside the script), expiring
# `argv[1]` seconds from now; with "cert" it answers with a client certificate instead.
PLUGIN = textwrap.dedent(
    """
    import datetime, json, os, pathlib, sys
    count = pathlib.Path(__file__).with_suffix(".count")
    n = int(count.read_text()) + 1 if count.exists() else 1
    count.write_text(str(n))
    if sys.argv[1] == "fail":
        sys.stderr.write("error: the SSO session has expired\\n")
        sys.exit(3)
    if sys.argv[1] == "cert":
        status = {"clientCertificateData": os.environ["PLUGIN_CERT"],
                  "clientKeyData": os.environ["PLUGIN_KEY"]}
    else:
        expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=int(sys.argv[1]))
        status = {"token": f"exec-{n}",
                  "expirationTimestamp": expiry.strftime("%Y-%m-%dT%H:%M:%SZ")}
    info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
    assert info["kind"] == "ExecCredential", info
    print(json.dumps({"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                      "status": status}))
    """
)


def exec_user(tmp_path: Path, arg: str) -> dict[str, Any]:
    script = tmp_path / "plugin.py"
    script.write_text(PLUGIN)
    return {
        "exec": {
            "apiVersion": EXEC_V1,
            "command": sys.executable,
            "args": [str(script), arg],
            "interactiveMode": "Never",
            "env": [{"name": "PLUGIN_CERT", "value": CERT}, {"name": "PLUGIN_KEY", "value": KEY}],
        }
    }


def plugin_runs(tmp_path: Path) -> int:
    count = tmp_path / "plugin.count"
    return int(count.read_text()) if count.exists() else 0


def test_an_exec_token_about_to_expire_is_fetched_again(tmp_path: Path) -> None:
    """The library refreshes within five minutes of the expiry: a 60 s token every time."""
    creds = load_credentials(str(kubeconfig(tmp_path / "kc", exec_user(tmp_path, "60"))))
    assert creds.rotating
    tokens = [creds.authorization()[1] for _ in range(3)]
    assert tokens[-1] != tokens[0] and plugin_runs(tmp_path) >= 3


def test_a_long_lived_exec_token_is_fetched_once(tmp_path: Path) -> None:
    creds = load_credentials(str(kubeconfig(tmp_path / "kc", exec_user(tmp_path, "3600"))))
    tokens = {creds.authorization()[1] for _ in range(3)}
    assert tokens == {"exec-1"} and plugin_runs(tmp_path) == 1


def test_an_exec_client_certificate_lands_in_files(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path / "kc", exec_user(tmp_path, "cert"), server="https://k:6443")
    cfg = load_credentials(str(path)).configuration
    assert (Path(cfg.cert_file).read_text(), Path(cfg.key_file).read_text()) == (CERT, KEY)


def test_an_exec_plugin_that_fails_is_refused_not_anonymous(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match="exec plugin of user 'u' gave no credential"):
        load_credentials(str(kubeconfig(tmp_path / "kc", exec_user(tmp_path, "fail"))))


async def test_the_client_sends_each_fresh_exec_token(
    tmp_path: Path, recorder: tuple[str, list[dict[str, Any]]]
) -> None:
    url, seen = recorder
    path = kubeconfig(tmp_path / "kc", exec_user(tmp_path, "60"), server=url)
    client = KubeClient(load_credentials(str(path)))
    try:
        await client.get("/api/v1/namespaces/default")
        await client.get("/api/v1/namespaces/default")
    finally:
        await client.close()
    assert seen[0]["auth"] != seen[1]["auth"]
    assert all(s["auth"].startswith("Bearer exec-") for s in seen)


# ------------------------------------------------------------------------- token files


def test_a_kubeconfig_token_file_is_re_read_every_minute(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("first\n")
    clock = Clock()
    creds = load_kubeconfig([kubeconfig(tmp_path / "kc", {"tokenFile": "tok"})], clock=clock)
    assert creds.rotating and creds.authorization() == ("Bearer", "first")
    (tmp_path / "tok").write_text("second\n")
    clock.now += 59.0
    assert creds.authorization()[1] == "first"  # not yet due
    clock.now += 1.0
    assert creds.authorization()[1] == "second"


def test_a_failed_re_read_keeps_the_last_good_token_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "tok").write_text("good")
    clock = Clock()
    creds = load_kubeconfig([kubeconfig(tmp_path / "kc", {"tokenFile": "tok"})], clock=clock)
    (tmp_path / "tok").unlink()
    clock.now += 61.0
    with caplog.at_level(logging.WARNING):
        assert creds.authorization()[1] == "good"
    assert "cannot refresh the Kubernetes credential" in caplog.text
    (tmp_path / "tok").write_text("")  # an empty file is no token either
    clock.now += 61.0
    assert creds.authorization()[1] == "good"


def test_an_inline_token_beats_the_file_and_never_changes(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file")
    clock = Clock()
    path = kubeconfig(tmp_path / "kc", {"token": "inline", "tokenFile": "tok"})
    creds = load_kubeconfig([path], clock=clock)
    clock.now += 1e6
    assert creds.authorization()[1] == "inline" and not creds.rotating


@pytest.fixture
def service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    return sa


class FakeDatetime(datetime.datetime):
    shift = datetime.timedelta(0)

    @classmethod
    def now(cls, tz: datetime.tzinfo | None = None) -> FakeDatetime:
        return super().now(tz) + cls.shift  # type: ignore[return-value]


def test_in_cluster_re_reads_the_service_account_token(
    service_account: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = SimpleNamespace(datetime=FakeDatetime, timedelta=datetime.timedelta)
    monkeypatch.setattr(incluster_config, "datetime", fake)
    creds = load_credentials(service_account_dir=service_account)
    assert creds.server == "https://[fd00::1]:443" and creds.rotating
    assert creds.authorization()[1] == "sa-token"
    (service_account / "token").write_text("rotated")
    monkeypatch.setattr(FakeDatetime, "shift", datetime.timedelta(seconds=61))
    assert creds.authorization()[1] == "rotated"


def test_an_explicit_kubeconfig_outranks_the_service_account(
    service_account: Path, tmp_path: Path
) -> None:
    creds = load_credentials(str(kubeconfig(tmp_path / "kc", {"token": "mine"})))
    assert creds.authorization()[1] == "mine"


def test_in_cluster_errors_name_the_directory(service_account: Path) -> None:
    (service_account / "token").unlink()
    with pytest.raises(KubeconfigError, match=rf"in-cluster config \({service_account}\)"):
        load_incluster(service_account)


# ------------------------------------------------------------------------------ the client


async def test_apply_is_server_side_under_our_field_manager(
    recorder: tuple[str, list[dict[str, Any]]],
) -> None:
    url, seen = recorder
    client = KubeClient(KubeCredentials.for_server(url, token="t"))
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llm", "namespace": "team-a"},
    }
    try:
        result = await client.apply(manifest)
        await client.merge_patch(
            "/apis/vllm.autotuner.io/v1alpha1/namespaces/a/vllmdeployments/x",
            {"status": {"phase": "Idle"}},
            subresource="status",
        )
        assert await client.get("/api/v1/namespaces/a/pods/missing") is None
        with pytest.raises(NotFound, match="HTTP 404: not here"):
            await client.request("DELETE", "/api/v1/namespaces/a/pods/missing")
    finally:
        await client.close()
    assert result["kind"] == "Thing"
    apply, status = seen[0], seen[1]
    assert apply["method"] == "PATCH"
    assert apply["path"] == "/apis/apps/v1/namespaces/team-a/deployments/llm"
    assert apply["query"] == {"fieldManager": "vllm-autotuner", "force": "true"}
    assert apply["type"] == "application/apply-patch+yaml" and apply["auth"] == "Bearer t"
    assert json.loads(apply["body"]) == manifest
    assert status["path"].endswith("/vllmdeployments/x/status")
    assert status["type"] == "application/merge-patch+json"


async def test_an_unreachable_server_is_a_kube_error() -> None:
    client = KubeClient(KubeCredentials.for_server("http://127.0.0.1:1"), timeout_s=2.0)
    client.api.configuration.retries = 0
    try:
        with pytest.raises(KubeError, match="cannot reach the API server") as error:
            await client.get("/api/v1/namespaces")
    finally:
        await client.close()
    assert error.value.status == 0


# --------------------------------------------------------------------------------- kopf


def test_kopf_logs_in_again_before_a_rotating_token_can_go_stale(tmp_path: Path) -> None:
    from vllm_autotuner.operator import LOGIN_TTL, OperatorConfig, build_registry

    def login_info(creds: KubeCredentials) -> Any:
        registry, _ = build_registry(OperatorConfig(credentials=creds))
        handlers = registry._activities.get_all_handlers()
        (handler,) = [h for h in handlers if h.id.endswith(".login")]
        return handler.fn()

    (tmp_path / "tok").write_text("t1")
    info = login_info(load_kubeconfig([kubeconfig(tmp_path / "kc", {"tokenFile": "tok"})]))
    assert (info.scheme, info.token) == ("Bearer", "t1")
    left = info.expiration - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(0) < left <= LOGIN_TTL
    static = login_info(KubeCredentials.for_server("https://k", token="t1"))
    assert static.expiration is None and static.token == "t1"


def test_run_without_credentials_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_autotuner import cli

    assert cli.main(["run", "--kubeconfig", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot load Kubernetes credentials: kubeconfig")
    assert len(err.splitlines()) == 1
