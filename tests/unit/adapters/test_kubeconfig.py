"""Our kubeconfig loader against the `kubernetes` package's, file by file, and its refusals.

The differential tests load each kubeconfig of a small corpus with both loaders and compare
what reaches the wire: server, bearer token, whether TLS is verified, and the contents of the
CA, client certificate and key files (their paths differ: each loader writes inline data to
its own temporary files). Where kubectl and `kubernetes.config` disagree (current-context in
several $KUBECONFIG files, relative paths in a merged file) ours follows kubectl and is tested
alone.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import pytest
import yaml
from kubernetes.config.incluster_config import InClusterConfigLoader

from vllm_autotuner.adapters.kube import KubeCredentials as ReExported
from vllm_autotuner.adapters.kube import load_credentials as reexported_loader
from vllm_autotuner.adapters.kubeconfig import (
    KubeconfigError,
    KubeCredentials,
    load_credentials,
)

REPO = Path(__file__).resolve().parents[3]
CA = "-----BEGIN CERTIFICATE-----\nthe-ca\n-----END CERTIFICATE-----\n"
CERT = "-----BEGIN CERTIFICATE-----\nthe-client\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nthe-key\n-----END PRIVATE KEY-----\n"
EXEC_V1 = "client.authentication.k8s.io/v1"
EXEC_V1BETA1 = "client.authentication.k8s.io/v1beta1"

# Prints an ExecCredential: argv[1] the apiVersion, argv[2] "token" or "cert". The token comes
# from the kubeconfig's exec env, so the test also sees that env entries reach the plugin.
PLUGIN = textwrap.dedent(
    """
    import json, os, sys
    api_version, form = sys.argv[1], sys.argv[2]
    if form == "token":
        status = {"token": os.environ["PLUGIN_TOKEN"]}
    else:
        status = {"clientCertificateData": os.environ["PLUGIN_CERT"],
                  "clientKeyData": os.environ["PLUGIN_KEY"]}
    info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
    assert info["kind"] == "ExecCredential" and info["apiVersion"] == api_version, info
    print(json.dumps({"apiVersion": api_version, "kind": "ExecCredential", "status": status}))
    """
)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def kubeconfig(
    clusters: dict[str, dict[str, Any]],
    users: dict[str, dict[str, Any]],
    contexts: dict[str, tuple[str, str]],
    current: str | None,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": n, "cluster": c} for n, c in clusters.items()],
        "users": [{"name": n, "user": u} for n, u in users.items()],
        "contexts": [
            {"name": n, "context": {"cluster": c, "user": u}} for n, (c, u) in contexts.items()
        ],
    }
    if current is not None:
        doc["current-context"] = current
    return doc


def single(cluster: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    return kubeconfig({"c": cluster}, {"u": user}, {"ctx": ("c", "u")}, "ctx")


def write(path: Path, doc: dict[str, Any] | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def exec_user(tmp_path: Path, api_version: str, form: str) -> dict[str, Any]:
    script = write(tmp_path / "plugin.py", PLUGIN)
    spec: dict[str, Any] = {
        "apiVersion": api_version,
        "command": sys.executable,
        "args": [str(script), api_version, form],
        "env": [
            {"name": "PLUGIN_TOKEN", "value": f"exec-token-{api_version.rsplit('/', 1)[1]}"},
            {"name": "PLUGIN_CERT", "value": CERT},
            {"name": "PLUGIN_KEY", "value": KEY},
        ],
    }
    if api_version == EXEC_V1:
        spec["interactiveMode"] = "Never"  # required by client-go for v1
    return {"exec": spec}


HTTPS = "https://api.example.test:6443"

# name -> writes the kubeconfig (and what it refers to) under tmp_path, returns its path
Case = Callable[[Path], Path]
CORPUS: dict[str, Case] = {
    "token": lambda t: write(
        t / "kc", single({"server": HTTPS, "certificate-authority-data": b64(CA)}, {"token": "s3"})
    ),
    "plain-http-token": lambda t: write(
        t / "kc", single({"server": "http://127.0.0.1:8001/"}, {"token": "s3"})
    ),
    "token-file-relative": lambda t: (
        write(t / "conf/tokens/t", "from-a-file"),
        write(t / "conf/kc", single({"server": HTTPS}, {"tokenFile": "tokens/t"})),
    )[-1],
    "inline-token-beats-token-file": lambda t: (
        write(t / "t", "from-a-file"),
        write(t / "kc", single({"server": HTTPS}, {"token": "inline", "tokenFile": "t"})),
    )[-1],
    "ca-data": lambda t: write(
        t / "kc", single({"server": HTTPS, "certificate-authority-data": b64(CA)}, {})
    ),
    "ca-file-relative": lambda t: (
        write(t / "conf/pki/ca.pem", CA),
        write(
            t / "conf/kc",
            single({"server": HTTPS, "certificate-authority": "pki/ca.pem"}, {"token": "x"}),
        ),
    )[-1],
    "ca-data-beats-file": lambda t: (
        write(t / "other.pem", "not this one\n"),
        write(
            t / "kc",
            single(
                {
                    "server": HTTPS,
                    "certificate-authority": "other.pem",
                    "certificate-authority-data": b64(CA),
                },
                {"token": "x"},
            ),
        ),
    )[-1],
    "client-cert-key-data": lambda t: write(
        t / "kc",
        single(
            {"server": HTTPS, "certificate-authority-data": b64(CA)},
            {"client-certificate-data": b64(CERT), "client-key-data": b64(KEY)},
        ),
    ),
    "client-cert-key-files-relative": lambda t: (
        write(t / "conf/pki/c.pem", CERT),
        write(t / "conf/pki/k.pem", KEY),
        write(
            t / "conf/kc",
            single(
                {"server": HTTPS},
                {"client-certificate": "pki/c.pem", "client-key": "pki/k.pem"},
            ),
        ),
    )[-1],
    "insecure-skip-tls-verify": lambda t: write(
        t / "kc", single({"server": HTTPS, "insecure-skip-tls-verify": True}, {"token": "x"})
    ),
    "exec-v1-token": lambda t: write(
        t / "kc", single({"server": HTTPS}, exec_user(t, EXEC_V1, "token"))
    ),
    "exec-v1beta1-token": lambda t: write(
        t / "kc", single({"server": HTTPS}, exec_user(t, EXEC_V1BETA1, "token"))
    ),
    "exec-v1-client-cert": lambda t: write(
        t / "kc",
        single(
            {"server": HTTPS, "certificate-authority-data": b64(CA)}, exec_user(t, EXEC_V1, "cert")
        ),
    ),
    "exec-v1beta1-client-cert": lambda t: write(
        t / "kc", single({"server": HTTPS}, exec_user(t, EXEC_V1BETA1, "cert"))
    ),
    "current-context-switch": lambda t: write(
        t / "kc",
        kubeconfig(
            {"one": {"server": "https://one:6443"}, "two": {"server": "https://two:6443"}},
            {"u1": {"token": "t1"}, "u2": {"token": "t2"}},
            {"first": ("one", "u1"), "second": ("two", "u2")},
            "second",
        ),
    ),
}


def _read(path: str | None) -> str | None:
    return None if path is None else Path(path).read_text()


def wire(creds: KubeCredentials) -> dict[str, Any]:
    return {
        "server": creds.server,
        "token": creds.token,
        "verify": creds.verify,
        "ca": _read(creds.ca_file),
        "cert": _read(creds.cert_file),
        "key": _read(creds.key_file),
    }


def reference(config_file: str) -> dict[str, Any]:
    """What `kubernetes.config.load_kube_config` would put on the wire."""
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=config_file, client_configuration=cfg, persist_config=False
    )
    auth = cfg.api_key.get("BearerToken")
    return {
        "server": cfg.host,
        "token": auth.split(" ", 1)[1] if auth else None,
        "verify": cfg.verify_ssl,
        "ca": _read(cfg.ssl_ca_cert),
        "cert": _read(cfg.cert_file),
        "key": _read(cfg.key_file),
    }


@pytest.fixture(autouse=True)
def _no_ambient_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Neither this machine's pod identity nor its kubeconfig may leak into a case."""
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBECONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_matches_the_kubernetes_loader(case: str, tmp_path: Path) -> None:
    path = CORPUS[case](tmp_path)
    ours = wire(load_credentials(str(path)))
    assert ours == reference(str(path))
    assert ours["server"].startswith("http")  # the comparison is not of two empty results


