"""The operator's Kubernetes connection: the `kubernetes` package's configuration and client.

Credentials (`load_credentials`) come from `kubernetes.config`, as kubectl finds them: the
pod's service account (its token re-read every minute, as the kubelet rotates it), else the
kubeconfig files of ``--kubeconfig`` or ``$KUBECONFIG`` merged, with tokens, client
certificates, CA bundles and exec plugins (an exec credential with an expiry is fetched again
before it lapses, so EKS-style 15-minute tokens keep working). What is ours, and small:

- a kubeconfig ``tokenFile`` is re-read every minute like the service account's token (the
  library reads it once);
- a failed refresh keeps the last good token and logs a warning, instead of failing every call;
- what kopf's own connection (`kopf.ConnectionInfo`) cannot carry is refused with the file and
  the entry at fault (impersonation, a TLS server name), and so is an exec plugin that gave no
  credential (the library logs its error and would go on anonymously).

Calls (`KubeClient`): the library's `ApiClient` is synchronous, so every call runs in a thread
pool of our own with at most `concurrency` threads: kopf's event loop never waits on the
network, and a slow API server queues calls instead of starting threads without bound. They go
through `ApiClient.param_serialize` and `call_api`, the layer the generated API classes are
built on, with JSON in and out: the operator writes plain manifests by server-side apply under
its field manager and merge-patches the status of its own kinds; the generated model classes
would validate and convert what is then converted back to dicts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.incluster_config import InClusterConfigLoader
from kubernetes.config.kube_config import (
    ENV_KUBECONFIG_PATH_SEPARATOR,
    KubeConfigLoader,
    KubeConfigMerger,
)

from vllm_autotuner import FIELD_MANAGER, __version__

log = logging.getLogger(__name__)

USER_AGENT = f"{FIELD_MANAGER}/{__version__}"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = "~/.kube/config"
TOKEN_FILE_REFRESH_S = 60.0  # client-go re-reads a token file every minute

# Kubeconfig keys kopf's connection cannot carry: honouring them in our client alone would
# have kopf watch with other rights (impersonation) or fail TLS (SNI) while our calls work.
_REFUSED_USER_KEYS = ("as", "as-uid", "as-groups", "as-user-extra")
_REFUSED_CLUSTER_KEYS = ("tls-server-name",)


class KubeconfigError(ValueError):
    """Credentials cannot be loaded; the message names the file and the entry at fault."""


class KubeError(RuntimeError):
    """The API server refused a call (status >= 400) or could not be reached (status 0)."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.body = body


class Conflict(KubeError):
    pass


class NotFound(KubeError):
    pass


@dataclass(frozen=True)
class KubeCredentials:
    """A library `Configuration` (server, TLS, token and its refresh hook) and whether the
    token can change while the operator runs (then kopf must log in again now and then)."""

    configuration: Configuration
    rotating: bool = False
    namespace: str = "default"  # the kubeconfig context's, or the pod's own

    @classmethod
    def for_server(
        cls,
        server: str,
        *,
        token: str | None = None,
        verify: bool = True,
        ca_file: str | None = None,
    ) -> KubeCredentials:
        """A fixed server and token: the local cluster, tests and benchmarks (`ca_file`: the
        CA that signed the server's certificate)."""
        configuration = Configuration(host=server.rstrip("/"))
        configuration.verify_ssl = verify
        if ca_file is not None:
            configuration.ssl_ca_cert = ca_file
        if token:
            configuration.api_key["BearerToken"] = f"Bearer {token}"
        return cls(configuration)

    @property
    def server(self) -> str:
        return str(self.configuration.host)

    def authorization(self) -> tuple[str | None, str | None]:
        """(scheme, token) to send now; runs the refresh hook (token file, exec plugin)."""
        header = self.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        if not header:
            return None, None
        scheme, _, token = str(header).partition(" ")
        return (scheme, token) if token else (None, scheme)


def load_credentials(
    kubeconfig: str | None = None, *, service_account_dir: Path = SERVICE_ACCOUNT_DIR
) -> KubeCredentials:
    """In-cluster service-account credentials, else the kubeconfig (explicit path or default).

    An explicit path wins over the pod's service account so that `--kubeconfig` can point a pod
    elsewhere; without one, a pod uses its own identity even if ``$KUBECONFIG`` is set.
    """
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return load_incluster(service_account_dir)
    return load_kubeconfig(kubeconfig_paths(kubeconfig))


