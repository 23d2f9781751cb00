"""One periodic reconcile loop for every VLLMDeployment, instead of a kopf timer per object.

Why: a kopf timer is an asyncio task per object that keeps kopf's full copy of the object
(managedFields included) for its whole life, and kopf puts a finalizer on every object that has
a timer, so deleting a VLLMDeployment blocks while the operator is down. At a thousand
deployments the timers were the largest per-deployment cost left in the operator's memory
(docs/scale.md). This loop keeps one due time per deployment and reads the objects from an
index that holds trimmed copies.

The loop cannot see kopf's peering pause, so it runs only in standalone mode; with peering
(a warm standby) the operator keeps kopf's timers, which kopf pauses (operator.py).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable

log = logging.getLogger(__name__)


class ReconcileSchedule:
    """When each deployment is due next; a deployment is never handed out twice at once.

    New keys are due at once (as kopf's timers fire on first sight); a finished reconcile sets
    the next due time to its end plus the delay it asks for (the interval, or a backoff after a
    failure), so reconciles of one object never overlap and a slow API spaces them out instead
    of piling them up.
    """

    def __init__(self) -> None:
        self._due: dict[str, float] = {}
        self._busy: set[str] = set()
        self._again: set[str] = set()  # woken while busy: due again as soon as done
        self._heap: list[tuple[float, str]] = []  # lazily invalidated: (due, key)

    def __len__(self) -> int:
        return len(self._due)

    def sync(self, keys: Iterable[str], now: float) -> None:
        """Track exactly `keys`: new ones are due now, vanished ones are dropped."""
        current = set(keys)
        for key in current - self._due.keys():
            self._set(key, now)
        for key in self._due.keys() - current:
            del self._due[key]

    def pop_due(self, now: float) -> list[str]:
        """The keys due by `now`, earliest first; they stay busy until `done`."""
        out: list[str] = []
        while self._heap and self._heap[0][0] <= now:
            due, key = heapq.heappop(self._heap)
            if self._due.get(key) != due or key in self._busy:
                continue  # rescheduled, removed, or already running
            self._busy.add(key)
            out.append(key)
        return out

    def done(self, key: str, now: float, delay_s: float) -> None:
        self._busy.discard(key)
        again = key in self._again
        self._again.discard(key)
        if key in self._due:
            self._set(key, now if again else now + max(0.0, delay_s))

    def wake(self, key: str, now: float) -> None:
        """Make `key` due now (an event changed it). One in flight may have read its inputs
        before the change, so it is due again as soon as it is done."""
        if key in self._busy:
            self._again.add(key)
        else:
            self._set(key, now)

    def next_due(self) -> float:
        """The earliest due time of an idle key (inf when none)."""
        while self._heap:
            due, key = self._heap[0]
            if self._due.get(key) == due and key not in self._busy:
                return due
            heapq.heappop(self._heap)
        return math.inf

    def _set(self, key: str, due: float) -> None:
        self._due[key] = due
        heapq.heappush(self._heap, (due, key))


async def run_periodic(
    *,
    keys: Callable[[], Iterable[str]],
    reconcile: Callable[[str], Awaitable[float]],
    stop: asyncio.Event,
    concurrency: int = 16,
    poll_s: float = 1.0,
    failure_delay_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    schedule: ReconcileSchedule | None = None,
    wakeup: asyncio.Event | None = None,
) -> None:
    """Reconcile every key when due until `stop` is set, at most `concurrency` at a time.

    `schedule` and `wakeup` let event handlers hand a key over (`schedule.wake(key)`, then
    `wakeup.set()`): the loop looks at once instead of after `poll_s`.

    `reconcile(key)` returns the seconds until that key is due again. `keys` is read every
    `poll_s` (it is an index that kopf's watch keeps current), so a new deployment waits at
    most that long for its first periodic reconcile; its creation event has reconciled it
    already. On stop, reconciles in flight run to their end: a rollout step is never cut.
    """
    schedule = ReconcileSchedule() if schedule is None else schedule  # empty is falsy
    gate = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()

    async def one(key: str) -> None:
        delay = math.inf
        try:
            async with gate:
                delay = await reconcile(key)
        except Exception:  # the reconcile reports its own errors; the loop must go on
            log.exception("periodic reconcile of %s failed", key)
            delay = failure_delay_s
        finally:
            schedule.done(key, clock(), delay)

    while not stop.is_set():
        if wakeup is not None:
            wakeup.clear()
        now = clock()
        schedule.sync(keys(), now)
        for key in schedule.pop_due(now):
            task = asyncio.create_task(one(key), name=f"reconcile {key}")
            running.add(task)
            task.add_done_callback(running.discard)
        wait = min(poll_s, max(0.0, schedule.next_due() - clock()))
        await _sleep(stop, wakeup, wait if wait > 0 else poll_s / 100)
    if running:
        await asyncio.gather(*running, return_exceptions=True)


async def _sleep(stop: asyncio.Event, wakeup: asyncio.Event | None, timeout: float) -> None:
    """Until `timeout` passes or `stop` or `wakeup` is set."""
    events = [stop] if wakeup is None else [stop, wakeup]
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