def test_corpus_covers_each_kind_of_credential(tmp_path: Path) -> None:
    """Guards the corpus itself: a broken case would compare two identical nothings."""
    seen = {name: wire(load_credentials(str(CORPUS[name](tmp_path / name)))) for name in CORPUS}
    assert seen["token-file-relative"]["token"] == "from-a-file"
    assert seen["inline-token-beats-token-file"]["token"] == "inline"
    assert seen["ca-file-relative"]["ca"] == CA
    assert seen["ca-data-beats-file"]["ca"] == CA
    assert (seen["client-cert-key-data"]["cert"], seen["client-cert-key-data"]["key"]) == (
        CERT,
        KEY,
    )
    assert seen["insecure-skip-tls-verify"]["verify"] is False
    assert seen["exec-v1-token"]["token"] == "exec-token-v1"
    assert seen["exec-v1beta1-token"]["token"] == "exec-token-v1beta1"
    assert seen["exec-v1-client-cert"]["key"] == KEY
    assert seen["exec-v1beta1-client-cert"]["cert"] == CERT
    assert seen["current-context-switch"] == {
        "server": "https://two:6443",
        "token": "t2",
        "verify": True,
        "ca": None,
        "cert": None,
        "key": None,
    }
    assert seen["plain-http-token"]["server"] == "http://127.0.0.1:8001"


