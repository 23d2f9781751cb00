"""A small asynchronous Kubernetes REST client that speaks plain dicts.

Why not the generated `kubernetes` client: version 37 validates bodies client-side with
pydantic, maps responses by exact status code and returns typed models; the operator needs
raw manifests, server-side apply with a fixed field manager, and one code path that behaves
the same against kube-apiserver and the local emulator. Credentials (in-cluster or kubeconfig)
come from our own loader, `adapters.kubeconfig` (importing the `kubernetes` package for its
loaders alone would cost the operator about 11 MiB resident); a token from a file (the pod's
service account) is re-read every minute, as the kubelet rotates it.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp

from vllm_autotuner import FIELD_MANAGER, __version__
from vllm_autotuner.adapters.kubeconfig import BearerToken
from vllm_autotuner.adapters.kubeconfig import KubeconfigError as KubeconfigError
from vllm_autotuner.adapters.kubeconfig import KubeCredentials as KubeCredentials
from vllm_autotuner.adapters.kubeconfig import load_credentials as load_credentials

USER_AGENT = f"{FIELD_MANAGER}/{__version__}"


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.body = body


class Conflict(KubeError):
    pass


class NotFound(KubeError):
    pass


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
    """One aiohttp session per operator process; every call has a timeout."""

    def __init__(self, credentials: KubeCredentials, timeout_s: float = 30.0) -> None:
        self.credentials = credentials
        self.bearer = BearerToken(credentials)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()

    async def _get_session(self) -> aiohttp.ClientSession:
        async with self._lock:
            if self._session is None or self._session.closed:
                ssl_ctx: ssl.SSLContext | bool = False
                if self.credentials.server.startswith("https"):
                    if self.credentials.verify:
                        ssl_ctx = ssl.create_default_context(cafile=self.credentials.ca_file)
                    else:
                        ssl_ctx = ssl.create_default_context()
                        ssl_ctx.check_hostname = False
                        ssl_ctx.verify_mode = ssl.CERT_NONE
                    if self.credentials.cert_file and self.credentials.key_file:
                        ssl_ctx.load_cert_chain(
                            self.credentials.cert_file, self.credentials.key_file
                        )
                headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
                self._session = aiohttp.ClientSession(
                    headers=headers,
                    timeout=self.timeout,
                    connector=aiohttp.TCPConnector(ssl=ssl_ctx, limit=32),
                )
            return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        session = await self._get_session()
        url = self.credentials.server + path
        if params:
            url += "?" + urlencode(params)
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        token = self.bearer.current()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        async with session.request(method, url, data=data, headers=headers) as response:
            text = await response.text()
            payload: Any = None
            if text:
                try:
                    payload = json.loads(text)
                except ValueError:
                    payload = text
            if response.status >= 400:
                message = payload.get("message", text) if isinstance(payload, dict) else text
                if response.status == 404:
                    raise NotFound(404, str(message), payload)
                if response.status == 409:
                    raise Conflict(409, str(message), payload)
                raise KubeError(response.status, str(message), payload)
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

    async def apply(self, obj: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        """Server-side apply under our field manager (controllers force, per the SSA docs)."""
        params = {"fieldManager": FIELD_MANAGER}
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
