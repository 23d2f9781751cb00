"""The periodic loop: every deployment on its own cadence, never twice at once, never lost."""

from __future__ import annotations

import asyncio
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_autotuner.periodic import ReconcileSchedule, run_periodic


def test_new_keys_are_due_at_once_and_then_after_their_delay() -> None:
    s = ReconcileSchedule()
    s.sync(["a", "b"], now=10.0)
    assert sorted(s.pop_due(10.0)) == ["a", "b"]
    assert s.pop_due(100.0) == []  # busy until done
    s.done("a", now=11.0, delay_s=30.0)
    s.done("b", now=12.0, delay_s=5.0)
    assert s.next_due() == 17.0
    assert s.pop_due(16.9) == []
    assert s.pop_due(17.0) == ["b"]
    assert s.pop_due(41.0) == ["a"]


def test_a_vanished_key_is_dropped_even_while_it_runs() -> None:
    s = ReconcileSchedule()
    s.sync(["a", "b"], now=0.0)
    assert sorted(s.pop_due(0.0)) == ["a", "b"]
    s.sync(["b"], now=1.0)
    s.done("a", now=2.0, delay_s=1.0)
    s.done("b", now=2.0, delay_s=1.0)
    assert len(s) == 1
    assert s.pop_due(10.0) == ["b"]


def test_a_key_that_comes_back_is_due_at_once() -> None:
    s = ReconcileSchedule()
    s.sync(["a"], now=0.0)
    s.pop_due(0.0)
    s.done("a", now=0.0, delay_s=30.0)
    s.sync([], now=1.0)
    s.sync(["a"], now=2.0)
    assert s.pop_due(2.0) == ["a"]


def test_a_woken_key_is_due_now_and_one_in_flight_runs_again_when_done() -> None:
    s = ReconcileSchedule()
    s.sync(["a", "b"], now=0.0)
    assert sorted(s.pop_due(0.0)) == ["a", "b"]
    s.done("a", now=1.0, delay_s=30.0)
    s.wake("a", now=2.0)  # idle: due at once, not at 31
    assert s.pop_due(2.0) == ["a"]
    s.wake("b", now=3.0)  # in flight: it may have read the old state
    assert s.pop_due(3.0) == []  # never twice at once
    s.done("b", now=4.0, delay_s=30.0)
    assert s.pop_due(4.0) == ["b"]
    s.done("b", now=5.0, delay_s=30.0)  # the wake is spent: back on its cadence
    assert s.pop_due(34.9) == []
    assert s.pop_due(35.0) == ["b"]


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["sync", "pop", "done", "wake"]),
            st.frozensets(st.sampled_from("abcde")),
            st.floats(min_value=0.0, max_value=50.0),
        ),
        max_size=60,
    )
)
def test_schedule_invariants(ops: list[tuple[str, frozenset[str], float]]) -> None:
    """Whatever the order of events: a key is never handed out while busy, only tracked keys
    are handed out, and every tracked idle key is due at some finite time."""
    s = ReconcileSchedule()
    now = 0.0
    tracked: set[str] = set()
    busy: set[str] = set()
    for op, keys, delta in ops:
        now += delta
        if op == "sync":
            s.sync(keys, now)
            tracked = set(keys)
        elif op == "wake":
            for key in sorted(keys & tracked):
                s.wake(key, now)
        elif op == "pop":
            out = s.pop_due(now)
            assert len(out) == len(set(out))
            assert not set(out) & busy
            assert set(out) <= tracked
            busy |= set(out)
        else:
            for key in sorted(keys & busy):
                s.done(key, now, delta)
                busy.discard(key)
        idle = tracked - busy
        assert (s.next_due() < math.inf) == bool(idle)
    # Finish everything: then every tracked key comes out by a late enough time.
    for key in sorted(busy):
        s.done(key, now, 1.0)
    assert set(s.pop_due(now + 1e6)) == tracked


