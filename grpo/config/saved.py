"""A run's saved options, as a resume starts from them.

Every checkpoint holds the options it was trained with (checkpoint-<step>/grpo_config.json); checkpoints saved
before they did are read from the run's grpo_config.json beside them. Options are read in today's names
(upgrade_saved_options), options a run saved before they existed take the values of their time
(VALUES_BEFORE_THE_OPTION), and options this version no longer has are left out with a warning. The options that
exist are those of the schema passed in (GRPOConfig), which this module does not import: GRPOConfig.from_run calls
config_from_run.
"""
from __future__ import annotations

import logging
import os
from dataclasses import fields
from typing import Optional

from grpo.config.choices import BITSANDBYTES_BLOCK_SCALE, BITSANDBYTES_BLOCK_SIZE
from grpo.config.guide_spellings import upgrade_saved_options
from grpo.config.json_files import read_json_object
from grpo.config.run_layout import CONFIG_FILE, list_checkpoints
from grpo.errors import ConfigError

logger = logging.getLogger("grpo")

# what a run saved before an option existed used in its place
VALUES_BEFORE_THE_OPTION = {"qlora_block_size": BITSANDBYTES_BLOCK_SIZE, "qlora_block_scale": BITSANDBYTES_BLOCK_SCALE}

# options of one start of a run, not of the run: never carried over from what was saved
PER_START_OPTIONS = ("resume_from_checkpoint", "local_rank", "overwrite_output_dir")


def saved_options_path(resume: str, output_dir: str) -> str:
    """The grpo_config.json a resume from `resume` ('latest' or a checkpoint folder) starts from: the checkpoint's
    own; for a checkpoint saved before checkpoints held one, the run's beside it. With 'latest' the newest
    checkpoint's (the one resumed unless it turns out damaged)."""
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            return os.path.join(output_dir, CONFIG_FILE)
        folder = found[-1][1]
    else:
        folder = os.path.normpath(resume)
    own = os.path.join(folder, CONFIG_FILE)
    return own if os.path.isfile(own) else os.path.join(os.path.dirname(folder), CONFIG_FILE)


def read_saved_options(path: str, schema) -> dict:
    """The options saved in `path` that `schema` (GRPOConfig, or one of its instances) has, in today's names and
    complete for the options they predate. A missing or unreadable file raises ConfigError."""
    values = upgrade_saved_options(read_json_object(path, ConfigError, CONFIG_FILE))
    known = {f.name for f in fields(schema)}
    gone = sorted(set(values) - known)
    if gone:
        logger.warning(f"{path}: option(s) {', '.join(gone)} no longer exist; resuming without them")
    return {**VALUES_BEFORE_THE_OPTION, **{k: v for k, v in values.items() if k in known}}


def run_options(resume: str, output_dir: str, schema) -> tuple[Optional[str], dict]:
    """(the saved file, the options of `schema` a resume takes from it but the per-start ones), or (None, {}) when
    nothing was saved there (the resume itself then says what is missing)."""
    path = saved_options_path(resume, output_dir)
    if not os.path.isfile(path):
        return None, {}
    saved = read_saved_options(path, schema)
    return path, {k: v for k, v in saved.items() if k not in PER_START_OPTIONS}


def config_from_run(cls, output_dir: str, checkpoint: str, overrides: dict):
    """GRPOConfig.from_run's work: the saved options, `overrides` on top, set to resume from `checkpoint`."""
    path, saved = run_options(checkpoint, output_dir, cls)
    if path is None:
        what = ("no checkpoint-* folder" if checkpoint == "latest" and not list_checkpoints(output_dir)
                else f"no saved options ({saved_options_path(checkpoint, output_dir)} is missing)")
        raise ConfigError(f"GRPOConfig.from_run({output_dir!r}, {checkpoint!r}): {what}; give every option with "
                          f"GRPOConfig(..., resume_from_checkpoint={checkpoint!r}) instead")
    config = cls(**{**saved, "output_dir": output_dir, **overrides, "resume_from_checkpoint": checkpoint})
    config.resumes_saved_options = path
    return config
