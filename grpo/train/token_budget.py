"""--max_tokens_per_micro_batch auto: the largest micro-batch, in tokens, whose training memory fits what the GPU has
left once the model and the colocated rollout engine are loaded; resolved once, before the first rollout.

    budget = min(16384, floor(t / 1024) x 1024), and at least one row of --max_seq_length
    t      = the most tokens with  ESTIMATE_MARGIN x (t kept + max(chunk, t transient)) <= room
    room   = free + torch's cached blocks - (total - usable) - gradients to come - safety margin
             and, under --gpu_memory_gib, at most  usable - torch's allocated bytes - gradients to come - margin

`free` is measured with the rollout engine asleep, as it is during every update (a level-1 sleep and a wake, as
around an evaluation), so what the sleeping engine still holds counts as used; `usable` is --gpu_memory_gib or the
whole GPU. The cap is torch's per-process fraction, which counts every block torch's allocator has handed out,
vLLM's pool included: a KV cache asleep is back with the driver but still counted against the cap. `kept`,
`transient` and `chunk` come from the model's shape (activation_bytes_per_token, logprob_chunk_bytes). Where the
log-prob chunk is what limits t, it is halved first (fitted_chunk_tokens). If one row does not fit, a ConfigError with
the figures and the options that help stops the run here, before any rollout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from grpo.config.choices import MICRO_BATCH_TOKENS
from grpo.errors import ConfigError

logger = logging.getLogger("grpo")
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


@dataclass(frozen=True)
class ModelShape:
    hidden: int          # H
    intermediate: int    # I (the MLP's width; routed experts x their width for a mixture of experts)
    layers: int          # L
    q_dim: int           # attention heads x head_dim
    vocab: int           # V


def model_shape(model_config) -> ModelShape:
    """The decoder's shape from a transformers config (a vision-language model's text config)."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    routed = (getattr(cfg, "num_experts_per_tok", None) or 0) * (getattr(cfg, "moe_intermediate_size", None) or 0)
    intermediate = max(getattr(cfg, "intermediate_size", None) or 4 * hidden, routed)
    return ModelShape(hidden, intermediate, cfg.num_hidden_layers, heads * head_dim, cfg.vocab_size)


def activation_bytes_per_token(s: ModelShape, checkpointing: bool, act_bytes: int, adapter_bytes: int,
                               dropout: bool, full_logits: bool) -> tuple[int, int]:
    """(kept, transient): training memory of one token of a micro-batch, in bytes; `kept` lives through the whole
    backward, `transient` only while one layer's backward runs. a = act_bytes (2 for bf16 activations, 4 where the
    residual stream is fp32, as behind fp32 embeddings), b = adapter_bytes (the LoRA input copies' element
    size, fp32 adapters 4; 0 for full fine-tuning), d = 1 with LoRA dropout, else 0:

        layer    = 8 H                          two RMSNorms, each keeping its fp32 upcast input
                 + 4 q a                        SDPA's q, k, v (k, v repeated to q's heads) and output
                 + 3 I a                        gate, act(gate), up (their product is down's input)
                 + (b + d)(5 H + q + I)  [lora] each adapter's copy of its input (and dropout's mask): q, k, v,
                                                gate, up read H, o reads q, down reads I
                 + a (2 H + q + I)       [full] the inputs the trained weights need for their gradients
        backward = 4 I a                        one layer's MLP gradients in flight
        ends     = H (2 a + 4)                  the embedding output, the final norm's fp32 input, the hidden states
                                                kept for the log-prob chunks
        logits   = 14 V  [full logits only]     bf16 logits, an fp32 copy, log-softmax, its gradient (all kept)

        with checkpointing:  kept = L H a + ends (+ logits),   transient = layer + backward
                             (every layer's input kept; one layer recomputed in its backward)
        without:             kept = L layer + ends (+ logits), transient = backward
    """
    H, I, q, a, b = s.hidden, s.intermediate, s.q_dim, act_bytes, adapter_bytes
    layer = 8 * H + 4 * q * a + 3 * I * a
    layer += (b + int(dropout)) * (5 * H + q + I) if b else a * (2 * H + q + I)
    backward, ends = 4 * I * a, H * (2 * a + 4) + (14 * s.vocab if full_logits else 0)
    if checkpointing:
        return s.layers * H * a + ends, layer + backward
    return s.layers * layer + ends, backward


def logprob_chunk_bytes(chunk_tokens: int, vocab: int, full_logits: bool) -> int:
    """One log-prob chunk's logits, whatever the micro-batch: 16 c V bytes (fp32 logits, their temperature-scaled
    copy, logsumexp's exponentials, the gradient), at the start of the backward, beside the kept activations only;
    none on the full-logits path (counted per token there)."""
    return 0 if full_logits else 16 * chunk_tokens * vocab


