"""Data and rewards: the dataset registry and the datasets named from it, prompt and sequence lengths, the user's
rewards, and the checks of those options."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from grpo.config.choices import DEFAULT_SPLIT_RATIO
from grpo.config.sections.option import need, option, option_list

MIN_DEFAULT_SEQ_LENGTH = 768  # the default --max_seq_length's floor: tool episodes take a few turns past one completion


@dataclass
class DataOptions:
    dataset_config_path: str = option(
        "configs/dataset_config.json", "The dataset registry (JSON) that --dataset_names refer to. A relative path "
        "missing from the current folder is read from the installed package's (configs/, the shipped registry).",
        "data")
    dataset_names: list[str] = option_list(["arith"], "Registered dataset names to mix (space or comma separated).",
                                     "data")
    eval_dataset_names: list[str] = option_list(
        [], "Registered datasets used only for evaluation, each with its own rewards (space or comma separated).",
        "data")
    train_split_ratio: Optional[float] = option(
        None, "Fraction of each training dataset's rows used for training, the rest held out for eval (default: "
              f"{DEFAULT_SPLIT_RATIO}, or 1.0 (no split) with --eval_dataset_names).", "data")
    max_prompt_length: int = option(
        256, "Longest prompt in tokens (chat template included); longer is an error unless filtered.", "data")
    filter_overlong_prompts: bool = option(
        False, "Drop prompts longer than --max_prompt_length (one line per dataset says how many) instead of "
               "stopping with an error.", "data")
    max_seq_length: Optional[int] = option(
        None, "Longest prompt + completion (or tool episode) in tokens. Default: --max_prompt_length + "
              f"--rollout_max_new_tokens, at least {MIN_DEFAULT_SEQ_LENGTH} (room for a few tool turns).", "data")
    max_images_per_prompt: int = option(
        1, "Most images one prompt may hold (rows with more are an error; vLLM's limit_mm_per_prompt).", "data")
    reward_module: Optional[str] = option(
        None, "Python file whose @register_reward functions become usable in the dataset config.", "data")
    reward_model: list[str] = option_list(
        [], "Sequence-classification model folder(s) (space or comma separated) used as rewards: each is registered "
            "under its folder's name for the dataset config's \"rewards\" (score = its single logit).", "data")

    def check_data(self) -> None:
        need(bool(self.dataset_names), "dataset_names", "give at least one registered dataset name")
        need(self.train_split_ratio is None or 0.0 < self.train_split_ratio <= 1.0, "train_split_ratio",
             "must be in (0, 1]")
        twice = sorted({n for n in self.eval_dataset_names if self.eval_dataset_names.count(n) > 1})
        need(not twice, "eval_dataset_names", f"{', '.join(twice)} listed more than once; name each dataset once")
        both = [n for n in self.eval_dataset_names if n in self.dataset_names]
        need(not both, "eval_dataset_names",
             f"{', '.join(both)} is also in --dataset_names, so the model would be evaluated on rows it trains on; "
             f"register the held-out file as its own entry (as gsm8k_test is for gsm8k), or drop it here and hold "
             f"out part of it with --train_split_ratio")
        need(self.max_prompt_length > 0, "max_prompt_length", "must be > 0")
        need(self.max_images_per_prompt >= 1, "max_images_per_prompt", "must be >= 1")
        need(self.max_seq_length >= self.max_prompt_length + self.rollout_max_new_tokens, "max_seq_length",
             f"must be >= --max_prompt_length + --rollout_max_new_tokens "
             f"({self.max_prompt_length} + {self.rollout_max_new_tokens}); got {self.max_seq_length}")
        names = [reward_model_name(p) for p in self.reward_model]
        twice = sorted({n for n in names if names.count(n) > 1})
        need(not twice, "reward_model", f"two folders are named {', '.join(twice)}; reward models are registered "
                                        f"by folder name, so give each a distinct name")


def reward_model_name(path: str) -> str:
    """The reward name a --reward_model folder registers under: its folder name."""
    return os.path.basename(os.path.normpath(path))


def names(value) -> list[str]:
    """Dataset names given space and/or comma separated (a plain string is one argument)."""
    parts = [value] if isinstance(value, str) else list(value)
    return [n.strip() for part in parts for n in part.split(",") if n.strip()]
