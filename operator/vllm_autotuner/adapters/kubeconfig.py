"""Where the operator's Kubernetes credentials come from: the pod's service account or a kubeconfig.

Why our own loader: the operator needs a server URL, a bearer token and TLS files, read once at
start. The `kubernetes` package's loaders import its generated client, about 11 MiB resident in
a process that must stay under 256 MiB at 1,000 deployments. What this supports follows kubectl
(and `kubernetes.config`, which tests/unit/adapters/test_kubeconfig.py compares it with): the
in-cluster service account; kubeconfig files merged from ``$KUBECONFIG`` the way kubectl merges
them (the first file that defines a name or sets ``current-context`` wins); tokens, token files,
client certificates, CA bundles (paths relative to the file that names them, or inline base64
data written to private temporary files) and exec plugins.

What it cannot honour it refuses with a `KubeconfigError` naming the file and the entry, rather
than connecting with less than the kubeconfig asked for: basic auth, ``auth-provider`` plugins,
impersonation (``as``...), ``proxy-url``, ``tls-server-name`` and interactive exec plugins.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = "~/.kube/config"
# client.authentication.k8s.io/v1alpha1 was removed in Kubernetes 1.24.
EXEC_API_VERSIONS = frozenset(
    {"client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"}
)
EXEC_TIMEOUT_S = 60.0
_STDERR_TAIL = 800

# Keys whose meaning we cannot carry into KubeCredentials; ignoring them would connect with
# other rights (impersonation), through another route (proxy) or to another identity (SNI).
_REFUSED_CLUSTER_KEYS = {
    "proxy-url": "connecting through a proxy",
    "tls-server-name": "a TLS server name other than the server's host",
}
_REFUSED_USER_KEYS = {
    "username": "basic authentication (kube-apiserver dropped it in 1.19)",
    "password": "basic authentication (kube-apiserver dropped it in 1.19)",
    "auth-provider": "auth-provider plugins (gcp and azure were removed in 1.26; use an exec "
    "plugin such as gke-gcloud-auth-plugin or kubelogin)",
    "as": "impersonation",
    "as-uid": "impersonation",
    "as-groups": "impersonation",
    "as-user-extra": "impersonation",
}


class KubeconfigError(ValueError):
    """Credentials cannot be loaded; the message names the file and the entry at fault."""


@dataclass(frozen=True)
class KubeCredentials:
    """`token` is the value read at load time; with `token_file` set, `BearerToken` re-reads it."""

    server: str
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True
    token_file: str | None = None


class BearerToken:
    """The token to send now, re-read from its file every `refresh_s` seconds.

    Why: the kubelet rotates a pod's projected service-account token (about hourly), and an API
    server that does not extend token lifetimes refuses the old one once it expires, so an
    operator that read its token once would lose the cluster after an hour. client-go re-reads
    the file every minute; so does this. A failed read keeps the last good token (a rotation
    writes the file atomically, so a failure is a real fault, worth a warning, not an outage).
    """

    def __init__(
        self,
        credentials: KubeCredentials,
        refresh_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._file = credentials.token_file
        self._value = credentials.token
        self._refresh_s = refresh_s
        self._clock = clock
        self._read_at = clock()

    def current(self) -> str | None:
        if self._file is None:
            return self._value
        now = self._clock()
        if now - self._read_at >= self._refresh_s:
            self._read_at = now
            try:
                text = Path(self._file).read_text().strip()
            except OSError as exc:
                logger.warning("cannot re-read the token file %s: %s", self._file, exc)
                text = ""
            if text:
                self._value = text
        return self._value


def load_credentials(
    kubeconfig: str | None = None,
    *,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    exec_timeout_s: float = EXEC_TIMEOUT_S,
) -> KubeCredentials:
    """In-cluster service-account credentials, else the kubeconfig (explicit path or default).

    An explicit path wins over the pod's service account so that `--kubeconfig` can point a pod
    elsewhere; without one, a pod uses its own identity even if ``$KUBECONFIG`` is set.
    """
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return load_incluster(service_account_dir)
    return load_kubeconfig(kubeconfig_paths(kubeconfig), exec_timeout_s=exec_timeout_s)


def load_incluster(service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeCredentials:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise KubeconfigError(
            "in-cluster config: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must both "
            "be set"
        )
    # IPv6 literals need brackets in a URL (as Go's net.JoinHostPort writes them).
    hostport = f"[{host}]:{port}" if ":" in host or "%" in host else f"{host}:{port}"
    token_file = service_account_dir / "token"
    ca_file = service_account_dir / "ca.crt"
    for path in (token_file, ca_file):
        if not path.is_file():
            raise KubeconfigError(f"in-cluster config: {path} does not exist")
    try:
        token = token_file.read_text().strip()
        ca = ca_file.read_bytes().strip()
    except OSError as exc:
        raise KubeconfigError(f"in-cluster config: {exc}") from exc
    if not token:
        raise KubeconfigError(f"in-cluster config: {token_file} is empty")
    if not ca:
        raise KubeconfigError(f"in-cluster config: {ca_file} is empty")
    return KubeCredentials(
        server=f"https://{hostport}", token=token, ca_file=str(ca_file), token_file=str(token_file)
    )


def kubeconfig_paths(explicit: str | None = None) -> list[Path]:
    """The files to merge: the explicit one, else those of ``$KUBECONFIG``, else the default.

    Missing files in ``$KUBECONFIG`` are skipped, as kubectl skips them; an explicit path or
    the default that does not exist is an error.
    """
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise KubeconfigError(f"kubeconfig {path} does not exist")
        return [path]
    listed = os.environ.get("KUBECONFIG", "")
    if listed:
        paths: list[Path] = []
        for item in listed.split(os.pathsep):
            path = Path(item).expanduser()
            if item and path.is_file() and path not in paths:
                paths.append(path)
        if not paths:
            raise KubeconfigError(f"none of the files in KUBECONFIG exist: {listed}")
        return paths
    path = Path(DEFAULT_KUBECONFIG).expanduser()
    if not path.is_file():
        raise KubeconfigError(
            f"not in a cluster (KUBERNETES_SERVICE_HOST is unset) and no kubeconfig at {path}; "
            "pass --kubeconfig or set KUBECONFIG"
        )
    return [path]


@dataclass(frozen=True)
class _Entry:
    body: dict[str, Any]
    source: Path  # relative paths in body resolve against this file's directory


@dataclass
class _Merged:
    files: list[Path]
    current_context: str | None = None
    clusters: dict[str, _Entry] = field(default_factory=dict)
    users: dict[str, _Entry] = field(default_factory=dict)
    contexts: dict[str, _Entry] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return "kubeconfig " + ", ".join(str(p) for p in self.files)


def load_kubeconfig(
    paths: Sequence[Path], *, exec_timeout_s: float = EXEC_TIMEOUT_S
) -> KubeCredentials:
    merged = _merge(paths)
    if not merged.current_context:
        raise KubeconfigError(f"{merged.where}: current-context is not set")
    context = merged.contexts.get(merged.current_context)
    if context is None:
        raise KubeconfigError(
            f"{merged.where}: context {merged.current_context!r} (the current-context) "
            "is not defined"
        )
    ctx_name = merged.current_context
    cluster_name = context.body.get("cluster")
    if not isinstance(cluster_name, str) or not cluster_name:
        raise KubeconfigError(f"{context.source}: context {ctx_name!r} names no cluster")
    cluster = merged.clusters.get(cluster_name)
    if cluster is None:
        raise KubeconfigError(
            f"{merged.where}: cluster {cluster_name!r} (of context {ctx_name!r}) is not defined"
        )
    user_name = context.body.get("user")
    user: _Entry | None = None
    if user_name:
        if not isinstance(user_name, str):
            raise KubeconfigError(f"{context.source}: context {ctx_name!r} has a non-string user")
        user = merged.users.get(user_name)
        if user is None:
            raise KubeconfigError(
                f"{merged.where}: user {user_name!r} (of context {ctx_name!r}) is not defined"
            )
    return _credentials(cluster_name, cluster, user_name or "", user, exec_timeout_s)


def _merge(paths: Sequence[Path]) -> _Merged:
    merged = _Merged(files=list(paths))
    for path in paths:
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise KubeconfigError(f"kubeconfig {path}: cannot read: {exc}") from exc
        if doc is None:
            continue  # kubectl treats an empty file as an empty config
        if not isinstance(doc, dict):
            raise KubeconfigError(f"kubeconfig {path}: not a mapping")
        current = doc.get("current-context")
        if current and merged.current_context is None:
            merged.current_context = str(current)
        for section, key, into in (
            ("clusters", "cluster", merged.clusters),
            ("users", "user", merged.users),
            ("contexts", "context", merged.contexts),
        ):
            items = doc.get(section) or []
            if not isinstance(items, list):
                raise KubeconfigError(f"kubeconfig {path}: {section} is not a list")
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    raise KubeconfigError(f"kubeconfig {path}: an entry of {section} has no name")
                body = item.get(key) or {}
                if not isinstance(body, dict):
                    raise KubeconfigError(
                        f"kubeconfig {path}: {key} {item['name']!r} is not a mapping"
                    )
                into.setdefault(item["name"], _Entry(body, path))
    return merged


def _credentials(
    cluster_name: str,
    cluster: _Entry,
    user_name: str,
    user: _Entry | None,
    exec_timeout_s: float,
) -> KubeCredentials:
    where_cluster = f"{cluster.source}: cluster {cluster_name!r}"
    where_user = f"{user.source if user else cluster.source}: user {user_name!r}"
    server = cluster.body.get("server")
    if not isinstance(server, str) or not server:
        raise KubeconfigError(f"{where_cluster} has no server")
    if not server.startswith(("https://", "http://")):
        raise KubeconfigError(f"{where_cluster}: server {server!r} is not an http(s) URL")
    for key, what in _REFUSED_CLUSTER_KEYS.items():
        if cluster.body.get(key):
            raise KubeconfigError(f"{where_cluster} sets {key}: {what} is not supported")
    user_body = user.body if user else {}
    for key, what in _REFUSED_USER_KEYS.items():
        if user_body.get(key):
            raise KubeconfigError(f"{where_user} sets {key}: {what} is not supported")
    insecure = cluster.body.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise KubeconfigError(f"{where_cluster}: insecure-skip-tls-verify is not a boolean")

    # The same precedence as kubernetes.config: a token (inline before file), else exec.
    token: str | None = None
    token_file: str | None = None
    exec_cert: tuple[str, str] | None = None
    if user is not None:
        token = _token(user, where_user)
        if token is not None and not user.body.get("token"):
            token_file = str(_resolve(user, str(user.body["tokenFile"])))  # re-read later
        if token is None and user.body.get("exec"):
            token, exec_cert = _run_exec(user, where_user, cluster.body, exec_timeout_s)

    ca_file = cert_file = key_file = None
    if server.startswith("https://"):  # TLS material means nothing to a plain-http server
        ca_file = _file_or_data(cluster, "certificate-authority", where_cluster)
        if exec_cert is not None:
            cert_file, key_file = exec_cert
        elif user is not None:
            cert_file = _file_or_data(user, "client-certificate", where_user)
            key_file = _file_or_data(user, "client-key", where_user)
            if (cert_file is None) != (key_file is None):
                raise KubeconfigError(
                    f"{where_user}: client-certificate and client-key must be given together"
                )
    return KubeCredentials(
        server=server.rstrip("/"),
        token=token,
        ca_file=ca_file,
        cert_file=cert_file,
        key_file=key_file,
        verify=not insecure,
        token_file=token_file,
    )


def _token(user: _Entry, where: str) -> str | None:
    token = user.body.get("token")
    if token:
        return str(token)
    token_file = user.body.get("tokenFile")
    if not token_file:
        return None
    path = _resolve(user, str(token_file))
    try:
        # Files end with a newline more often than not; no header may carry one.
        text = path.read_text().strip()
    except OSError as exc:
        raise KubeconfigError(f"{where}: cannot read tokenFile {path}: {exc}") from exc
    if not text:
        raise KubeconfigError(f"{where}: tokenFile {path} is empty")
    return text


def _resolve(entry: _Entry, name: str) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() else entry.source.parent / path


def _file_or_data(entry: _Entry, key: str, where: str) -> str | None:
    """The path of a PEM file: ``key-data`` (base64, wins as in kubectl) written out, or ``key``."""
    data = entry.body.get(f"{key}-data")
    if data:
        try:
            pem = base64.b64decode(str(data), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise KubeconfigError(f"{where}: {key}-data is not valid base64") from exc
        return _private_file(pem, key)
    name = entry.body.get(key)
    if not name:
        return None
    path = _resolve(entry, str(name))
    if not path.is_file():
        raise KubeconfigError(f"{where}: {key} {path} does not exist")
    return str(path)


_private_dir: Path | None = None


def _private_file(content: bytes, stem: str) -> str:
    """A 0600 file in a 0700 directory of our own, removed when the process exits."""
    global _private_dir
    if _private_dir is None:
        _private_dir = Path(tempfile.mkdtemp(prefix="vllm-autotuner-credentials-"))
        atexit.register(shutil.rmtree, _private_dir, True)
    fd, name = tempfile.mkstemp(dir=_private_dir, prefix=f"{stem}-", suffix=".pem")
    with os.fdopen(fd, "wb") as handle:
        handle.write(content)
    return name


def _run_exec(
    user: _Entry, where: str, cluster: Mapping[str, Any], timeout_s: float
) -> tuple[str | None, tuple[str, str] | None]:
    """Runs a client-go credential plugin once: (token, None) or (None, (cert file, key file)).

    Nothing refreshes the credential later (KubeClient sets its headers once); an expiring one
    is logged, since the operator will start getting 401s when it lapses.
    """
    spec = user.body["exec"]
    if not isinstance(spec, dict):
        raise KubeconfigError(f"{where}: exec is not a mapping")
    api_version = spec.get("apiVersion")
    if api_version not in EXEC_API_VERSIONS:
        raise KubeconfigError(
            f"{where}: exec apiVersion {api_version!r} is not one of {sorted(EXEC_API_VERSIONS)}"
        )
    command = spec.get("command")
    if not isinstance(command, str) or not command:
        raise KubeconfigError(f"{where}: exec has no command")
    if spec.get("interactiveMode") == "Always":
        raise KubeconfigError(
            f"{where}: exec interactiveMode Always needs a terminal; the operator has none"
        )
    # kubectl resolves a command with a directory part against the kubeconfig's directory and
    # looks a bare name up on PATH.
    if os.sep in command:
        command = str(_resolve(user, command))
    args = spec.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise KubeconfigError(f"{where}: exec args must be a list of strings")
    env = dict(os.environ)
    for item in spec.get("env") or []:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise KubeconfigError(f"{where}: exec env entries need a name and a value")
        env[item["name"]] = str(item.get("value", ""))
    exec_spec: dict[str, Any] = {"interactive": False}
    if spec.get("provideClusterInfo"):
        exec_spec["cluster"] = _exec_cluster_info(cluster)
    env["KUBERNETES_EXEC_INFO"] = json.dumps(
        {"apiVersion": api_version, "kind": "ExecCredential", "spec": exec_spec}
    )
    hint = f" ({spec['installHint']})" if spec.get("installHint") else ""
    try:
        done = subprocess.run(
            [command, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError as exc:
        raise KubeconfigError(f"{where}: exec command {command!r} not found{hint}") from exc
    except subprocess.TimeoutExpired as exc:
        raise KubeconfigError(
            f"{where}: exec command {command!r} did not finish within {timeout_s:g} s"
        ) from exc
    except OSError as exc:
        raise KubeconfigError(f"{where}: exec command {command!r} failed: {exc}") from exc
    stderr_tail = done.stderr.strip()[-_STDERR_TAIL:]
    if done.returncode != 0:
        raise KubeconfigError(
            f"{where}: exec command {command!r} exited with {done.returncode}: {stderr_tail}"
        )
    try:
        response = json.loads(done.stdout)
    except ValueError as exc:
        raise KubeconfigError(
            f"{where}: exec command {command!r} printed no ExecCredential JSON ({exc}); "
            f"stderr: {stderr_tail}"
        ) from exc
    if not isinstance(response, dict) or response.get("kind") != "ExecCredential":
        raise KubeconfigError(f"{where}: exec command {command!r} printed no ExecCredential")
    if response.get("apiVersion") != api_version:
        raise KubeconfigError(
            f"{where}: exec plugin answered {response.get('apiVersion')!r}, "
            f"asked for {api_version!r}"
        )
    status = response.get("status")
    if not isinstance(status, dict):
        raise KubeconfigError(f"{where}: exec plugin's ExecCredential has no status")
    if status.get("expirationTimestamp"):
        logger.warning(
            "%s: the exec credential expires at %s and is not refreshed; restart the operator "
            "before then",
            where,
            status["expirationTimestamp"],
        )
    if status.get("token"):
        return str(status["token"]), None
    cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
    if cert and key:
        return None, (
            _private_file(str(cert).encode(), "exec-client-certificate"),
            _private_file(str(key).encode(), "exec-client-key"),
        )
    raise KubeconfigError(
        f"{where}: exec plugin's status has neither token nor clientCertificateData and "
        "clientKeyData"
    )


def _exec_cluster_info(cluster: Mapping[str, Any]) -> dict[str, Any]:
    """The spec.cluster that client-go passes to plugins that ask for it (provideClusterInfo)."""
    info: dict[str, Any] = {"server": cluster.get("server")}
    if cluster.get("certificate-authority-data"):
        info["certificate-authority-data"] = cluster["certificate-authority-data"]
    if cluster.get("insecure-skip-tls-verify"):
        info["insecure-skip-tls-verify"] = True
    for extension in cluster.get("extensions") or []:
        if isinstance(extension, dict) and extension.get("name") == (
            "client.authentication.k8s.io/exec"
        ):
            info["config"] = extension.get("extension")
    return info
