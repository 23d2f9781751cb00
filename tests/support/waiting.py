"""Wait on a condition with a deadline instead of sleeping and hoping.

Tests that talk to processes (servers, Prometheus, the operator) cannot know when a state is
reached; polling a predicate with a timeout makes them both fast when things go well and clear
when they do not (the message and the last value seen end up in the failure).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The condition did not hold in time (an AssertionError, so pytest reports it as a failure)."""


def _describe(message: str, timeout: float, last: object, error: BaseException | None) -> str:
    text = f"timed out after {timeout:.1f}s waiting for {message}; last value: {last!r}"
    if error is not None:
        text += f"; last error: {type(error).__name__}: {error}"
    return text


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call `predicate` until it returns a truthy value and return that value.

    Exceptions listed in `ignore` (e.g. ConnectionError while a server starts) count as "not yet".
    """
    deadline = time.monotonic() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            value = predicate()
        except ignore as exc:
            error = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise WaitTimeout(_describe(message, timeout, last, error))
        time.sleep(interval)


async def async_wait_for(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """The asyncio variant of `wait_for`; `predicate` may be a plain or a coroutine function."""
    deadline = time.monotonic() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            result = predicate()
            value = await result if inspect.isawaitable(result) else result
        except ignore as exc:
            error = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise WaitTimeout(_describe(message, timeout, last, error))
        await asyncio.sleep(interval)
