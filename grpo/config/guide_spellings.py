"""The guide's spellings of options that were merged into others.

The GRPO guide users start from launches with `--learning_rate_lora 2e-6`, bare `--use_kl_penalty --kl_beta 0.1`,
bare `--use_vllm_rollout` (and older runs with `--vllm_mode`). Each stays an option of GRPOConfig, so flags,
`--config` JSON, `GRPOConfig(...)` and saved runs all take it; at construction it is folded into today's option and
then cleared, so a config holds each setting once (and `dataclasses.replace` on it cannot bring the old value back).
"""
from __future__ import annotations

from grpo.config.strategy import Strategy
from grpo.errors import ConfigError

# the KL coefficient of the guide's `--use_kl_penalty` when no --kl_beta is given (GRPO's original value)
GUIDE_KL_BETA = 0.04

# guide spelling -> the option it sets (shown in --help and docs/flags.md)
GUIDE_SPELLINGS = {
    "learning_rate_lora": "--learning_rate, for lora and qlora (full fine-tuning keeps --learning_rate)",
    "use_kl_penalty": f"--kl_beta: on keeps a given --kl_beta (else {GUIDE_KL_BETA}), off sets it to 0",
    "use_vllm_rollout": "--rollout_engine vllm (false: hf)",
    "vllm_mode": "--rollout_mode",
}
# the guide's on/off switches: given bare, they are on
GUIDE_SWITCHES = ("use_kl_penalty", "use_vllm_rollout")


def check_guide_spellings_agree(given: dict) -> None:
    """Raises ConfigError where a guide spelling and today's option are both given (flags or --config) and say
    different things, e.g. `--use_vllm_rollout --rollout_engine hf`: neither would be the silent winner. (The guide's
    `--use_kl_penalty false` with its `--kl_beta 0.1` is no clash: the switch turns the term off, whatever its beta.)"""
    def clash(guide: str, today: str, meant: str) -> None:
        raise ConfigError(f"--{guide} {str(given[guide]).lower()} and --{today} {given[today]} disagree (the first "
                          f"means {meant}): give one of them")

    if given.get("use_vllm_rollout") is not None and given.get("rollout_engine") is not None:
        engine = "vllm" if given["use_vllm_rollout"] else "hf"
        if given["rollout_engine"] != engine:
            clash("use_vllm_rollout", "rollout_engine", f"--rollout_engine {engine}")
    if given.get("vllm_mode") is not None and given.get("rollout_mode") is not None \
            and given["vllm_mode"] != given["rollout_mode"]:
        clash("vllm_mode", "rollout_mode", f"--rollout_mode {given['vllm_mode']}")


def fold_guide_spellings(cfg) -> None:
    """Today's options set from the guide's spellings given on `cfg`, which are then cleared (None).

    --learning_rate_lora applies to lora / qlora, as in the guide, where --learning_rate was full fine-tuning's rate.
    --use_kl_penalty with no --kl_beta takes GUIDE_KL_BETA; --use_kl_penalty false turns the KL term off.
    """
    if cfg.learning_rate_lora is not None and cfg.strategy.has_adapter:
        cfg.learning_rate = cfg.learning_rate_lora
    if cfg.use_kl_penalty is not None:
        if not cfg.use_kl_penalty:
            cfg.kl_beta = 0.0
        elif not cfg.kl_beta:
            cfg.kl_beta = GUIDE_KL_BETA
    if cfg.use_vllm_rollout is not None:
        cfg.rollout_engine = "vllm" if cfg.use_vllm_rollout else "hf"
    if cfg.vllm_mode is not None:
        cfg.rollout_mode = cfg.vllm_mode
    for name in GUIDE_SPELLINGS:
        setattr(cfg, name, None)


def upgrade_saved_options(values: dict) -> dict:
    """A run's saved grpo_config.json in today's option names (runs saved before the options were merged hold the
    guide's spellings with values; newer ones hold them as null)."""
    values = dict(values)
    if values.get("use_kl_penalty") is not None:
        if not values["use_kl_penalty"]:
            values["kl_beta"] = 0.0
    if values.get("learning_rate_lora") is not None:
        strategy = Strategy.read(values.get("tuning_strategy", Strategy.LORA))
        if strategy is not None and strategy.has_adapter:
            values["learning_rate"] = values["learning_rate_lora"]
    if values.get("use_vllm_rollout") is not None:
        values["rollout_engine"] = "vllm" if values["use_vllm_rollout"] else "hf"
    if values.get("vllm_mode") is not None:
        values["rollout_mode"] = values["vllm_mode"]
    for name in GUIDE_SPELLINGS:
        values.pop(name, None)
    return values