def micro_batch_bytes(tokens: int, kept: int, transient: int, chunk: int) -> int:
    """The estimate's peak for a micro-batch of `tokens`:  t kept + max(chunk, t transient)."""
    return tokens * kept + max(chunk, tokens * transient)


@dataclass(frozen=True)
class GpuFigures:
    """Bytes on this rank's GPU with the rollout engine asleep."""
    free: int       # the driver's free memory (torch.cuda.mem_get_info)
    cached: int     # torch's reserved but unallocated blocks: free for training too
    total: int      # the GPU's memory
    usable: int     # --gpu_memory_gib, or the whole GPU
    to_come: int    # not allocated yet, needed by the update: the trainable parameters' gradients
    capped_allocated: int | None = None  # under --gpu_memory_gib: torch's allocated bytes, which its cap counts

    @property
    def margin(self) -> int:
        return max(GIB, self.usable // 20)

    @property
    def room(self) -> int:
        """What the micro-batch's activations may take."""
        room = self.free + self.cached - (self.total - self.usable) - self.to_come - self.margin
        if self.capped_allocated is not None:  # torch's cap also counts what vLLM's pool holds asleep
            room = min(room, self.usable - self.capped_allocated - self.to_come - self.margin)
        return room


def fitted_chunk_tokens(room: int, chunk_tokens: int, chunk: int, kept: int, transient: int) -> tuple[int, int]:
    """(tokens, bytes) of the log-prob chunk, halved (never below MIN_CHUNK_TOKENS) while it is what limits the
    micro-batch. The budget t is the least of 16384, room / (kept + transient) and (room - chunk) / kept; the chunk
    stops binding once  chunk <= room - kept x min(16384, room / (kept + transient)). `room` as resolve_token_budget
    divides it."""
    limit = room - kept * min(MICRO_BATCH_TOKENS, room // (kept + transient))
    while chunk_tokens // 2 >= MIN_CHUNK_TOKENS and chunk > limit:
        chunk_tokens, chunk = chunk_tokens // 2, chunk // 2
    return chunk_tokens, chunk


def resolve_token_budget(gpu: GpuFigures, kept: int, transient: int, chunk: int, max_seq_length: int,
                         checkpointing: bool, smallest_chunk: bool = False, sp_size: int = 1) -> tuple[int, str]:
    """(budget, the line that says where it came from): the most tokens t with
    ESTIMATE_MARGIN x micro_batch_bytes(t) <= room, in steps of 1024 up to 16384 and at least one row of
    max_seq_length (of which a rank of a sequence-parallel group of `sp_size` holds ceil(max_seq_length / sp_size));
    a ConfigError if that row does not fit. The budget counts the tokens one rank holds. `smallest_chunk`: the
    log-prob chunk is already as small as auto makes it (not suggested then)."""
    row_tokens = -(-max_seq_length // sp_size)
    room = max(gpu.room, 0) / ESTIMATE_MARGIN
    fits = int(min(room // (kept + transient), max(room - chunk, 0) // kept))
    figures = (f"{gpu.room / GIB:.1f} GiB free for training ({gpu.usable / GIB:.1f} GiB usable, "
               f"{(gpu.free + gpu.cached) / GIB:.1f} free on the GPU with the rollout engine asleep, " +
               (f"{gpu.capped_allocated / GIB:.1f} counted by torch's cap, "
                if gpu.capped_allocated is not None else "") +
               f"{gpu.margin / GIB:.1f} kept back); estimated {ESTIMATE_MARGIN:g} x ({kept / MIB:.2f} + "
               f"{transient / MIB:.2f} MiB per token, {chunk / GIB:.2f} GiB for a log-prob chunk), checkpointing "
               f"{'on' if checkpointing else 'off'}")
    if fits < row_tokens:
        row = ESTIMATE_MARGIN * micro_batch_bytes(row_tokens, kept, transient, chunk) / GIB
        per_rank = f" ({row_tokens} on each rank of its sequence-parallel group)" if sp_size > 1 else ""
        raise ConfigError(
            f"--max_tokens_per_micro_batch auto: one row of --max_seq_length {max_seq_length} tokens{per_rank} needs "
            f"about "
            f"{row:.1f} GiB to train, and {max(gpu.room, 0) / GIB:.1f} GiB is free for training: {figures}. "
            f"What helps: " + ", ".join(
                (["--gradient_checkpointing true"] if not checkpointing else []) +
                ["a smaller --max_seq_length", "a larger --sequence_parallel_size", "a larger --gpu_memory_gib (or a GPU with more memory)",
                 "--rollout_weights in_place (lora) or adapter (qlora), where the engine keeps a 16-bit copy",
                 "--tuning_strategy qlora"] +
                (["a smaller --vllm_kv_cache_gib (under --gpu_memory_gib vLLM's KV cache counts even while it "
                  "sleeps)"] if gpu.capped_allocated is not None else []) +
                (["a smaller --logprob_chunk_tokens"] if chunk and not smallest_chunk else [])))
    budget = min(MICRO_BATCH_TOKENS, max(fits // BUDGET_STEP * BUDGET_STEP, row_tokens))
    return budget, f"micro-batches of up to {budget} tokens (--max_tokens_per_micro_batch auto): {figures}"


def checkpointing_on(model) -> bool:
    """Whether any layer of `model` is gradient-checkpointed."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def training_estimate(config, model) -> tuple[int, int, int, bool]:
    """(kept, transient, chunk, checkpointing) for `model` (a DeepSpeed engine, peft or transformers model) as this
    run trains it: its shape, the dtypes of its embeddings and adapters, whether its layers are checkpointed, and
    whether its log-probs take the hidden-state path (see grpo.train.update.score)."""
    from grpo.train.logprobs import hidden_state_path

    zero3 = getattr(model, "zero_optimization_stage", lambda: 0)() == 3
    full_logits = zero3 or config.logprob_chunk_tokens == 0 or not hidden_state_path(model)
    checkpointing = checkpointing_on(model)
    module = getattr(model, "module", model)
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    shape = model_shape(base.config)
    adapters = [p for name, p in model.named_parameters() if "lora_A" in name]
    kept, transient = activation_bytes_per_token(
        shape, checkpointing, act_bytes=base.get_input_embeddings().weight.element_size(),
        adapter_bytes=adapters[0].element_size() if adapters else 0,
        dropout=bool(adapters) and config.lora_dropout > 0, full_logits=full_logits)
    return kept, transient, logprob_chunk_bytes(config.logprob_chunk_tokens, shape.vocab, full_logits), checkpointing


def micro_batch_token_budget(config, model, engine, device: torch.device) -> tuple[int, int]:
    """(--max_tokens_per_micro_batch, --logprob_chunk_tokens) for this run: as given, 16384 for auto on CPU, else
    resolved on the GPU (the least any rank fits, so every rank trains alike; a rank that cannot fit one row stops
    every rank). auto also halves the log-prob chunk where it is what limits the micro-batch (fitted_chunk_tokens):
    the log-probs are the same, computed in more pieces."""
    value, chunk_tokens = config.max_tokens_per_micro_batch, config.logprob_chunk_tokens
    if value != "auto":
        return value, chunk_tokens
    if device.type != "cuda":
        return MICRO_BATCH_TOKENS, chunk_tokens
    from grpo.runtime import distributed as dist_utils
    from grpo.runtime.gpu_budget import usable_gpu_bytes

    kept, transient, chunk, checkpointing = training_estimate(config, model)
    engine.sleep(keep_weights=True)  # as during an update; woken at once, so the engine is left as it was
    try:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        cached = torch.cuda.memory_reserved(device) - allocated
    finally:
        engine.wake()
    to_come = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)
    gpu = GpuFigures(free, cached, total, usable_gpu_bytes(config.gpu_memory_gib, device), to_come,
                     capped_allocated=allocated if config.gpu_memory_gib else None)
    if chunk:
        chunk_tokens, chunk = fitted_chunk_tokens(max(gpu.room, 0) / ESTIMATE_MARGIN, chunk_tokens, chunk, kept,
                                                  transient)
    try:
        budget, line = resolve_token_budget(gpu, kept, transient, chunk, config.max_seq_length, checkpointing,
                                            smallest_chunk=chunk_tokens // 2 < MIN_CHUNK_TOKENS,
                                            sp_size=config.sequence_parallel_size)
        if chunk_tokens < config.logprob_chunk_tokens:
            line += f"; log-probs in chunks of {chunk_tokens} tokens, not {config.logprob_chunk_tokens}, to fit"
    except ConfigError as exc:
        budget, line, error = 0, "", exc
    least = -int(dist_utils.all_max([-float(budget)])[0])
    if least == 0:
        raise error if budget == 0 else ConfigError(
            "--max_tokens_per_micro_batch auto: another rank's GPU cannot train one row of --max_seq_length "
            f"{config.max_seq_length} tokens (its error gives the figures)")
    logger.info(line + (f"; {least} on every rank, the least any rank fits" if least < budget else ""))
    return least, chunk_tokens
