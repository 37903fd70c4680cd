"""Options that were merged into others: their old names are refused with the name to use instead (on the command
line, in --config JSON and in GRPOConfig(...)), and a run saved under them resumes with the options it had."""
from __future__ import annotations

import functools

from grpo.errors import ConfigError

# merged options: old name -> what to pass instead (the old name is an error that says so)
RENAMED_OPTIONS = {
    "use_vllm_rollout": "--rollout_engine vllm",
    "vllm_mode": "--rollout_mode (colocate or server)",
    "learning_rate_lora": "--learning_rate (one flag for every strategy; its default depends on the strategy)",
    "use_kl_penalty": "--kl_beta with a value > 0 (0, the default, means no KL term)",
}


def upgrade_saved_options(values: dict) -> dict:
    """A run's saved grpo_config.json in today's option names: runs saved before options were merged resume with
    the options they had."""
    values = dict(values)
    if "use_kl_penalty" in values:
        if not values.pop("use_kl_penalty"):
            values["kl_beta"] = 0.0
    if "learning_rate_lora" in values:
        lora_rate = values.pop("learning_rate_lora")
        if values.get("tuning_strategy", "lora") in ("lora", "qlora"):
            values["learning_rate"] = lora_rate
    if "use_vllm_rollout" in values:
        values["rollout_engine"] = "vllm" if values.pop("use_vllm_rollout") else "hf"
    if "vllm_mode" in values:
        values["rollout_mode"] = values.pop("vllm_mode")
    return values


def refusing_old_names(init):
    """GRPOConfig's __init__, refusing a merged option's old name with the name to use instead."""
    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        for name in kwargs:
            if name in RENAMED_OPTIONS:
                raise ConfigError(f"GRPOConfig({name}=...): {name} was merged into another option; use "
                                  f"{RENAMED_OPTIONS[name]}")
        init(self, *args, **kwargs)
    return checked_init