async def test_loop_reconciles_each_key_on_its_cadence_and_drains_on_stop() -> None:
    now = [0.0]
    calls: list[tuple[str, float]] = []
    keys = {"a", "b"}
    stop = asyncio.Event()
    in_flight: set[str] = set()

    async def reconcile(key: str) -> float:
        assert key not in in_flight, "a key ran twice at once"
        in_flight.add(key)
        calls.append((key, now[0]))
        await asyncio.sleep(0)
        in_flight.discard(key)
        if len(calls) >= 6:
            stop.set()
        return 10.0 if key == "a" else 20.0

    async def advance() -> None:
        while not stop.is_set():
            now[0] += 1.0
            await asyncio.sleep(0.001)

    clock_task = asyncio.create_task(advance())
    await asyncio.wait_for(
        run_periodic(
            keys=lambda: keys, reconcile=reconcile, stop=stop, poll_s=0.005, clock=lambda: now[0]
        ),
        timeout=30,
    )
    await clock_task
    a_times = [t for k, t in calls if k == "a"]
    b_times = [t for k, t in calls if k == "b"]
    assert len(a_times) >= 3 and len(b_times) >= 1
    assert all(t2 - t1 >= 10.0 for t1, t2 in itertools.pairwise(a_times))
    assert all(t2 - t1 >= 20.0 for t1, t2 in itertools.pairwise(b_times))


async def test_loop_survives_a_failing_reconcile_and_retries_it_later() -> None:
    stop = asyncio.Event()
    attempts: list[str] = []

    async def reconcile(key: str) -> float:
        attempts.append(key)
        if len(attempts) == 1:
            raise RuntimeError("boom")
        stop.set()
        return 30.0

    await asyncio.wait_for(
        run_periodic(
            keys=lambda: ["x"],
            reconcile=reconcile,
            stop=stop,
            poll_s=0.005,
            failure_delay_s=0.01,
        ),
        timeout=30,
    )
    assert attempts == ["x", "x"]


async def test_loop_bounds_concurrency() -> None:
    stop = asyncio.Event()
    running = 0
    peak = 0
    done = 0

    async def reconcile(key: str) -> float:
        nonlocal running, peak, done
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        done += 1
        if done >= 20:
            stop.set()
        return 1000.0

    await asyncio.wait_for(
        run_periodic(
            keys=lambda: [f"k{i}" for i in range(20)],
            reconcile=reconcile,
            stop=stop,
            concurrency=4,
            poll_s=0.005,
        ),
        timeout=30,
    )
    assert done == 20
    assert peak == 4


async def test_a_wakeup_reconciles_a_woken_key_at_once_not_after_the_poll() -> None:
    """What an event handler does in standalone mode: wake the key, set the event."""
    stop = asyncio.Event()
    wakeup = asyncio.Event()
    schedule = ReconcileSchedule()
    calls: list[str] = []

    async def reconcile(key: str) -> float:
        calls.append(key)
        if len(calls) == 2:
            stop.set()
        return 1000.0

    task = asyncio.create_task(
        run_periodic(
            keys=lambda: ["a"],
            reconcile=reconcile,
            stop=stop,
            poll_s=60.0,
            schedule=schedule,
            wakeup=wakeup,
        )
    )
    while not calls:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)  # the first reconcile is done; the next is 1000 s away
    schedule.wake("a", asyncio.get_running_loop().time())
    wakeup.set()
    await asyncio.wait_for(task, timeout=5)  # 60 s poll: only the wakeup can end it in time
    assert calls == ["a", "a"]


@pytest.mark.parametrize("keys", [[], ["only"]])
async def test_loop_stops_promptly_when_told(keys: list[str]) -> None:
    stop = asyncio.Event()

    async def reconcile(key: str) -> float:
        return 1000.0

    task = asyncio.create_task(
        run_periodic(keys=lambda: keys, reconcile=reconcile, stop=stop, poll_s=60.0)
    )
    await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, timeout=5)


@pytest.mark.parametrize(("standalone", "timers"), [(True, 0), (False, 1)])
def test_only_peering_keeps_a_kopf_timer_per_deployment(standalone: bool, timers: int) -> None:
    """kopf pauses its timers when a peer takes over and the loop could not tell, so peering
    keeps them; standalone uses the loop and so puts no finalizer on the objects."""
    from vllm_autotuner.adapters.kube import KubeCredentials
    from vllm_autotuner.operator import OperatorConfig, build_registry

    config = OperatorConfig(
        credentials=KubeCredentials.for_server("http://127.0.0.1:1"), standalone=standalone
    )
    registry, _ = build_registry(config)
    spawning = registry._spawning.get_all_handlers()
    assert len(spawning) == timers
    assert all(h.requires_finalizer for h in spawning)
    assert not registry._changing.get_all_handlers()  # nothing else asks for a finalizer
    indexes = {h.id for h in registry._indexing.get_all_handlers()}
    assert "vllm_index" in indexes
