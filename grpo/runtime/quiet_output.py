"""What the libraries print that a run's output is better without.

Off a terminal (output sent to a file or a pipe, e.g. `bash run_grpo.sh > run.log 2>&1`) a progress bar's redraws,
joined by carriage returns, become one long line: the bars of weight loading and saving (transformers), hub downloads
and the embedded model's GGUF conversion are left out there (a notebook keeps them: it draws them as widgets). On a
CPU, DeepSpeed is told so before anything imports it, so that it does not warn on every run that it "was unable to
detect" a GPU.
"""
from __future__ import annotations

import contextlib
import os
import sys


def on_a_terminal(stream=None) -> bool:
    """Whether progress bars show as bars: a terminal, or a notebook (whose output is no terminal but draws them)."""
    stream = stream if stream is not None else sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)()) or "ipykernel" in sys.modules


def quiet_progress_bars(stream=None) -> bool:
    """Off a terminal, turn off the progress bars of transformers and huggingface_hub; True where it did."""
    if on_a_terminal(stream):
        return False
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    disable_progress_bars()
    return True


@contextlib.contextmanager
def gguf_conversion_bar_off(stream=None):
    """Off a terminal, no progress bar while transformers converts a GGUF file (its bar is a plain tqdm that
    transformers' switch does not reach)."""
    if on_a_terminal(stream):
        yield
        return
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf

    shown = gguf.tqdm
    gguf.tqdm = functools.partial(shown, disable=True)
    try:
        yield
    finally:
        gguf.tqdm = shown


def name_cpu_accelerator() -> None:
    """On a machine without a GPU, tell DeepSpeed its accelerator is the CPU (unless DS_ACCELERATOR says otherwise)
    before anything imports it: told, it does not warn that it fell back to the CPU."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
