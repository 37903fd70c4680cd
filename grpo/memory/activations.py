"""Training memory per token of a micro-batch, from the model's shape: the activations a forward keeps for its
backward, what one layer's backward holds for a while, and the log-prob chunk's logits (equations beside each
function). The memory plan (grpo.memory.plan) sizes the micro-batch token budget from them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from grpo.config.choices import MICRO_BATCH_TOKENS
from grpo.model.attention import QUERY_BLOCK, SOFT_CAPPED, attention_implementation
from grpo.model.routing_replay import replay_family, routing_shape

GIB, MIB = 2**30, 2**20
BUDGET_STEP = 1024
MIN_CHUNK_TOKENS = 128  # the smallest log-prob chunk auto shrinks --logprob_chunk_tokens to
# What the equation leaves out (allocator fragmentation, fused kernels' temporaries), on top of it. The equation was
# checked against three measured runs: Qwen2.5-1.5B's shape, lora, checkpointing, 16384 tokens: 4.4 GiB of
# activations measured (benchmarks/train_memory.py), 4.7 estimated; a 0.68B Llama, lora, no checkpointing: 22.5
# measured, 28 estimated. The margin is set on Qwen2.5-7B's shape, qlora, checkpointing, bf16 activations, one H100
# with expandable segments (benchmarks/RESULTS.md, 2026-11-26 evening): --gpu_memory_gib 16 ran 6144 tokens (15.88 GiB
# for the whole process); --gpu_memory_gib 15 ran out of memory at 5120, which 1.25 had picked from 4.4 GiB of room:
# the first update held 4.8 GiB beyond the model, and 0.76 GiB more sat reserved and unused. 1.5 picks 4096 there.
ESTIMATE_MARGIN = 1.5
# config attributes of models whose logits are not head(hidden): they take the full-logits path
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


SOFT_CAP = "final_logit_softcapping"  # logits = cap tanh(head(h) / cap): the chunked path applies it itself


def logits_transformed(config) -> bool:
    """Whether the model's logits are more than head(last hidden state), or its soft-cap (scaling): then no chunked
    log-probs from hidden states."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(getattr(c, name, None) not in (None, 1.0) for c in (config, text) for name in LOGIT_TRANSFORMS
               if name != SOFT_CAP)


def logit_soft_cap(config) -> float | None:
    """The model's final logit soft-cap (Gemma 2), or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, SOFT_CAP, None) or getattr(config, SOFT_CAP, None)


@dataclass(frozen=True)
class ModelShape:
    hidden: int          # H
    intermediate: int    # I (the MLP's width; routed experts x their width for a mixture of experts)
    layers: int          # L
    q_dim: int           # attention heads x head_dim
    vocab: int           # V
    routed_picks: int = 0  # R: a replayed mixture of experts' picks per token (layers x top_k), else 0
    score_heads: int = 0   # N: attention heads whose scores the eager computation materializes (soft-capped
                           # attention logits: grpo.model.attention), else 0 (SDPA keeps none)
    capped_logits: bool = False  # a final logit soft-cap (Gemma 2), applied to each log-prob chunk


def model_shape(model_config) -> ModelShape:
    """The decoder's shape from a transformers config (a vision-language model's text config)."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    routed = (getattr(cfg, "num_experts_per_tok", None) or 0) * (getattr(cfg, "moe_intermediate_size", None) or 0)
    intermediate = max(getattr(cfg, "intermediate_size", None) or 4 * hidden, routed)
    # --routing_replay's default for these models: the micro-batch's routing array rides along
    picks = math.prod(routing_shape(cfg)) if replay_family(cfg) else 0
    score_heads = heads if attention_implementation(model_config) == SOFT_CAPPED else 0
    return ModelShape(hidden, intermediate, cfg.num_hidden_layers, heads * head_dim, cfg.vocab_size, picks,
                      score_heads, bool(logit_soft_cap(model_config)))


def block_scores_per_token(s: ModelShape, row_tokens: int) -> int:
    """N Q: the scores one block of soft-capped attention holds per token of a micro-batch (0 for SDPA's)."""
    return s.score_heads * min(row_tokens, QUERY_BLOCK)


