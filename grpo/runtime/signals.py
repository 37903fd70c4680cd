"""SIGTERM / SIGINT while training: finish the step, save a checkpoint, then stop; a second signal stops at once."""
from __future__ import annotations

import logging
import signal
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
