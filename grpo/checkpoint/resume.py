"""Resuming a run: where its saved options are, the refusal of options that would rebuild another policy around the
checkpoint's weights (before any model loads), and a warning naming every other option that changed."""
from __future__ import annotations

import logging
import os

from grpo.config.choices import BITSANDBYTES_BLOCK_SCALE, BITSANDBYTES_BLOCK_SIZE
from grpo.config.cli import read_json_object
from grpo.config.options import upgrade_saved_options
from grpo.errors import ConfigError

logger = logging.getLogger("grpo")


# options that decide which tensors a checkpoint holds and what they mean: lora / qlora checkpoints hold only the
# adapter, laid onto a base rebuilt from these at resume, so a change would resume a different policy without error
POLICY_OPTIONS = ("tuning_strategy",)
LORA_POLICY_OPTIONS = ("lora_rank", "lora_alpha", "lora_target_modules", "lora_exclude_modules")
QLORA_POLICY_OPTIONS = ("qlora_quant_type", "qlora_block_size", "qlora_block_scale", "qlora_skip_modules",
                        "qlora_init")


def saved_config_path(resume: str, output_dir: str) -> str:
    """The grpo_config.json of the run that wrote the checkpoint: beside its checkpoint-* folders."""
    folder = output_dir if resume == "latest" else os.path.dirname(os.path.normpath(resume))
    return os.path.join(folder, "grpo_config.json")


def check_resume_keeps_policy(saved_path: str, config) -> None:
    """Refuse to resume with options that rebuild a different policy around the checkpoint's weights (before any
    model is loaded). Other changed options only get named (warn_changed_options)."""
    saved, now = _saved_options(saved_path), config.to_dict()
    keys = POLICY_OPTIONS
    if saved.get("tuning_strategy") == now["tuning_strategy"] and config.uses_lora:
        keys += LORA_POLICY_OPTIONS + (QLORA_POLICY_OPTIONS if now["tuning_strategy"] == "qlora" else ())
    as_saved, changed = _changed_keys(saved, now, keys)
    if changed:
        flags = " ".join(f"--{key} {as_saved[key]}" for key in changed)
        raise ConfigError(
            f"--resume_from_checkpoint: the checkpoint was trained with other model options "
            f"({_described(as_saved, now, changed)}); "
            f"its weights belong to that policy. Resume with the saved values ({flags}; see {saved_path}), or start "
            f"a new run with these options in another --output_dir (or --overwrite_output_dir)")


def _saved_options(saved_path: str) -> dict:
    """The saved grpo_config.json; empty when none was saved or it cannot be read (nothing to compare with)."""
    try:
        return upgrade_saved_options(read_json_object(saved_path, ConfigError, "grpo_config.json"))
    except (ConfigError, OSError):
        return {}


# what a run saved before an option existed used in its place
VALUES_BEFORE_THE_OPTION = {"qlora_block_size": BITSANDBYTES_BLOCK_SIZE, "qlora_block_scale": BITSANDBYTES_BLOCK_SCALE}


def _changed_keys(saved: dict, now: dict, keys) -> tuple[dict, list[str]]:
    """(the saved options, with the values of their time for options they predate; those of `keys` they hold with
    another value)."""
    saved = {**(VALUES_BEFORE_THE_OPTION if saved else {}), **saved}  # nothing saved: nothing to compare
    return saved, [k for k in keys if k in saved and as_compared(k, saved[k]) != as_compared(k, now[k])]


def _described(saved: dict, now: dict, changed: list[str]) -> str:
    return "; ".join(f"--{k} {saved[k]!r} -> {now[k]!r}" for k in changed)


def as_compared(key: str, value):
    """Module lists compare as sets of names: "q_proj, v_proj" and "v_proj,q_proj" build the same adapter."""
    if key.endswith("_modules") and isinstance(value, str):
        return frozenset(name.strip() for name in value.split(",") if name.strip())
    return value


def warn_changed_options(saved_path: str, config) -> None:
    """A resumed run continues with today's options: name those that differ from the run's saved ones (a flag
    given differently, or a default that changed between versions, e.g. --scale_rewards)."""
    ignore = {"resume_from_checkpoint", "overwrite_output_dir", "max_steps", "epochs"}  # meant to change
    now, saved = config.to_dict(), _saved_options(saved_path)
    if "qlora" not in (now["tuning_strategy"], saved.get("tuning_strategy")):  # qlora's options shape nothing else
        ignore |= {key for key in now if key.startswith("qlora_")}
    as_saved, changed = _changed_keys(saved, now, [k for k in now if k not in ignore])
    if changed:
        logger.warning("resuming with options that differ from the run's saved grpo_config.json: "
                       + _described(as_saved, now, changed))