def eager_gradient_extra(act_bytes: int) -> int:
    """Bytes a score of eager attention adds in a layer's backward beyond the a + 4 of its gradient (docstring
    below): 2 a + 4, fitted to Gemma-2-9B's training peak on an H200 (benchmarks/RESULTS.md, 2026-11-29)."""
    return 2 * act_bytes + 4


def activation_bytes_per_token(s: ModelShape, checkpointing: bool, act_bytes: int, adapter_bytes: int,
                               dropout: bool, full_logits: bool, row_tokens: int = 0) -> tuple[int, int]:
    """(kept, transient): training memory of one token of a micro-batch, in bytes; `kept` lives through the whole
    backward, `transient` only while one layer's backward runs. a = act_bytes (2 for bf16 activations, 4 where the
    residual stream is fp32, as behind fp32 embeddings), b = adapter_bytes (the LoRA input copies' element
    size, fp32 adapters 4; 0 for full fine-tuning), d = 1 with LoRA dropout, else 0; with soft-capped attention
    (N = s.score_heads > 0: grpo.model.attention's eager computation in blocks of QUERY_BLOCK queries, each
    checkpointed) S = row_tokens, the longest row, and Q = min(S, QUERY_BLOCK): one block holds N Q S scores of a row
    of S tokens, N Q per token:

        layer    = 8 H                          two RMSNorms, each keeping its fp32 upcast input
                 + 4 q a                        SDPA's q, k, v (k, v repeated to q's heads) and output
                 + 3 I a                        gate, act(gate), up (their product is down's input)
                 + (b + d)(5 H + q + I)  [lora] each adapter's copy of its input (and dropout's mask): q, k, v,
                                                gate, up read H, o reads q, down reads I
                 + a (2 H + q + I)       [full] the inputs the trained weights need for their gradients
        backward = 4 I a                        one layer's MLP gradients in flight
                 + (3 a + 16) N Q    [soft-cap] one block recomputed in its backward: the scores' tanh output (a),
                                                fp32 softmax (4) and probabilities (a), 8 bytes a score; the score's
                                                gradient (a + 4); the soft-cap's and softmax's gradients beside it
                                                (2 a + 4: eager_gradient_extra): 22 bytes a score in bf16, fitted to
                                                Gemma-2-9B's training with whole rows' scores (S = 4,352, one H200)
        ends     = H (2 a + 4)                  the embedding output, the final norm's fp32 input, the hidden states
                                                kept for the log-prob chunks
                 + 2 a S             [soft-cap] the additive masks, causal and sliding-window, [S, S] a row each
                 + 4 R           [replay]       a mixture of experts' replayed routing: R = layers x top_k int32 picks
        logits   = 14 V  [full logits only]     bf16 logits, an fp32 copy, log-softmax, its gradient (all kept)

        with checkpointing:  kept = L H a + ends (+ logits),   transient = layer + backward
                             (every layer's input kept; one layer recomputed in its backward)
        without:             kept = L layer + ends (+ logits), transient = backward
    """
    H, I, q, a, b = s.hidden, s.intermediate, s.q_dim, act_bytes, adapter_bytes
    layer = 8 * H + 4 * q * a + 3 * I * a
    layer += (b + int(dropout)) * (5 * H + q + I) if b else a * (2 * H + q + I)
    backward, ends = 4 * I * a, H * (2 * a + 4) + (14 * s.vocab if full_logits else 0) + 4 * s.routed_picks
    backward += (8 + (a + 4) + eager_gradient_extra(a)) * block_scores_per_token(s, row_tokens)
    ends += 2 * a * row_tokens if s.score_heads else 0
    if checkpointing:
        return s.layers * H * a + ends, layer + backward
    return s.layers * layer + ends, backward


