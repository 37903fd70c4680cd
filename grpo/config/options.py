"""GRPOConfig: the one source of every option (its schema). CLI flags of train_grpo.py are generated from it (cli.py).

The options are grouped in sections (grpo/config/sections/: model, data, optimization, algorithm, rollout, tools,
logging, distributed, and the guide's spellings), each a dataclass with its fields and the checks beside them;
GRPOConfig composes them by inheritance, so every option stays a flat attribute (`config.lora_rank`) and a flat
keyword (`GRPOConfig(lora_rank=8)`), with its flag spelling, default and help unchanged. Each field's
``metadata["help"]`` is its one-line help; ``FLAG_GROUPS`` maps each field to the group it is listed under (--help,
docs/flags.md). Invalid values and combinations raise ConfigError naming the flag, at construction (each section's
check, run by validation.py). The guide's spellings of merged options (--learning_rate_lora, --use_kl_penalty,
--use_vllm_rollout, --vllm_mode) are options too, folded into today's at construction (guide_spellings.py).

A run resolves its options once: what depends on the machine, the model or the data (CPU sizing, the model's
positions, routing replay, the memory plan's log-prob chunk, a tracker that is not installed) is set with
`resolve(...)` on the run's own copy (`thawed()`), which is then frozen (`freeze()`): from there on setting an option
raises FrozenConfigError, and the frozen config is what the run uses and saves. `dataclasses.replace(config, ...)`
or `config.thawed(...)` makes a changed copy.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, fields

from grpo.config.choices import (  # noqa: F401 (the qlora constants are also read from here)
    AGGREGATIONS, BITSANDBYTES_BLOCK_SCALE, BITSANDBYTES_BLOCK_SIZE, DEFAULT_BLOCK_SCALE, DEFAULT_BLOCK_SIZE,
    DEFAULT_SPLIT_RATIO, EMBEDDED_MODEL, IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, QLORA_BLOCK_SCALES,
    QLORA_BLOCK_SIZES, QLORA_INITS, QLORA_QUANT_TYPES, REWARD_SCALES, ROLLOUT_ENGINES, ROLLOUT_MODES,
    ROLLOUT_WEIGHTS, SCHEDULERS, STOCK_4BIT_OPTIONS, STRATEGIES)
from grpo.config.derived import DerivedOptions
from grpo.config.guide_spellings import GUIDE_SPELLINGS, fold_guide_spellings, upgrade_saved_options  # noqa: F401
from grpo.config.sections.algorithm import AlgorithmOptions
from grpo.config.sections.data import MIN_DEFAULT_SEQ_LENGTH, DataOptions, names
from grpo.config.sections.distributed import DistributedOptions
from grpo.config.sections.guide import GuideSpellings
from grpo.config.sections.logging import LoggingOptions, tracker_names
from grpo.config.sections.model import ModelOptions
from grpo.config.sections.option import groups_of
from grpo.config.sections.optimization import OptimizationOptions, token_budget
from grpo.config.sections.rollout import RolloutOptions
from grpo.config.sections.tools import ToolOptions
from grpo.config.shipped import resolve_shipped_file
from grpo.config.strategy import Strategy
from grpo.config.validation import validate

DEFAULT_LEARNING_RATE = {Strategy.LORA: 2e-5, Strategy.QLORA: 2e-5, Strategy.FULL: 1e-6}
__all__ = ["GRPOConfig", "FLAG_GROUPS", "FrozenConfigError", "MIN_DEFAULT_SEQ_LENGTH", "DEFAULT_LEARNING_RATE"]


class FrozenConfigError(dataclasses.FrozenInstanceError):
    """An option set on a config after the run resolved it (GRPOConfig.freeze)."""


# the sections, in the order their options are listed (dataclass fields of the bases come last base first)
@dataclass
class GRPOConfig(GuideSpellings, DistributedOptions, LoggingOptions, ToolOptions, RolloutOptions, AlgorithmOptions,
                 OptimizationOptions, DataOptions, ModelOptions, DerivedOptions):
    # not an option: the saved grpo_config.json a resume took its options from (from_run, train_grpo.py), else None
    resumes_saved_options = None
    _frozen = False  # set by freeze(): the options as the run resolved them, read-only from then on

    @classmethod
    def from_run(cls, output_dir: str, checkpoint: str = "latest", **overrides) -> "GRPOConfig":
        """The options to continue the run in `output_dir` from `checkpoint` ('latest' or a checkpoint folder):
        those saved with that checkpoint, with `overrides` on top (GRPOTrainer lists each one that differs).
        `GRPOConfig.from_run("outputs/run1", max_steps=400)` continues run1 as `train_grpo.py --output_dir
        outputs/run1 --resume_from_checkpoint latest --max_steps 400` does."""
        from grpo.config.saved import config_from_run

        return config_from_run(cls, output_dir, checkpoint, overrides)

    def __post_init__(self):
        self._take_forms()
        fold_guide_spellings(self)
        if self.max_seq_length is None:
            self.max_seq_length = max(MIN_DEFAULT_SEQ_LENGTH, self.max_prompt_length + self.rollout_max_new_tokens)
        # a file missing here and among the shipped ones stays as given: reading it says so, before any model loads
        self.dataset_config_path = resolve_shipped_file(self.dataset_config_path, "dataset_config_path", strict=False)
        self.deepspeed = resolve_shipped_file(self.deepspeed, "deepspeed", strict=False)
        if self.clip_epsilon_high is None:
            self.clip_epsilon_high = self.clip_epsilon_low
        if self.learning_rate is None:
            self.learning_rate = DEFAULT_LEARNING_RATE.get(self.tuning_strategy, DEFAULT_LEARNING_RATE[Strategy.LORA])
        self.validate()

    def _take_forms(self) -> None:
        """Options given as text take their form: lists of names (space and/or comma separated), a number of tokens
        (from the command line), tracker names."""
        self.dataset_names = names(self.dataset_names)
        self.eval_dataset_names = names(self.eval_dataset_names)
        self.warm_start_datasets = names(self.warm_start_datasets)
        self.reward_model = names(self.reward_model)
        self.max_tokens_per_micro_batch = token_budget(self.max_tokens_per_micro_batch)
        self.report_to = tracker_names(self.report_to)

    def validate(self) -> None:
        validate(self)

    # --- resolution and freezing --------------------------------------------------------------------
    def __setattr__(self, name, value):
        if self._frozen:
            raise FrozenConfigError(
                f"GRPOConfig is frozen: the run resolved its options once and saves them as they are, so "
                f"{name} cannot be set now; make a changed copy with dataclasses.replace(config, {name}=...) or "
                f"config.thawed({name}=...)")
        object.__setattr__(self, name, value)

    def resolve(self, **values) -> "GRPOConfig":
        """Set options a run resolved after construction (from the machine, the model, the data or the memory
        plan), before it freezes them; the options are checked again. Returns the config."""
        unknown = sorted(set(values) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"GRPOConfig.resolve: {', '.join(unknown)} is no option")
        for name, value in values.items():
            setattr(self, name, value)
        self._take_forms()
        self.validate()
        return self

    def freeze(self) -> "GRPOConfig":
        """Make the options read-only (setting one raises FrozenConfigError): the run's resolved options, as it
        uses and saves them. Returns the config."""
        object.__setattr__(self, "_frozen", True)
        return self

    @property
    def frozen(self) -> bool:
        return self._frozen

    def thawed(self, **values) -> "GRPOConfig":
        """A copy that can be changed (and resolved), with `values` set and checked; this config stays as it is."""
        thawed = copy.deepcopy(self)
        object.__setattr__(thawed, "_frozen", False)
        return thawed.resolve(**values) if values else thawed

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2)


FLAG_GROUPS: dict[str, str] = groups_of(GRPOConfig)
