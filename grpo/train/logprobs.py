"""Trainer-side log-probs of rollout completions (policy, old policy or reference).

Two ways through the model:
- hidden states (default where possible): the decoder yields final hidden states, the output layer is applied
  `chunk_tokens` completion positions at a time (`algorithm.hidden_token_logprobs`), so no [N, T, V] logits tensor
  exists, neither in the forward nor in the backward. Optionally padding-free: a micro-batch's sequences are packed
  into one row with per-sequence position ids, which transformers turns into a block-diagonal causal mask (SDPA,
  eager) or varlen flash attention.
  A vision-language model takes the same path through its multimodal body (image features merged into the token
  embeddings, multimodal rope positions), whose last hidden states its output layer turns into logits as for text.
  A final logit soft-cap (Gemma 2: cap tanh(head(h) / cap)) is applied to each chunk's logits (SoftCappedHead).
- logits (fallback): the model's own forward with `logits_to_keep`, for models whose output layer is not a plain
  function of the last hidden state (logit scaling), and chunk_tokens=0.
"""
from __future__ import annotations

from typing import Optional

import torch

from grpo.algorithm import hidden_token_logprobs, token_entropy, token_logprobs
from grpo.memory.activations import logit_soft_cap, logits_transformed
from grpo.train.step_data import RolloutBatch, position_ids_for


def forward_inputs(model, batch: RolloutBatch) -> dict:
    """The keyword arguments of the model's forward for the batch's rows: ids, mask and positions, and a
    vision-language prompt's pixels."""
    kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    image_inputs = batch.image_inputs(batch.input_ids.device)
    if image_inputs:
        from grpo.model.vision import image_token_types

        # the model derives its (multimodal rope) positions from the attention mask
        kwargs.update(image_inputs, **image_token_types(model, batch.input_ids, batch.images_token_id))
    else:
        kwargs["position_ids"] = position_ids_for(batch.attention_mask)
    return kwargs


def completion_logits(model, batch: RolloutBatch) -> torch.Tensor:
    """Logits that predict each completion token  # [N, T, V]."""
    width = batch.completion_width
    kwargs = forward_inputs(model, batch)
    try:
        # only the last T+1 positions: the prompt's logits are never materialised
        logits = model(**kwargs, logits_to_keep=width + 1).logits
    except TypeError:  # models without logits_to_keep
        logits = model(**kwargs).logits
    return logits[:, -(width + 1):-1, :]


class SoftCappedHead(torch.nn.Module):
    """The output layer followed by the model's final soft-cap:  z = cap tanh(head(h) / cap)."""

    def __init__(self, head: torch.nn.Module, cap: float):
        super().__init__()
        self.head, self.cap = head, float(cap)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cap * torch.tanh(self.head(hidden) / self.cap)


def _capped(head, config):
    cap = logit_soft_cap(config)
    return SoftCappedHead(head, cap) if cap else head


def _transformers_model(model):
    module = getattr(model, "module", model)                       # DeepSpeed engine -> model
    return module.get_base_model() if hasattr(module, "get_base_model") else module   # peft -> transformers model


def decoder_and_head(model):
    """(decoder, output layer) of a causal LM, seen through DeepSpeed and peft wrappers; None where logits are not
    head(last hidden state) or the parts cannot be found, and for vision-language models (vision_body_and_head)."""
    base = _transformers_model(model)
    config = getattr(base, "config", None)
    if config is None or logits_transformed(config):
        return None
    if getattr(config, "vision_config", None) is not None:
        return None
    get_decoder, get_head = getattr(base, "get_decoder", None), getattr(base, "get_output_embeddings", None)
    try:
        decoder, head = (get_decoder() if get_decoder else None), (get_head() if get_head else None)
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None or decoder is base:
        return None
    return decoder, _capped(head, config)


def vision_body_and_head(model):
    """(multimodal body, output layer) of a vision-language model (Qwen2-VL, Qwen2.5-VL), seen through DeepSpeed and
    peft wrappers: the body merges the image features into the token embeddings, derives the multimodal rope positions
    and returns the last hidden states, which the output layer turns into the logits. None for text models, where
    logits are not head(hidden), or where the parts cannot be found."""
    base = _transformers_model(model)
    config = getattr(base, "config", None)
    if config is None or getattr(config, "vision_config", None) is None or logits_transformed(config):
        return None
    body, get_head = getattr(base, "model", None), getattr(base, "get_output_embeddings", None)
    head = get_head() if get_head else None
    if not isinstance(body, torch.nn.Module) or head is None:
        return None
    return body, _capped(head, config)


