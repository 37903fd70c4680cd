"""What a run trains (--tuning_strategy), resolved once into a type that answers what the rest of the library asks of
it. The flag and its three names are a contract (the guide's launch command, saved runs); everywhere else a strategy
is a `Strategy`, read from the config as `config.strategy`.

    qlora  the base quantized to 4 bits (bitsandbytes), frozen; a LoRA adapter trains on it
    lora   the base in 16 bits, frozen; a LoRA adapter trains on it
    full   every weight trains

The KL reference follows: with an adapter it is the policy with its adapter switched off (no extra memory); full
fine-tuning keeps a frozen copy of the model (only when the KL term is on).
"""
from __future__ import annotations

from enum import Enum
from typing import Optional

from grpo.errors import ConfigError


class Strategy(str, Enum):
    """A --tuning_strategy; equal to its name as a string (so saved runs and JSON keep the name)."""
    QLORA = "qlora"
    LORA = "lora"
    FULL = "full"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def has_adapter(self) -> bool:
        """A LoRA adapter trains on a frozen base (lora, qlora)."""
        return self is not Strategy.FULL

    @property
    def four_bit_base(self) -> bool:
        """The frozen base is quantized to 4 bits (qlora)."""
        return self is Strategy.QLORA

    @property
    def sixteen_bit_adapter(self) -> bool:
        """An adapter on a 16-bit base (lora): a base vLLM can share with the trainer and merge into in place."""
        return self is Strategy.LORA

    @property
    def reference_is_copy(self) -> bool:
        """The KL reference is a frozen copy of the model (full); with an adapter it is the policy with the adapter
        switched off."""
        return self is Strategy.FULL

    @classmethod
    def of(cls, value) -> "Strategy":
        """`value` (a Strategy, or its name as the flag and saved runs spell it) as a Strategy; any other value is a
        ConfigError naming the flag."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"--tuning_strategy: got '{value}', choose one of {', '.join(STRATEGIES)}") from None

    @classmethod
    def read(cls, value) -> Optional["Strategy"]:
        """A strategy as a saved file (or a dict of settings) holds it, or None where it holds none (or another
        word)."""
        try:
            return cls(value)
        except ValueError:
            return None


# --tuning_strategy's choices, in the order --help lists them
STRATEGIES = tuple(strategy.value for strategy in Strategy)
