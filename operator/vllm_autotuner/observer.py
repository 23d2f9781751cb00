"""Batch the Prometheus reads of every VLLMDeployment into one cycle.

Each reconcile says what it wants observed next (its pods, window and SLO) and reads the latest
snapshot taken for it. One background loop queries Prometheus for all deployments at once, so
the number of queries per cycle does not grow with the number of deployments, and a slow or
dead Prometheus delays no reconcile: it only makes snapshots unavailable, with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Protocol

from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.core.snapshot import Snapshot

log = logging.getLogger(__name__)

Key = tuple[str, str]


class SnapshotSource(Protocol):
    """What the observer needs from the Prometheus adapter (PrometheusSource satisfies it)."""

    async def snapshots(
        self, targets: Sequence[SnapshotTarget], now: datetime
    ) -> dict[Key, Snapshot]: ...


class Observer:
    def __init__(
        self,
        source: SnapshotSource | None,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(tz=UTC),
        max_age_s: float = 300.0,
    ) -> None:
        self.source = source
        self.clock = clock
        self.max_age_s = max_age_s
        self._targets: dict[Key, SnapshotTarget] = {}
        self._latest: dict[Key, Snapshot] = {}
        self.cycles = 0

    def want(self, target: SnapshotTarget) -> None:
        self._targets[target.key] = target

    def forget(self, key: Key) -> None:
        self._targets.pop(key, None)
        self._latest.pop(key, None)

    def latest(self, key: Key, window_s: float) -> Snapshot:
        """The freshest snapshot for `key`, or an unavailable one that says why there is none."""
        now = self.clock()
        if self.source is None:
            return Snapshot.unavailable(
                now, window_s, "no Prometheus configured (--prometheus-url): cannot observe"
            )
        snap = self._latest.get(key)
        if snap is None:
            return Snapshot.unavailable(
                now, window_s, "waiting for the first metrics cycle", warming_up=True
            )
        age = (now - snap.time).total_seconds()
        if age > self.max_age_s:
            return Snapshot.unavailable(
                now, window_s, f"the latest metrics are {age:.0f}s old (Prometheus cycle stuck?)"
            )
        return snap

    async def refresh(self) -> None:
        """One cycle: every wanted target in one batch of queries."""
        if self.source is None or not self._targets:
            return
        now = self.clock()
        targets = list(self._targets.values())
        try:
            results = await self.source.snapshots(targets, now)
        except Exception as exc:  # the adapter promises not to raise; be safe regardless
            log.exception("Prometheus cycle failed")
            reason = f"metrics cycle failed: {type(exc).__name__}: {exc}"
            results = {t.key: Snapshot.unavailable(now, t.window_s, reason) for t in targets}
        for target in targets:
            self._latest[target.key] = results.get(
                target.key, Snapshot.unavailable(now, target.window_s, "no result for this target")
            )
        self.cycles += 1

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