def hidden_state_path(model) -> bool:
    """Whether the model's log-probs can come from its last hidden states, a chunk of the output layer at a time."""
    return decoder_and_head(model) is not None or vision_body_and_head(model) is not None


def _padded_hidden(decoder, batch: RolloutBatch, inputs: Optional[dict] = None) -> torch.Tensor:
    """Hidden states that predict each real completion token, in row order  # [M, H]. `inputs`: the forward's
    arguments where they are not only the rows' ids, mask and positions (a vision-language model's pixels)."""
    width = batch.completion_width
    if inputs is None:
        inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=position_ids_for(batch.attention_mask), use_cache=False)
    hidden = decoder(**inputs).last_hidden_state
    predicting = hidden[:, -(width + 1):-1, :]                                       # [N, T, H]
    real = batch.attention_mask[:, -width:].bool()                                   # [N, T]
    return predicting[real]                                                          # [M, H]


def pack_rows(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' real tokens (prompt + completion, no padding) laid end to end in one row.

    Returns input_ids [1, L], position_ids [1, L] (0, 1, ... restarting at every sequence), and for every real
    completion token, in row order, the packed position whose hidden state predicts it [M].
    """
    width = batch.completion_width
    mask = batch.attention_mask.bool()                                               # [N, P+T]
    lengths = mask.sum(1)                                                            # [N]
    prompt_lengths = mask[:, :-width].sum(1)                                         # [N]
    ids = batch.input_ids[mask].unsqueeze(0)                                         # [1, L] (row-major order)
    starts = torch.cumsum(lengths, 0) - lengths                                      # [N]
    positions = torch.arange(ids.shape[1], device=ids.device) - torch.repeat_interleave(starts, lengths)
    completion_lengths = lengths - prompt_lengths                                    # [N]
    row_of = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), completion_lengths)  # [M]
    offset_in_completion = torch.arange(len(row_of), device=ids.device) - \
        torch.repeat_interleave(torch.cumsum(completion_lengths, 0) - completion_lengths, completion_lengths)
    predicting = starts[row_of] + prompt_lengths[row_of] - 1 + offset_in_completion  # [M]
    return ids, positions.unsqueeze(0), predicting


def _packed_hidden(decoder, batch: RolloutBatch) -> torch.Tensor:
    ids, positions, predicting = pack_rows(batch)
    hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state  # [1, L, H]
    return hidden[0, predicting]                                                                  # [M, H]


def completion_logprobs(model, batch: RolloutBatch, temperature: float, with_entropy: bool = False,
                        chunk_tokens: int = 1024, packed: bool = False, entropy_grad: bool = False
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(token) under softmax(logits / temperature)  # [N, T]; optionally token entropy  # [N, T], with
    gradient when `entropy_grad` (an entropy bonus in the loss).

    Positions past a row's completion hold 0. `chunk_tokens` > 0 takes the hidden-state path where the model
    allows it (output layer applied per chunk of completion tokens); `packed` also drops the padding.
    """
    real = batch.attention_mask[:, -batch.completion_width:].bool()                           # [N, T]
    # (rows without any completion token take the logits path: its graph reaches every trained parameter)
    chunked = chunk_tokens > 0 and bool(real.any())
    vision = vision_body_and_head(model) if chunked else None
    parts = vision or (decoder_and_head(model) if chunked else None)
    if parts is None:
        logits = completion_logits(model, batch)
        logprobs = token_logprobs(logits, batch.completion_ids, temperature=temperature)
        entropy = None
        if with_entropy:
            entropy = token_entropy(logits if entropy_grad else logits.detach(), temperature=temperature,
                                    with_grad=entropy_grad)
        keep = real.to(logprobs.dtype)
        return logprobs * keep, (entropy * keep if entropy is not None else None)
    decoder, head = parts
    if vision:  # padded rows: the body finds each row's images and rope positions by its tokens and mask
        hidden = _padded_hidden(decoder, batch, forward_inputs(model, batch))                  # [M, H]
    else:
        hidden = _packed_hidden(decoder, batch) if packed else _padded_hidden(decoder, batch)  # [M, H]
    flat, flat_entropy = hidden_token_logprobs(hidden, head, batch.completion_ids[real], temperature,
                                               chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                                               entropy_grad=entropy_grad)                             # [M]
    logprobs = torch.zeros(real.shape, dtype=flat.dtype, device=flat.device).masked_scatter(real, flat)  # [N, T]
    entropy = None
    if with_entropy:
        entropy = torch.zeros(real.shape, dtype=flat.dtype, device=flat.device).masked_scatter(real, flat_entropy)
    return logprobs, entropy
