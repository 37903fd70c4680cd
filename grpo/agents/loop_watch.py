"""When the agents' event loop is idle: the endpoint sends a round of turns once every open episode has its call
in, or once the loop has had nothing to run for a moment (an agent waiting on something outside it). A selector
that reports the loop's waits, and a default executor whose jobs count as the loop's work for their first moments
(address lookups, quick tools in a thread)."""
from __future__ import annotations

import concurrent.futures
import itertools
import selectors
import threading
import time
from typing import Callable

EXECUTOR_BUSY_S = 0.05  # how long a job of the agents' loop's default executor counts as the loop's work


class TrackedExecutor(concurrent.futures.ThreadPoolExecutor):
    """A ThreadPoolExecutor that keeps the start of each job in flight (its end wakes the loop, which the batcher
    then sees busy)."""

    def __init__(self):
        super().__init__(thread_name_prefix="grpo-agents-executor")
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}
        self._keys = itertools.count()

    def submit(self, fn, /, *args, **kwargs):
        with self._lock:
            key = next(self._keys)
            self._started[key] = time.monotonic()
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(lambda _: self._done(key))
        return future

    def _done(self, key: int) -> None:
        with self._lock:
            self._started.pop(key, None)

    def busy_until(self) -> float:
        """Until when the jobs in flight count as the loop's work (0.0: none)."""
        with self._lock:
            return max(self._started.values(), default=-EXECUTOR_BUSY_S) + EXECUTOR_BUSY_S


class IdleSelector(selectors.DefaultSelector):
    """The platform's default selector, telling `waits(True)` when its loop waits with nothing ready (a select with
    a timeout other than 0) and `waits(False)` when it runs again."""

    def __init__(self, waits: Callable[[bool], None]):
        super().__init__()
        self._waits = waits

    def select(self, timeout=None):
        waits = timeout is None or timeout > 0
        if waits:
            self._waits(True)
        try:
            return super().select(timeout)
        finally:
            if waits:
                self._waits(False)
