"""Resuming a run: where its saved options are, the refusal of options that would rebuild another policy around the
checkpoint's weights (before any model loads), the one line that says which options a resume runs with, and the
check that a lora / qlora checkpoint goes back onto the base it was trained on."""
from __future__ import annotations

import logging
import os

from grpo.checkpoint.base_model import base_model_problem
from grpo.config.option_compare import as_compared
from grpo.config.saved import PER_START_OPTIONS, read_saved_options, saved_options_path
from grpo.config.strategy import Strategy
from grpo.errors import CheckpointError, ConfigError

logger = logging.getLogger("grpo")


# options that decide which tensors a checkpoint holds and what they mean: lora / qlora checkpoints hold only the
# adapter, laid onto a base rebuilt from these at resume, so a change would resume a different policy without error
POLICY_OPTIONS = ("tuning_strategy",)
LORA_POLICY_OPTIONS = ("lora_rank", "lora_alpha", "lora_target_modules", "lora_exclude_modules")
QLORA_POLICY_OPTIONS = ("qlora_quant_type", "qlora_block_size", "qlora_block_scale", "qlora_skip_modules",
                        "qlora_init")


def saved_config_path(resume: str, output_dir: str) -> str:
    """The grpo_config.json the checkpoint was trained with (its own copy; older checkpoints: the run's)."""
    return saved_options_path(resume, output_dir)


def check_resume_keeps_policy(saved_path: str, config) -> None:
    """Refuse to resume with options that rebuild a different policy around the checkpoint's weights (before any
    model is loaded). Other changed options are only listed (log_resumed_options)."""
    saved, now = _saved_options(saved_path, config), config.to_dict()
    keys = POLICY_OPTIONS
    if saved.get("tuning_strategy") == now["tuning_strategy"] and config.uses_lora:
        keys += LORA_POLICY_OPTIONS + (QLORA_POLICY_OPTIONS if config.strategy.four_bit_base else ())
    changed = _changed_keys(saved, now, keys)
    if changed:
        flags = " ".join(f"--{key} {saved[key]}" for key in changed)
        raise ConfigError(
            f"--resume_from_checkpoint: the checkpoint was trained with other model options "
            f"({_described(saved, now, changed)}); "
            f"its weights belong to that policy. Resume with the saved values ({flags}; see {saved_path}), or start "
            f"a new run with these options in another --output_dir (or --overwrite_output_dir)")


def _saved_options(saved_path: str, config) -> dict:
    """The saved options (those `config` has); empty when none were saved or they cannot be read (nothing to compare
    with)."""
    try:
        return read_saved_options(saved_path, config)
    except (ConfigError, OSError):
        return {}


def _changed_keys(saved: dict, now: dict, keys) -> list[str]:
    """Those of `keys` the saved options hold with another value."""
    return [k for k in keys if k in saved and as_compared(k, saved[k]) != as_compared(k, now[k])]


def _described(saved: dict, now: dict, changed: list[str]) -> str:
    return "; ".join(f"--{k} {saved[k]!r} -> {now[k]!r}" for k in changed)


def changed_options(saved_path: str, config) -> list[str]:
    """The options `config` holds with other values than the saved ones (per-start options aside; qlora's only
    where a run is qlora, since they shape nothing else)."""
    now, saved = config.to_dict(), _saved_options(saved_path, config)
    ignore = set(PER_START_OPTIONS)
    if Strategy.QLORA not in (config.strategy, Strategy.read(saved.get("tuning_strategy"))):
        ignore |= {key for key in now if key.startswith("qlora_")}
    return _changed_keys(saved, now, [k for k in now if k not in ignore])


def log_resumed_options(checkpoint: str, step: int, saved_path: str, config) -> list[str]:
    """One line saying where the run resumed and with which options; returns the options that differ from the
    checkpoint's saved ones.

    Built from the run (train_grpo.py, GRPOConfig.from_run): the run's options, and each override given. A plain
    GRPOConfig: its own options, with a warning naming each that differs from the run's and how to take those."""
    where = f"resumed from {checkpoint} at step {step}"
    if not os.path.isfile(saved_path):
        logger.warning(f"{where}, which has no saved options ({saved_path} is missing): the options given are used "
                       f"as they are")
        return []
    saved = _saved_options(saved_path, config)
    changed = changed_options(saved_path, config)
    listed = _described(saved, config.to_dict(), changed)
    if config.resumes_saved_options is not None:
        logger.info(f"{where} with the run's options ({saved_path})" + (f"; given here: {listed}" if changed else ""))
    elif changed:
        logger.warning(f"{where} with the options of this GRPOConfig, which differ from the run's ({saved_path}): "
                       f"{listed}. GRPOConfig.from_run({config.output_dir!r}) continues with the run's own options "
                       f"(keyword arguments override them)")
    else:
        logger.info(f"{where} with the run's options ({saved_path})")
    return changed


def check_base_model(checkpoint: str, model_path: str) -> None:
    """A lora / qlora checkpoint holds only the adapter: stop before any model loads when the base model's files
    are not the ones it was trained on (checkpoints saved before this record existed are not checked)."""
    problem = base_model_problem(checkpoint, model_path)
    if problem:
        raise CheckpointError(f"--resume_from_checkpoint: {checkpoint} holds a LoRA adapter trained on another base "
                              f"model: {problem}. Resume with the base it was trained on (--model_name_or_path), or "
                              f"start a new run in another --output_dir")
