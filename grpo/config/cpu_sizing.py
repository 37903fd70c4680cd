"""Option values sized for a CPU: the one source of them, for train_grpo.py and run_grpo.sh.

GRPOConfig's defaults are a GPU's (2 prompts x 8 samples of up to 256 tokens a step, evaluations of 64 prompts): on
two CPU cores a step of SmolLM2-135M takes about two minutes and an evaluation about one. On a CPU, a run started
from the command line takes the values below for the options it was not given (on the command line or in --config),
and says so in one line at start; a resume keeps its run's options. run_grpo.sh reads them from here too
(`python -m grpo.config.cpu_sizing` prints them as shell assignments). A GRPOConfig built in Python keeps the values
it holds; on a CPU a line says which of them are a GPU's and what to give instead.
"""
from __future__ import annotations

import logging
from typing import Optional

from grpo.config.strategy import Strategy

logger = logging.getLogger("grpo")

# about ten minutes on two cores for the embedded SmolLM2-135M on `arith`: 14 steps of 4 prompts x 8 samples of up
# to 40 tokens learn the answer format at 6e-4 with batch-std advantages (eval format 0.97 at step 14; not yet at
# 3e-4); a checkpoint every 7 steps; evaluations of 32 prompts
CPU_VALUES = {"max_steps": 14, "per_device_train_batch_size": 4, "rollout_max_new_tokens": 40, "learning_rate": 6e-4,
              "eval_max_prompts": 32, "save_steps": 7}
# run_grpo.sh's variable for each value it passes on
SHELL_VARIABLES = {"max_steps": "MAX_STEPS", "per_device_train_batch_size": "BATCH",
                   "rollout_max_new_tokens": "MAX_NEW_TOKENS", "learning_rate": "LR", "save_steps": "SAVE_STEPS"}
# the options that make a GPU's defaults slow on a CPU: a GRPOConfig holding their defaults there hears of it
_COSTLY = ("max_steps", "rollout_max_new_tokens", "eval_max_prompts")
# a guide spelling given in place of an option counts as that option given
_GIVEN_AS = {"learning_rate_lora": "learning_rate"}


def cpu_values_for(given: set, strategy: Strategy) -> dict:
    """The CPU values of the options not given: --max_steps only when --epochs is not given either; the learning
    rate only for lora / qlora (full fine-tuning keeps its own default)."""
    given = set(given) | {_GIVEN_AS[name] for name in given if name in _GIVEN_AS}
    values = {key: value for key, value in CPU_VALUES.items() if key not in given}
    if "epochs" in given:
        values.pop("max_steps", None)
    if not Strategy(strategy).has_adapter:
        values.pop("learning_rate", None)
    return values


def as_flags(values: dict) -> str:
    return " ".join(f"--{key} {value:g}" if isinstance(value, float) else f"--{key} {value}"
                    for key, value in values.items())


def size_for_cpu(config, on_cpu: bool) -> dict:
    """On a CPU, give a command-line run's options that were not given their CPU values (once; the options stay
    validated) and say so; a GRPOConfig built in Python is left as it is, with a line naming the GPU-sized values
    it holds. Returns the values set."""
    given: Optional[set] = getattr(config, "given_options", None)
    if not on_cpu or getattr(config, "cpu_sized", None) is not None or config.resume_from_checkpoint:
        return {}
    if given is None:  # built in Python: which values were chosen is not known, only which are a GPU's
        _note_gpu_sized(config)
        return {}
    values = cpu_values_for(given, config.strategy)
    config.cpu_sized = values
    if not values:
        return values
    from grpo.config.sections.data import MIN_DEFAULT_SEQ_LENGTH

    resolved = dict(values)
    if "max_seq_length" not in given:  # derived from the completion length, as at construction
        resolved["max_seq_length"] = max(MIN_DEFAULT_SEQ_LENGTH, config.max_prompt_length
                                         + resolved.get("rollout_max_new_tokens", config.rollout_max_new_tokens))
    config.resolve(**resolved)  # the options are checked again
    logger.info(f"on a CPU: {as_flags(values)} (sized for minutes, not hours, on a few cores; the defaults are a "
                f"GPU's); give any of these flags to choose another value")
    return values


def _note_gpu_sized(config) -> None:
    from grpo.config.options import GRPOConfig

    defaults = GRPOConfig.__dataclass_fields__
    held = [key for key in _COSTLY if getattr(config, key) == defaults[key].default]
    if held:
        shown = ", ".join(f"{key}={getattr(config, key)}" for key in held)
        values = ", ".join(f"{key}={value!r}" for key, value in cpu_values_for(set(), config.strategy).items())
        logger.info(f"on a CPU with a GPU's defaults ({shown}): a step and an evaluation may take minutes each; for "
                    f"a short CPU run give {values} (what train_grpo.py takes on a CPU)")


def shell_assignments() -> str:
    """run_grpo.sh's CPU values, as `cpu_MAX_STEPS=14` lines."""
    return "\n".join(f"cpu_{SHELL_VARIABLES[key]}={value:g}" if isinstance(value, float)
                     else f"cpu_{SHELL_VARIABLES[key]}={value}"
                     for key, value in CPU_VALUES.items() if key in SHELL_VARIABLES)


if __name__ == "__main__":
    print(shell_assignments())