def expert_fold_bytes(layer_stacks: int, largest_stack: int, layers: int, checkpointing: bool,
                      float_bytes: int) -> int:
    """What LoRA on a mixture of experts' fused expert stacks holds while training, beside the activations (lora and
    qlora alike): peft's ParamWrapper folds each adapted stack into a new  W + s B A  (E 2I H for gate_up_proj, E H I
    for down_proj: `layer_stacks` elements a layer), alive through that layer's forward and backward, and makes one
    stack-sized temporary while folding (qlora: the dequantized W; lora: the delta), `largest_stack` elements:

        with checkpointing:  b (layer_stacks + largest_stack)          one layer recomputed at a time
        without:             b (L layer_stacks + largest_stack)        every layer's folds kept for the backward

    b = float_bytes (2 on bf16). Qwen3-30B-A3B (E 128, I 768, H 2048), checkpointing: 2 (603,979,776 + 402,653,184)
    bytes = 1.875 GiB; without it 54.8 GiB."""
    if not layer_stacks:
        return 0
    return float_bytes * ((1 if checkpointing else layers) * layer_stacks + largest_stack)


def logprob_chunk_bytes(chunk_tokens: int, vocab: int, full_logits: bool, capped_logits: bool = False,
                        act_bytes: int = 2) -> int:
    """One log-prob chunk's logits in the backward, whatever the micro-batch: (20 + a s) c V bytes (s = 1 with a final
    logit soft-cap, a = act_bytes: the head's output, 2 in bf16), at the start of the backward, beside the kept
    activations only; none on the full-logits path (counted per token there):

        20 c V   the chunk's recomputed logits z in fp32 (4; the bf16 head output and the unscaled copy are freed by
                 then), the gradient gather's backward scatters into (4), and logsumexp's backward: z - logsumexp(z)
                 (4), its exp (4), the product with the incoming gradient (4)
      +  a c V   [soft-cap] the cap's tanh output, kept for its backward

    Traced allocation by allocation on CPU (torch's profiler: 20.0 c V with and without temperature or entropy, 22.0
    behind a soft-cap in bf16, 24.0 in fp32; tests/test_logprob_chunk_memory.py); a whole VL pass with one [1,024,
    151,936] chunk rose 3.10 GiB in RSS (21.4 c V, fp32, benchmarks/RESULTS.md). A no-grad pass holds half."""
    return 0 if full_logits else (20 + act_bytes * int(capped_logits)) * chunk_tokens * vocab


def micro_batch_bytes(tokens: int, kept: int, transient: int, chunk: int) -> int:
    """The estimate's peak for a micro-batch of `tokens`:  t kept + max(chunk, t transient)."""
    return tokens * kept + max(chunk, tokens * transient)


def fitted_chunk_tokens(room: int, chunk_tokens: int, chunk: int, kept: int, transient: int) -> tuple[int, int]:
    """(tokens, bytes) of the log-prob chunk, halved (never below MIN_CHUNK_TOKENS) while it is what limits the
    micro-batch. The budget t is the least of 16384, room / (kept + transient) and (room - chunk) / kept; the chunk
    stops binding once  chunk <= room - kept x min(16384, room / (kept + transient)). `room` already divided by
    ESTIMATE_MARGIN."""
    limit = room - kept * min(MICRO_BATCH_TOKENS, room // (kept + transient))
    while chunk_tokens // 2 >= MIN_CHUNK_TOKENS and chunk > limit:
        chunk_tokens, chunk = chunk_tokens // 2, chunk // 2
    return chunk_tokens, chunk


def tokens_that_fit(room: int, kept: int, transient: int, chunk: int) -> int:
    """The most tokens t with  ESTIMATE_MARGIN x micro_batch_bytes(t) <= room  (room in bytes)."""
    room = max(room, 0) / ESTIMATE_MARGIN
    return int(min(room // (kept + transient), max(room - chunk, 0) // kept))


def token_budget(fits: int, row_tokens: int) -> int:
    """The budget from the tokens that fit: in steps of BUDGET_STEP, at most MICRO_BATCH_TOKENS, at least one row."""
    return min(MICRO_BATCH_TOKENS, max(fits // BUDGET_STEP * BUDGET_STEP, row_tokens))
