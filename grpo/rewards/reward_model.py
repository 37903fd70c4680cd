"""Reward models: a sequence-classification model (one logit) scores prompt + completion, as a registered reward.

`--reward_model path/to/my_rm` registers the reward `my_rm` (the folder's name), usable in dataset_config.json's
"rewards" with a weight like any other. The model's own tokenizer and chat template render the conversation
(the prompt's messages, then the completion as the assistant's turn); it runs batched, without gradients, on the
rank's device (bf16 on GPU), loaded on first use. A model whose attention logits are soft-capped (a Gemma 2 reward
model) loads with the attention its caller names for its config (grpo.model.attention: torch's SDPA kernels would
drop the cap and score with another model).
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Sequence

import torch

from grpo.config.validation import reward_model_name
from grpo.errors import ConfigError
from grpo.rewards.registry import register_reward

logger = logging.getLogger("grpo")


class RewardModel:
    """A batched reward function backed by a sequence-classification model with a single output (num_labels=1)."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype = torch.float32, batch_size: int = 16,
                 max_length: Optional[int] = None, trust_remote_code: bool = False,
                 attention: Optional[Callable[[object], Optional[str]]] = None):
        from transformers import AutoConfig

        self.path, self.device, self.dtype, self.batch_size = path, torch.device(device), dtype, batch_size
        self.max_length, self.trust_remote_code = max_length, trust_remote_code
        self.__name__ = reward_model_name(path)
        if not os.path.isdir(path):
            raise ConfigError(f"--reward_model: {path} is not a model folder")
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--reward_model {path}: cannot read its config.json ({exc})") from exc
        architectures = list(getattr(config, "architectures", None) or [])
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ConfigError(f"--reward_model {path}: not a sequence-classification model (architectures: "
                              f"{', '.join(architectures) or 'none'}); a reward model needs a classification head "
                              f"with one output, saved with AutoModelForSequenceClassification(num_labels=1)")
        if config.num_labels != 1:
            raise ConfigError(f"--reward_model {path}: the classification head has {config.num_labels} outputs; a "
                              f"reward model must have exactly one (num_labels=1), its score")
        # the attention to load with where transformers' default would compute another model, else None
        self.attention = attention(config) if attention is not None else None
        self.model = None
        self.tokenizer = None

    def load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        kwargs = {"attn_implementation": self.attention} if self.attention else {}
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.path, dtype=self.dtype, trust_remote_code=self.trust_remote_code, **kwargs).to(self.device).eval()
        self.model.requires_grad_(False)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        attention = f", attention {self.attention}" if self.attention else ""
        logger.info(f"reward model '{self.__name__}' loaded from {self.path} ({self.dtype}, {self.device}{attention})")

    def render(self, completion: str, prompt: str, messages) -> str:
        """The conversation as the reward model's chat template writes it (plain prompt + completion without one)."""
        if not (isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                   for m in messages)):
            messages = [{"role": "user", "content": prompt}]  # e.g. image prompts: the rendered text
        conversation = [*messages, {"role": "assistant", "content": completion}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(conversation, tokenize=False)
        return "\n\n".join(m["content"] for m in conversation)

    @torch.no_grad()
    def __call__(self, completions: list[str], answers: list, prompts: Optional[list[str]] = None,
                 prompt_messages: Optional[list] = None, **_) -> list[float]:
        if self.model is None:
            self.load()
        prompts = prompts or [""] * len(completions)
        prompt_messages = prompt_messages or [None] * len(completions)
        texts = [self.render(c, p, m) for c, p, m in zip(completions, prompts, prompt_messages)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start:start + self.batch_size], padding=True, return_tensors="pt",
                                 add_special_tokens=False, truncation=self.max_length is not None,
                                 max_length=self.max_length).to(self.device)
            scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores


def register_reward_models(paths: Sequence[str], device, dtype: torch.dtype = torch.float32,
                           trust_remote_code: bool = False,
                           attention: Optional[Callable[[object], Optional[str]]] = None) -> list[RewardModel]:
    """Check each folder now (a classification head with one output) and register it under its folder name;
    `attention(config)`: the attention implementation a model must load with, or None for transformers' default."""
    models = [RewardModel(path, device, dtype, trust_remote_code=trust_remote_code, attention=attention)
              for path in paths]
    for rm in models:
        register_reward(rm.__name__)(rm)
    return models
