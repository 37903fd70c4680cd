"""Trainer-side log-probs of rollout completions (policy, old policy or reference)."""
from __future__ import annotations

from typing import Optional

import torch

from .algorithm import token_entropy, token_logprobs
from .batch import RolloutBatch, position_ids_for


def completion_logits(model, batch: RolloutBatch) -> torch.Tensor:
    """Logits that predict each completion token  # [N, T, V]."""
    width = batch.completion_width
    kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    image_inputs = batch.image_inputs(batch.input_ids.device)
    if image_inputs:
        from .vision import image_token_types

        kwargs.update(image_inputs, **image_token_types(model, batch.input_ids, batch.images_token_id))  # the model derives its (multimodal rope) positions from the attention mask
    else:
        kwargs["position_ids"] = position_ids_for(batch.attention_mask)
    try:
        # only the last T+1 positions: the prompt's logits are never materialised
        logits = model(**kwargs, logits_to_keep=width + 1).logits
    except TypeError:  # models without logits_to_keep
        logits = model(**kwargs).logits
    return logits[:, -(width + 1):-1, :]


def completion_logprobs(model, batch: RolloutBatch, temperature: float, with_entropy: bool = False,
                        entropy_grad: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(token) under softmax(logits / temperature)  # [N, T]; optionally token entropy  # [N, T], with
    gradient when `entropy_grad` (an entropy bonus in the loss)."""
    logits = completion_logits(model, batch)
    logprobs = token_logprobs(logits, batch.completion_ids, temperature=temperature)
    entropy = None
    if with_entropy:
        entropy = token_entropy(logits if entropy_grad else logits.detach(), temperature=temperature,
                                with_grad=entropy_grad)
    return logprobs, entropy
