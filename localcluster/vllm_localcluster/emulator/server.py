"""Serving the emulator on a TCP port: in a background thread, in the current loop, or standalone.

kmock's own `Server` also patches aiohttp's DNS resolution process-wide while it runs; the
operator and the simulator's load generator use aiohttp in the same process, and several
emulators may run at once in tests, so the emulator is served by a plain aiohttp server and
nothing global is patched.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp.web
import yaml

from vllm_localcluster.emulator.handler import KubernetesAPIEmulator


class EmulatorServer:
    """An emulated Kubernetes API listening on host:port (127.0.0.1 only by default)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        emulator: KubernetesAPIEmulator | None = None,
        crds: str | Path | None = None,
        **emulator_options: Any,
    ) -> None:
        self.host = host
        self.port = port
        self.emulator = emulator or KubernetesAPIEmulator(**emulator_options)
        if crds is not None:
            self.emulator.register_crds_from(crds)
        self._runner: aiohttp.web.ServerRunner | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        if self._runner is None:
            raise RuntimeError("the emulator is not running")
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------- in the current event loop

    async def start(self) -> Self:
        await self.emulator.__aenter__()
        server = aiohttp.web.Server(self.emulator)
        runner = aiohttp.web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, self.host, self.port)
        await site.start()
        address = runner.addresses[0]
        self.port = int(address[1])
        self._runner = runner
        return self

    async def aclose(self) -> None:
        self.emulator.store.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.emulator.__aexit__(None, None, None)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------- in a background thread

    def start_in_thread(self, timeout: float = 10.0) -> Self:
        """Serve from a daemon thread with its own loop (for sync tests and the demo)."""
        self._thread = threading.Thread(target=self._thread_main, name="k8s-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the emulator did not start in time")
        if self._error is not None:
            raise RuntimeError("the emulator failed to start") from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _thread_main(self) -> None:
        asyncio.run(self._serve_until_stopped())

    async def _serve_until_stopped(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        try:
            await self.start()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._stopping.wait()
        finally:
            await self.aclose()

    def __enter__(self) -> Self:
        return self.start_in_thread()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------- clients

    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
                }
            ],
            "current-context": "emulator",
            "preferences": {},
        }

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(yaml.safe_dump(self.kubeconfig(namespace), sort_keys=False))
        return target