def test_kubeconfig_env_merges_two_files_first_name_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = write(
        tmp_path / "a/config",
        kubeconfig(
            {"shared": {"server": "https://from-a:6443"}},
            {"ua": {"token": "ta"}},
            {"ctx-a": ("shared", "ua")},
            "ctx-b",  # defined only in the second file
        ),
    )
    second = write(
        tmp_path / "b/config",
        kubeconfig(
            {"shared": {"server": "https://from-b:6443"}},
            {"ub": {"token": "tb"}},
            {"ctx-b": ("shared", "ub")},
            None,
        ),
    )
    listed = f"{first}{os.pathsep}{tmp_path / 'missing'}{os.pathsep}{second}"
    monkeypatch.setenv("KUBECONFIG", listed)
    ours = wire(load_credentials())
    assert ours == reference(f"{first}{os.pathsep}{second}")
    assert (ours["server"], ours["token"]) == ("https://from-a:6443", "tb")


def test_kubeconfig_env_current_context_comes_from_the_first_file_that_sets_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubectl's rule; `kubernetes.config` lets the last file win, so this one is ours alone."""
    clusters = {"one": {"server": "https://one:6443"}, "two": {"server": "https://two:6443"}}
    contexts = {"first": ("one", "u"), "second": ("two", "u")}
    first = write(tmp_path / "a", kubeconfig(clusters, {"u": {"token": "t"}}, contexts, "first"))
    second = write(tmp_path / "b", kubeconfig({}, {}, {}, "second"))
    monkeypatch.setenv("KUBECONFIG", f"{first}{os.pathsep}{second}")
    assert load_credentials().server == "https://one:6443"


