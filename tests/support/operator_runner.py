"""Run the real operator (kopf + our registry) in a background thread for integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from vllm_autotuner.adapters.kube import KubeCredentials
from vllm_autotuner.observer import SnapshotSource
from vllm_autotuner.operator import OperatorConfig, run_operator


class OperatorThread:
    def __init__(
        self,
        config: OperatorConfig,
        namespaces: list[str] | None = None,
        snapshot_source: SnapshotSource | None = None,
    ) -> None:
        self.config = config
        self.snapshot_source = snapshot_source
        self.namespaces = namespaces
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="operator", daemon=True)

    def _main(self) -> None:
        async def body() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._started.set()
            await run_operator(
                self.config,
                namespaces=self.namespaces,
                stop_flag=self._stop,
                snapshot_source=self.snapshot_source,
            )

        try:
            asyncio.run(body())
        except BaseException as exc:  # surfaced to the test by stop()
            self.error = exc
            self._started.set()

    def start(self) -> OperatorThread:
        self._thread.start()
        if not self._started.wait(10):
            raise TimeoutError("operator thread did not start")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop may have ended already
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("operator did not stop within the timeout")
        if self.error is not None:
            raise self.error


@contextmanager
def running_operator(
    credentials: KubeCredentials | str,
    *,
    interval_s: float = 1.0,
    namespaces: list[str] | None = None,
    snapshot_source: SnapshotSource | None = None,
) -> Iterator[OperatorThread]:
    if isinstance(credentials, str):  # the API emulator (plain HTTP, no auth)
        credentials = KubeCredentials.for_server(credentials, verify=False)
    config = OperatorConfig(credentials=credentials, reconcile_interval_s=interval_s)
    thread = OperatorThread(config, namespaces, snapshot_source).start()
    try:
        yield thread
    finally:
        thread.stop()
