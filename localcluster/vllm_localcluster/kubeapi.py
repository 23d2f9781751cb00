"""The one-machine cluster's own small async client for the API server: its node agent and
Service proxy need a handful of calls (list, get, merge patch, create, delete), with the token
and CA of the control plane it started. Kept apart from the operator's adapters, which the
cluster must never shape (the operator is what it tests)."""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp

USER_AGENT = "vllm-localcluster/node-agent"


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


@dataclass(frozen=True)
class Endpoint:
    """Where the API server is and who we are: a URL, a bearer token, the CA to trust."""

    server: str
    token: str
    ca_file: str


class AsyncApi:
    """One aiohttp session; every call has a timeout; errors carry the HTTP status."""

    def __init__(self, endpoint: Endpoint, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            context = ssl.create_default_context(cafile=self.endpoint.ca_file)
            self._session = aiohttp.ClientSession(
                headers={
                    "User-Agent": USER_AGENT,
                    "Accept": "application/json",
                    "Authorization": f"Bearer {self.endpoint.token}",
                },
                timeout=self.timeout,
                connector=aiohttp.TCPConnector(ssl=context, limit=16),
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
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        url = self.endpoint.server + path + ("?" + urlencode(params) if params else "")
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self._get_session().request(method, url, data=data, headers=headers) as resp:
            text = await resp.text()
            payload: Any = json.loads(text) if text else None
            if resp.status >= 400:
                message = payload.get("message", text) if isinstance(payload, dict) else text
                raise ApiError(resp.status, str(message))
            return payload

    async def list(self, path: str, **params: str) -> list[dict[str, Any]]:
        result = await self.request("GET", path, params=params or None)
        return [dict(item) for item in (result or {}).get("items", [])]

    async def merge_patch(self, path: str, body: dict[str, Any]) -> Any:
        return await self.request("PATCH", path, body, content_type="application/merge-patch+json")