def load_incluster(service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeCredentials:
    configuration = Configuration()
    loader = InClusterConfigLoader(
        token_filename=str(service_account_dir / "token"),
        cert_filename=str(service_account_dir / "ca.crt"),
        try_refresh_token=True,
    )
    try:
        loader.load_and_set(configuration)
    except (ConfigException, OSError) as exc:
        raise KubeconfigError(f"in-cluster config ({service_account_dir}): {exc}") from exc
    _guard_refresh(configuration)
    try:
        namespace = (service_account_dir / "namespace").read_text().strip() or "default"
    except OSError:
        namespace = "default"
    return KubeCredentials(configuration, rotating=True, namespace=namespace)


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
        paths = [Path(p).expanduser() for p in listed.split(ENV_KUBECONFIG_PATH_SEPARATOR) if p]
        existing = [p for p in dict.fromkeys(paths) if p.is_file()]
        if not existing:
            raise KubeconfigError(f"none of the files in KUBECONFIG exist: {listed}")
        return existing
    path = Path(DEFAULT_KUBECONFIG).expanduser()
    if not path.is_file():
        raise KubeconfigError(
            f"not in a cluster (KUBERNETES_SERVICE_HOST is unset) and no kubeconfig at {path}; "
            "pass --kubeconfig or set KUBECONFIG"
        )
    return [path]


def load_kubeconfig(
    paths: list[Path], *, clock: Callable[[], float] = time.monotonic
) -> KubeCredentials:
    where = "kubeconfig " + ", ".join(str(p) for p in paths)
    configuration = Configuration()
    try:
        merger = KubeConfigMerger(ENV_KUBECONFIG_PATH_SEPARATOR.join(str(p) for p in paths))
        if merger.config is None:
            raise ConfigException("no configuration found")
        loader = KubeConfigLoader(config_dict=merger.config, config_base_path=None)
        user, user_file, cluster = _current_entries(merger, loader)
        _refuse(where, user, cluster)
        loader.load_and_set(configuration)
    except (ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
        raise KubeconfigError(f"{where}: {exc}") from exc
    user_name = loader.current_context["context"].get("user")
    has_token = bool(configuration.api_key.get("BearerToken"))
    if "exec" in user and not has_token and not configuration.cert_file:
        raise KubeconfigError(
            f"{where}: the exec plugin of user {user_name!r} gave no credential "
            "(its error is logged above)"
        )
    token_file = user.get("tokenFile")
    if token_file and not user.get("token") and has_token:
        base = user_file.parent if user_file else Path.cwd()
        _reread_token_file(configuration, base / Path(str(token_file)).expanduser(), clock)
    _guard_refresh(configuration)
    rotating = bool(token_file and not user.get("token")) or "exec" in user
    namespace = str(loader.current_context["context"].get("namespace") or "default")
    return KubeCredentials(configuration, rotating=rotating, namespace=namespace)


def _current_entries(
    merger: KubeConfigMerger, loader: KubeConfigLoader
) -> tuple[dict[str, Any], Path | None, dict[str, Any]]:
    """The user entry, the file it came from, and the cluster entry of the current context."""
    context = loader.current_context["context"]
    config = merger.config
    user_name = context.get("user")
    user = config["users"].get_with_name(user_name, safe=True) if user_name else None
    cluster = config["clusters"].get_with_name(context["cluster"])["cluster"]
    if user is None:
        return {}, None, dict(cluster.value)
    return dict(user["user"].value), Path(user.path), dict(cluster.value)


def _refuse(where: str, user: Any, cluster: Any) -> None:
    for key in _REFUSED_USER_KEYS:
        if key in user:
            raise KubeconfigError(
                f"{where}: the user sets {key}: impersonation is not supported (kopf's "
                "connection cannot impersonate)"
            )
    for key in _REFUSED_CLUSTER_KEYS:
        if key in cluster:
            raise KubeconfigError(
                f"{where}: the cluster sets {key}: a TLS server name other than the server's "
                "host is not supported (kopf's connection cannot set one)"
            )


def _reread_token_file(
    configuration: Configuration, path: Path, clock: Callable[[], float]
) -> None:
    """Re-read a kubeconfig tokenFile every TOKEN_FILE_REFRESH_S seconds (the library reads
    it once), after the library's own hook, which would put the first token back."""
    inner = configuration.refresh_api_key_hook
    token: str = configuration.api_key["BearerToken"]
    read_at = clock()

    def hook(config: Configuration) -> None:
        nonlocal token, read_at
        if inner is not None:
            inner(config)  # the library's hook re-installs itself: put ours back
            _install(config, hook)
        now = clock()
        if now - read_at >= TOKEN_FILE_REFRESH_S:
            read_at = now
            text = path.read_text().strip()  # errors: _guard_refresh keeps the last token
            if text:
                token = f"Bearer {text}"
        config.api_key["BearerToken"] = token

    _install(configuration, hook)


def _guard_refresh(configuration: Configuration) -> None:
    """One refresh at a time (calls run in several threads), and a failed one keeps the last
    good token: a rotation writes the file atomically, so a failed read is a fault worth a
    warning, not an outage. The token loses a trailing newline (the library keeps a token
    file's, which no header may carry)."""
    inner = configuration.refresh_api_key_hook
    if inner is None:
        return
    lock = threading.Lock()

    def hook(config: Configuration) -> None:
        with lock:
            before = config.api_key.get("BearerToken")
            try:
                inner(config)
            except Exception as exc:  # OSError, ConfigException: the library's own
                log.warning("cannot refresh the Kubernetes credential, keeping the last: %s", exc)
                if before:
                    config.api_key["BearerToken"] = before
            _install(config, hook)  # the library's hook re-installs itself
            token = config.api_key.get("BearerToken")
            if token:
                config.api_key["BearerToken"] = token.strip()

    _install(configuration, hook)


def _install(configuration: Configuration, hook: Callable[[Configuration], None]) -> None:
    """Called before every request's credentials are read (the library types it as None)."""
    configuration.refresh_api_key_hook = hook  # type: ignore[assignment]


def resource_path(
    api_version: str, plural: str, namespace: str | None = None, name: str | None = None
) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = base
    if namespace is not None:
        path += f"/namespaces/{quote(namespace, safe='')}"
    path += f"/{plural}"
    if name is not None:
        path += f"/{quote(name, safe='')}"
    return path


_PLURALS = {"Deployment": "deployments", "Service": "services", "Pod": "pods", "Event": "events"}


def object_path(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return resource_path(
        obj["apiVersion"], _PLURALS[obj["kind"]], meta.get("namespace"), meta["name"]
    )


class KubeClient:
    """One library ApiClient per concern, its calls in at most `concurrency` threads."""

    def __init__(
        self, credentials: KubeCredentials, timeout_s: float = 30.0, concurrency: int = 8
    ) -> None:
        self.credentials = credentials
        self.timeout_s = timeout_s
        self.api = ApiClient(credentials.configuration)
        self.api.user_agent = USER_AGENT
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kube")

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.api.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, self._call, method, path, params, body, content_type
        )

    def _call(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None,
        body: Any,
        content_type: str,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            method, url, headers, body, _ = self.api.param_serialize(
                method=method,
                resource_path=path,
                query_params=list((params or {}).items()),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self.api.call_api(
                method, url, header_params=headers, body=body, _request_timeout=self.timeout_s
            )
            data = response.read()
        except urllib3.exceptions.HTTPError as exc:
            raise KubeError(0, f"cannot reach the API server: {exc}") from exc
        except ApiException as exc:  # the library's TLS errors, before any status
            raise KubeError(exc.status or 0, str(exc.reason)) from exc
        payload = _json(data)
        if response.status >= 400:
            raise _error(response.status, payload, data)
        return payload

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            result = await self.request("GET", path)
        except NotFound:
            return None
        return dict(result)

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self.request("GET", path, params=params)
        return [dict(item) for item in (result or {}).get("items", [])]

    async def apply(
        self, obj: dict[str, Any], *, force: bool = True, field_manager: str = FIELD_MANAGER
    ) -> dict[str, Any]:
        """Server-side apply under our field manager (controllers force, per the SSA docs).
        Another manager's name hands a field over (core/autoscaling.py), never forced."""
        params = {"fieldManager": field_manager}
        if force:
            params["force"] = "true"
        result = await self.request(
            "PATCH",
            object_path(obj),
            params=params,
            body=obj,
            content_type="application/apply-patch+yaml",
        )
        return dict(result)

    async def delete(self, path: str) -> bool:
        """Delete an object, letting the garbage collector take what it owns (False: gone)."""
        try:
            await self.request("DELETE", path, body={"propagationPolicy": "Background"})
        except NotFound:
            return False
        return True

    async def merge_patch(
        self, path: str, body: dict[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        full = path if subresource is None else f"{path}/{subresource}"
        result = await self.request(
            "PATCH",
            full,
            params={"fieldManager": FIELD_MANAGER},
            body=body,
            content_type="application/merge-patch+json",
        )
        return dict(result)


def _json(data: bytes | None) -> Any:
    if not data:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return data.decode(errors="replace")


def _error(status: int, payload: Any, data: bytes | None) -> KubeError:
    text = (data or b"").decode(errors="replace")
    message = payload.get("message", text) if isinstance(payload, dict) else text
    kind = {404: NotFound, 409: Conflict}.get(status, KubeError)
    return kind(status, str(message), payload)
