"""Console logging of every process: rank 0 at INFO (and into the run's train.log), the others at WARNING, through
tqdm so that log lines and the progress bar never share a line. Used by training and by the rollout ranks alike."""
from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

from tqdm.auto import tqdm

logger = logging.getLogger("grpo")

# bitsandbytes warns at import, on CPUs with AVX512-BF16, that an optional kernel package is missing; the fallback it
# then uses is its own CPU code, so the warning is noise on every CPU run. Only that message is dropped.
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
_BNB_MISSING_KERNELS = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _not_missing_kernels_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_BNB_MISSING_KERNELS)


class BarSafeHandler(logging.StreamHandler):
    """Console handler that writes through tqdm, which clears the progress bar, prints the line and redraws the
    bar below it: log lines and the bar never share a line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001  (logging's rule: a failing handler never stops the program)
            self.handleError(record)


def setup_console_logging(is_main: bool, log_file: Optional[str] = None, earlier: Sequence = ()) -> None:
    """Rank 0 logs INFO to stderr (and to log_file, which also gets the `earlier` records: what was logged before
    the run's folder existed); other ranks only warnings."""
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    logger.propagate = False
    quiet = logging.getLogger(_BNB_CPU_LOGGER)  # set before bitsandbytes is imported (by peft / the model)
    if _not_missing_kernels_note not in quiet.filters:
        quiet.addFilter(_not_missing_kernels_note)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in logger.handlers):
        handler = BarSafeHandler(sys.stderr)
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    if is_main and log_file:
        for h in list(logger.handlers):
            if isinstance(h, logging.FileHandler):
                logger.removeHandler(h)
                h.close()
        handler = logging.FileHandler(log_file)
        handler.setFormatter(fmt)
        for record in earlier:
            handler.handle(record)
        logger.addHandler(handler)
