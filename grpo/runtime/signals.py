"""SIGTERM / SIGINT while training: finish the step, save a checkpoint, then stop; a second signal stops at once. And
a short stretch that a signal must not cut in two (signals_held)."""
from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Optional

logger = logging.getLogger("grpo")


class GracefulStop:
    """Between install() and restore(), SIGTERM and SIGINT are recorded in `requested` instead of ending the process;
    the training loop checks it after each step. `before` runs first on every signal (a launcher stopping this rank
    because another one failed: re-raise that failure). restore() brings the previous handlers back."""

    def __init__(self, before: Callable[[], None] = lambda: None):
        self.before = before
        self.requested: Optional[int] = None
        self._previous: dict = {}

    def _handle(self, signum, _frame) -> None:
        self.before()
        if self.requested is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = signum
        logger.warning(f"signal {signum}: saving a checkpoint after this step, then stopping")

    def install(self) -> None:
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread (e.g. some notebook runners): no graceful stop
            pass

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


@contextmanager
def signals_held():
    """SIGINT and SIGTERM that arrive inside are handled on leaving, by the handlers in place then: a step that must
    not be cut between two of its statements (a kernel launch and the flag that records it) runs whole. Elsewhere
    than in the main thread (where Python handles signals anyway) it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for sig in held:
            signal.raise_signal(sig)  # now handled as if it came here
