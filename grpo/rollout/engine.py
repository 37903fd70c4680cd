"""The rollout-engine protocol shared by the HF engine (CPU, fallback) and the colocated vLLM engine.

Engines work on token ids (plus, for vision-language models, each prompt's images); the trainer owns
tokenization, chat templates and image processing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

import torch


@dataclass
class SamplingSettings:
    n: int                      # completions per prompt
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    logprobs: bool = True       # return the sampled tokens' log-probs (vLLM computes them only when asked)


@dataclass
class Completion:
    prompt_index: int           # which prompt of the generate() call this completes
    token_ids: list[int]        # includes the stop token when finish_reason == "stop"
    logprobs: list[float]       # log-prob of each token under softmax(logits / temperature), no top-p renormalising;
                                # empty when the sampling settings did not ask for them
    finish_reason: str          # "stop" | "length"


class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings,
                 images: Optional[list] = None) -> list[Completion]:
        """Completions ordered prompt by prompt: prompt 0's n completions, then prompt 1's, ...

        `images` (vision-language models): per prompt, a grpo.model.vision.PromptImages or None (a text prompt).
        """

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights by these (HF checkpoint names)."""

    def sleep(self, keep_weights: bool = False) -> None:
        """Release memory while the trainer runs; `keep_weights`: no sync follows, so the weights must survive."""

    def wake(self) -> None:
        """Take memory back before the next rollout."""