def test_relative_paths_resolve_against_the_file_that_names_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubectl resolves each entry against its own file; `kubernetes.config` against the
    cluster's, so the user's certificate in a second file is ours alone."""
    write(tmp_path / "a/ca.pem", CA)
    write(tmp_path / "b/c.pem", CERT)
    write(tmp_path / "b/k.pem", KEY)
    write(tmp_path / "b/token", "tok\n")
    first = write(
        tmp_path / "a/config",
        kubeconfig(
            {"c": {"server": HTTPS, "certificate-authority": "ca.pem"}},
            {},
            {"ctx": ("c", "u")},
            "ctx",
        ),
    )
    second = write(
        tmp_path / "b/config",
        kubeconfig(
            {},
            {"u": {"client-certificate": "c.pem", "client-key": "k.pem", "tokenFile": "token"}},
            {},
            None,
        ),
    )
    monkeypatch.setenv("KUBECONFIG", f"{first}{os.pathsep}{second}")
    assert wire(load_credentials()) == {
        "server": HTTPS,
        "token": "tok",  # a token file's trailing newline is no part of the token
        "verify": True,
        "ca": CA,
        "cert": CERT,
        "key": KEY,
    }


def test_default_kubeconfig_is_under_home(tmp_path: Path) -> None:
    write(tmp_path / "home/.kube/config", single({"server": HTTPS}, {"token": "home"}))
    assert load_credentials().token == "home"


def test_inline_data_lands_in_private_files(tmp_path: Path) -> None:
    path = CORPUS["client-cert-key-data"](tmp_path)
    creds = load_credentials(str(path))
    for name in (creds.ca_file, creds.cert_file, creds.key_file):
        assert name is not None
        assert stat.S_IMODE(os.stat(name).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(Path(name).parent).st_mode) == 0o700


def test_the_kube_module_re_exports_the_loader() -> None:
    assert ReExported is KubeCredentials and reexported_loader is load_credentials


# ---------------------------------------------------------------- in-cluster


def service_account(tmp_path: Path, token: str = "sa-token", ca: str = CA) -> Path:
    directory = tmp_path / "serviceaccount"
    write(directory / "token", token)
    write(directory / "ca.crt", ca)
    return directory


@pytest.mark.parametrize(
    ("host", "url"),
    [("10.96.0.1", "https://10.96.0.1:443"), ("fd00:10:96::1", "https://[fd00:10:96::1]:443")],
)
def test_in_cluster_matches_the_kubernetes_loader(
    host: str, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = service_account(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    # A kubeconfig in the environment does not outrank the pod's own identity.
    monkeypatch.setenv("KUBECONFIG", str(CORPUS["token"](tmp_path)))
    ours = load_credentials(service_account_dir=directory)
    cfg = kubernetes.client.Configuration()
    InClusterConfigLoader(
        token_filename=str(directory / "token"),
        cert_filename=str(directory / "ca.crt"),
        try_refresh_token=False,
    ).load_and_set(cfg)
    assert ours.server == cfg.host == url
    assert ours.token == cfg.api_key["BearerToken"].split(" ", 1)[1] == "sa-token"
    assert ours.ca_file == cfg.ssl_ca_cert and _read(ours.ca_file) == CA
    assert ours.verify is True


def test_explicit_kubeconfig_outranks_the_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    creds = load_credentials(str(CORPUS["token"](tmp_path)), service_account_dir=tmp_path / "no")
    assert (creds.server, creds.token) == (HTTPS, "s3")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: (d / "token").unlink(), r"serviceaccount/token does not exist"),
        (lambda d: (d / "ca.crt").unlink(), r"serviceaccount/ca\.crt does not exist"),
        (lambda d: (d / "token").write_text("\n"), r"serviceaccount/token is empty"),
        (lambda d: (d / "ca.crt").write_text(""), r"serviceaccount/ca\.crt is empty"),
    ],
)
def test_in_cluster_errors(
    setup: Callable[[Path], object],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    directory = service_account(tmp_path)
    setup(directory)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(KubeconfigError, match=message):
        load_credentials(service_account_dir=directory)


def test_in_cluster_needs_the_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    with pytest.raises(KubeconfigError, match="KUBERNETES_SERVICE_PORT"):
        load_credentials(service_account_dir=service_account(tmp_path))


# ---------------------------------------------------------------- errors


def expect_error(tmp_path: Path, doc: dict[str, Any], *fragments: str) -> str:
    path = write(tmp_path / "conf" / "kc", doc)
    with pytest.raises(KubeconfigError) as caught:
        load_credentials(str(path))
    text = str(caught.value)
    assert isinstance(caught.value, ValueError)
    for fragment in (str(path), *fragments):
        assert fragment in text, text
    return text


def test_no_current_context(tmp_path: Path) -> None:
    doc = kubeconfig({"c": {"server": HTTPS}}, {}, {"ctx": ("c", "u")}, None)
    expect_error(tmp_path, doc, "current-context is not set")


def test_unknown_context(tmp_path: Path) -> None:
    doc = kubeconfig({"c": {"server": HTTPS}}, {}, {"ctx": ("c", "u")}, "nope")
    expect_error(tmp_path, doc, "context 'nope'", "not defined")


def test_unknown_cluster(tmp_path: Path) -> None:
    doc = kubeconfig({}, {"u": {"token": "t"}}, {"ctx": ("gone", "u")}, "ctx")
    expect_error(tmp_path, doc, "cluster 'gone'", "context 'ctx'", "not defined")


def test_unknown_user(tmp_path: Path) -> None:
    doc = kubeconfig({"c": {"server": HTTPS}}, {}, {"ctx": ("c", "ghost")}, "ctx")
    expect_error(tmp_path, doc, "user 'ghost'", "not defined")


def test_no_server(tmp_path: Path) -> None:
    expect_error(tmp_path, single({"certificate-authority-data": b64(CA)}, {}), "'c' has no server")


def test_server_without_scheme(tmp_path: Path) -> None:
    expect_error(tmp_path, single({"server": "api:6443"}, {}), "is not an http(s) URL")


@pytest.mark.parametrize(
    ("user", "cluster", "fragment"),
    [
        ({"username": "admin", "password": "pw"}, {}, "user 'u' sets username: basic auth"),
        ({"password": "pw"}, {}, "sets password: basic auth"),
        (
            {"auth-provider": {"name": "gcp", "config": {}}},
            {},
            "sets auth-provider: auth-provider plugins",
        ),
        ({"token": "t", "as": "admin"}, {}, "sets as: impersonation"),
        ({"token": "t", "as-groups": ["system:masters"]}, {}, "sets as-groups: impersonation"),
        ({"token": "t"}, {"proxy-url": "http://proxy:3128"}, "cluster 'c' sets proxy-url"),
        ({"token": "t"}, {"tls-server-name": "kubernetes"}, "cluster 'c' sets tls-server-name"),
    ],
)
def test_refuses_what_it_cannot_honour(
    user: dict[str, Any], cluster: dict[str, Any], fragment: str, tmp_path: Path
) -> None:
    doc = single({"server": HTTPS, **cluster}, user)
    expect_error(tmp_path, doc, fragment, "not supported")


def test_missing_ca_file(tmp_path: Path) -> None:
    doc = single({"server": HTTPS, "certificate-authority": "ca.pem"}, {})
    expect_error(tmp_path, doc, "certificate-authority", str(tmp_path / "conf/ca.pem"))


def test_bad_base64(tmp_path: Path) -> None:
    doc = single({"server": HTTPS, "certificate-authority-data": "not base64!"}, {})
    expect_error(tmp_path, doc, "cluster 'c'", "certificate-authority-data is not valid base64")


def test_certificate_without_key(tmp_path: Path) -> None:
    doc = single({"server": HTTPS}, {"client-certificate-data": b64(CERT)})
    expect_error(tmp_path, doc, "user 'u'", "client-certificate and client-key")


def test_missing_token_file(tmp_path: Path) -> None:
    expect_error(tmp_path, single({"server": HTTPS}, {"tokenFile": "t"}), "cannot read tokenFile")


def test_explicit_path_must_exist(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match=r"kubeconfig .*/absent does not exist"):
        load_credentials(str(tmp_path / "absent"))


def test_kubeconfig_env_with_no_existing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(KubeconfigError, match="none of the files in KUBECONFIG exist"):
        load_credentials()


def test_nothing_to_load(tmp_path: Path) -> None:
    with pytest.raises(KubeconfigError, match=r"KUBERNETES_SERVICE_HOST is unset.*\.kube/config"):
        load_credentials()


def exec_doc(tmp_path: Path, script: str, **spec: Any) -> dict[str, Any]:
    plugin = write(tmp_path / "bad_plugin.py", textwrap.dedent(script))
    body = {"apiVersion": EXEC_V1BETA1, "command": sys.executable, "args": [str(plugin)], **spec}
    return single({"server": HTTPS}, {"exec": body})


def test_exec_failure_quotes_the_tail_of_stderr(tmp_path: Path) -> None:
    script = """
        import sys
        sys.stderr.write("x" * 5000 + "\\nerror: the SSO session has expired\\n")
        sys.exit(3)
    """
    text = expect_error(
        tmp_path, exec_doc(tmp_path, script), "exited with 3", "the SSO session has expired"
    )
    assert len(text) < 2000  # the tail, not the whole of stderr


def test_exec_bad_json(tmp_path: Path) -> None:
    script = """
        import sys
        print("Opening browser...")
        sys.stderr.write("warning: no cache")
    """
    expect_error(tmp_path, exec_doc(tmp_path, script), "printed no ExecCredential JSON", "no cache")


def test_exec_status_without_credentials(tmp_path: Path) -> None:
    script = f"""
        import json
        print(json.dumps({{"apiVersion": "{EXEC_V1BETA1}", "kind": "ExecCredential",
                          "status": {{"clientCertificateData": "only half"}}}}))
    """
    expect_error(tmp_path, exec_doc(tmp_path, script), "neither token nor clientCertificateData")


def test_exec_answer_in_another_version(tmp_path: Path) -> None:
    script = f"""
        import json
        print(json.dumps({{"apiVersion": "{EXEC_V1}", "kind": "ExecCredential",
                          "status": {{"token": "t"}}}}))
    """
    expect_error(tmp_path, exec_doc(tmp_path, script), f"answered '{EXEC_V1}'")


def test_exec_timeout(tmp_path: Path) -> None:
    script = """
        import time
        time.sleep(30)
    """
    path = write(tmp_path / "conf/kc", exec_doc(tmp_path, script))
    with pytest.raises(KubeconfigError, match=r"did not finish within 0\.5 s"):
        load_credentials(str(path), exec_timeout_s=0.5)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"apiVersion": "client.authentication.k8s.io/v1alpha1"}, "exec apiVersion"),
        ({"interactiveMode": "Always"}, "interactiveMode Always"),
        (
            {"command": "surely-no-such-plugin", "installHint": "brew install the-plugin"},
            "not found (brew install the-plugin)",
        ),
    ],
)
def test_exec_refusals(spec: dict[str, Any], fragment: str, tmp_path: Path) -> None:
    expect_error(tmp_path, exec_doc(tmp_path, "print('never run')", **spec), fragment)


def test_exec_command_with_a_directory_is_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    plugin = write(
        tmp_path / "conf/bin/plugin",
        f"#!{sys.executable}\n"
        "import json\n"
        f'print(json.dumps({{"apiVersion": "{EXEC_V1}", "kind": "ExecCredential",'
        ' "status": {"token": "relative"}}))\n',
    )
    plugin.chmod(0o755)
    spec = {"apiVersion": EXEC_V1, "command": "bin/plugin", "interactiveMode": "Never"}
    path = write(tmp_path / "conf/kc", single({"server": HTTPS}, {"exec": spec}))
    assert load_credentials(str(path)).token == "relative"


# ---------------------------------------------------------------- no kubernetes in the operator

_IMPORTS_KUBERNETES = re.compile(r"^\s*(import|from)\s+kubernetes(\.|\s|$)", re.MULTILINE)


def test_operator_sources_never_import_kubernetes() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "operator").rglob("*.py")
        if _IMPORTS_KUBERNETES.search(p.read_text())
    ]
    assert offenders == []


RUN_IMPORTS = textwrap.dedent(
    """
    import json, sys
    import vllm_autotuner.cli as cli
    # The real command up to its credentials: it imports what an operator run imports, then
    # stops with exit code 2 on a kubeconfig that does not exist.
    code = cli.main(["run", "--kubeconfig", sys.argv[1]])
    loaded = sorted(m for m, v in sys.modules.items() if m.split(".")[0] == "kubernetes" and v)
    import kopf
    from kopf._cogs.helpers import thirdparty
    registry = kopf.OperatorRegistry()
    @kopf.on.event("v1", "pods", registry=registry)
    def seen(**_): pass
    handlers = registry._watching.get_all_handlers()
    print(json.dumps({"code": code, "loaded": loaded, "handlers": len(handlers),
                      "kubernetes_entry": repr(sys.modules.get("kubernetes", "absent")),
                      "kopf_model_class": repr(thirdparty.V1ObjectMetaSync)}))
    """
)


def test_operator_run_keeps_the_kubernetes_package_out(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    done = subprocess.run(
        [sys.executable, "-c", RUN_IMPORTS, str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 2 and "cannot load Kubernetes credentials" in done.stderr
    assert result["loaded"] == []
    assert result["kubernetes_entry"] == "None"
    assert result["kopf_model_class"] == "None"  # kopf took its no-client branch
    assert result["handlers"] == 1  # and still registers handlers
