"""Values derived from GRPOConfig's options (the defaults that depend on other options, parsed forms of string
options): read-only properties, kept apart from the schema in options.py."""
from __future__ import annotations

from grpo.config.choices import BITSANDBYTES_BLOCK_SCALE, BITSANDBYTES_BLOCK_SIZE, DEFAULT_SPLIT_RATIO, REGEX_CHARS
from grpo.config.strategy import Strategy
from grpo.errors import ConfigError


class DerivedOptions:
    """GRPOConfig's derived values; every attribute read here is one of its options."""

    @property
    def strategy(self) -> Strategy:
        """--tuning_strategy as its type (grpo/config/strategy.py): what is trained, and what that implies."""
        return Strategy.of(self.tuning_strategy)

    @property
    def qlora_skip_list(self) -> list[str]:
        return [m.strip() for m in (self.qlora_skip_modules or "").split(",") if m.strip()]

    @property
    def qlora_requantizing_options(self) -> list[str]:
        """The options (given or default) for which the 4-bit base is quantized again from the checkpoint after
        loading: those that differ from bitsandbytes' stock base."""
        options = []
        if self.strategy.four_bit_base and self.qlora_block_size != BITSANDBYTES_BLOCK_SIZE:
            options.append(f"--qlora_block_size {self.qlora_block_size}")
        if self.strategy.four_bit_base and self.qlora_block_scale != BITSANDBYTES_BLOCK_SCALE:
            options.append(f"--qlora_block_scale {self.qlora_block_scale}")
        return options

    @property
    def kl_loss_coef(self) -> float:
        """The beta of the loss's KL term (0 when the penalty is off or goes into the reward)."""
        return 0.0 if self.kl_in_reward else self.kl_beta

    @property
    def effective_train_split_ratio(self) -> float:
        """--train_split_ratio as given; unset, no split when eval datasets are named, else the default."""
        if self.train_split_ratio is not None:
            return self.train_split_ratio
        return 1.0 if self.eval_dataset_names else DEFAULT_SPLIT_RATIO

    @property
    def lora_exclude(self):
        """--lora_exclude_modules as peft's LoraConfig(exclude_modules=...) takes it: a regex string (matched
        against full module names) when the value has regex characters, else a list of names; None when unset."""
        value = (self.lora_exclude_modules or "").strip()
        if not value:
            return None
        if set(value) & REGEX_CHARS:
            return value
        return [m.strip() for m in value.split(",") if m.strip()]

    @property
    def uses_lora(self) -> bool:
        return self.strategy.has_adapter

    @property
    def vllm_memory_share(self) -> float:
        """--vllm_gpu_memory_utilization as given, or the default for the mode."""
        if self.vllm_gpu_memory_utilization is not None:
            return self.vllm_gpu_memory_utilization
        return 0.85 if self.rollout_mode == "server" else 0.3

    @property
    def vllm_kv_cache(self) -> str | float:
        """--vllm_kv_cache_gib as 'auto', 'share' or GiB (a float), with the default for the mode."""
        value = self.vllm_kv_cache_gib
        if value is None:
            return "share" if self.rollout_mode == "server" else "auto"
        if str(value).strip().lower() in ("auto", "share"):
            return str(value).strip().lower()
        try:
            gib = float(value)
        except (TypeError, ValueError):
            gib = 0.0
        if not 0.001 <= gib < float("inf"):
            raise ConfigError(f"--vllm_kv_cache_gib: got '{value}'; give auto, share or a number of GiB of at least "
                              "0.001 (e.g. 4)")
        return gib

    @property
    def rollout_staleness(self) -> int:
        """How many steps' rollouts stream ahead of training (server mode): --max_staleness, or 1 for --async_rollout,
        0 when every step generates its own rollouts."""
        if self.max_staleness is not None:
            return self.max_staleness
        return 1 if self.async_rollout else 0

    @property
    def is_correction(self) -> bool:
        """--rollout_is_correction as given, or on by default exactly when the rollouts are steps behind."""
        return self.rollout_staleness >= 1 if self.rollout_is_correction is None else self.rollout_is_correction

    @property
    def episode_token_budget(self) -> int:
        """--max_episode_tokens as given, or what --max_seq_length leaves after the prompt."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return self.max_seq_length - self.max_prompt_length

    @property
    def uses_vllm(self) -> bool:
        return self.rollout_engine == "vllm"
