"""--max_tokens_per_micro_batch auto on a GPU: the memory plan's budget (grpo.memory.plan, made before loading),
checked once the model and the colocated rollout engine are loaded, before the first rollout, against what is
measured free for training:

    room   = free + torch's cached blocks - gradients to come - safety margin
             and, under --gpu_memory_gib, at most
             cap + lent - torch's allocated bytes - gradients to come - margin

`free` is measured with the rollout engine asleep, as during every update; memory other processes hold is already
not free, and the cap is this run's own (never the two subtracted together). The cap is torch's per-process
fraction, which counts every block torch's allocator has handed out, vLLM's pool included; what the sleeping engine
unmapped (back with the driver, still in that count) is lent to the cap while it sleeps (grpo.runtime.gpu_budget), as
a card of the cap's size would have it free. Where the room holds fewer tokens than planned, the budget is
lowered to what it holds and the log says by how much the plan missed; where not even one row fits, a ConfigError
with the figures and the options that help stops the run here, before any rollout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from grpo.config.choices import MICRO_BATCH_TOKENS
from grpo.errors import ConfigError

logger = logging.getLogger("grpo")
from grpo.memory.activations import (  # noqa: F401 (the plan's math, read here too)
    BUDGET_STEP, ESTIMATE_MARGIN, GIB, MIB, MIN_CHUNK_TOKENS, ModelShape, activation_bytes_per_token,
    fitted_chunk_tokens, logprob_chunk_bytes, micro_batch_bytes, model_shape)


@dataclass(frozen=True)
class GpuFigures:
    """Bytes on this rank's GPU with the rollout engine asleep."""
    free: int       # the driver's free memory (torch.cuda.mem_get_info)
    cached: int     # torch's reserved but unallocated blocks: free for training too
    total: int      # the GPU's memory
    usable: int     # --gpu_memory_gib, or the whole GPU
    to_come: int    # not allocated yet, needed by the update: the trainable parameters' gradients
    capped_allocated: int | None = None  # under --gpu_memory_gib: torch's allocated bytes, which its cap counts
    lent: int = 0   # what the sleeping engine unmapped, lent to the cap meanwhile (grpo.runtime.gpu_budget)

    @property
    def margin(self) -> int:
        return max(GIB, self.usable // 20)

    @property
    def room(self) -> int:
        """What the micro-batch's activations may take."""
        room = self.free + self.cached - self.to_come - self.margin  # others' memory is already not free
        if self.capped_allocated is not None:  # the run's own cap, which counts vLLM's pool, less what is lent
            room = min(room, self.usable + self.lent - self.capped_allocated - self.to_come - self.margin)
        return room


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
               (f"{(gpu.capped_allocated - gpu.lent) / GIB:.1f} counted by torch's cap, "
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
                (["a smaller --logprob_chunk_tokens"] if chunk and not smallest_chunk else [])))
    budget = min(MICRO_BATCH_TOKENS, max(fits // BUDGET_STEP * BUDGET_STEP, row_tokens))
    return budget, f"micro-batches of up to {budget} tokens (--max_tokens_per_micro_batch auto): {figures}"


def checkpointing_on(model) -> bool:
    """Whether any layer of `model` is gradient-checkpointed."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def training_estimate(config, model, chunk_tokens: int | None = None,
                      row_tokens: int | None = None) -> tuple[int, int, int, bool]:
    """(kept, transient, chunk, checkpointing) for `model` (a DeepSpeed engine, peft or transformers model) as this
    run trains it: its shape, the dtypes of its embeddings and adapters, whether its layers are checkpointed, and
    whether its log-probs take the hidden-state path (see grpo.train.update.score), with log-prob chunks of
    `chunk_tokens` (default --logprob_chunk_tokens); `row_tokens`: the longest row (default --max_seq_length), for
    the scores an eager attention holds."""
    from grpo.train.logprobs import hidden_state_path

    zero3 = getattr(model, "zero_optimization_stage", lambda: 0)() == 3
    full_logits = zero3 or config.logprob_chunk_tokens == 0 or not hidden_state_path(model)
    checkpointing = checkpointing_on(model)
    module = getattr(model, "module", model)
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    shape = model_shape(base.config)
    adapters = [p for name, p in model.named_parameters() if "lora_A" in name]
    act_bytes = base.get_input_embeddings().weight.element_size()
    kept, transient = activation_bytes_per_token(
        shape, checkpointing, act_bytes=act_bytes,
        adapter_bytes=adapters[0].element_size() if adapters else 0,
        dropout=bool(adapters) and config.lora_dropout > 0, full_logits=full_logits,
        row_tokens=config.max_seq_length if row_tokens is None else row_tokens)
    chunk_tokens = config.logprob_chunk_tokens if chunk_tokens is None else chunk_tokens
    return kept, transient, logprob_chunk_bytes(chunk_tokens, shape.vocab, full_logits, shape.capped_logits,
                                                act_bytes), checkpointing


def micro_batch_token_budget(config, model, engine, device: torch.device, plan=None) -> tuple[int, int]:
    """(--max_tokens_per_micro_batch, --logprob_chunk_tokens) for this run: as given; auto the memory plan's (`plan`,
    required then), on a GPU checked against the room measured once the model and engine are loaded (module
    docstring): lowered where the room holds less, to the least any rank holds, so every rank trains alike; a rank
    that cannot fit one row stops every rank."""
    value, chunk_tokens = config.max_tokens_per_micro_batch, config.logprob_chunk_tokens
    if value != "auto":
        return value, chunk_tokens
    if plan is None:
        raise ValueError("--max_tokens_per_micro_batch auto is the memory plan's budget (grpo.memory): pass the run's "
                         "plan, or give the option a number of tokens")
    planned, chunk_tokens = plan.micro_batch_tokens, plan.logprob_chunk_tokens
    if device.type != "cuda":
        return planned, chunk_tokens
    from grpo.runtime import distributed as dist_utils
    from grpo.runtime.gpu_budget import engine_loan_bytes, usable_gpu_bytes

    kept, transient, chunk, checkpointing = training_estimate(config, model, chunk_tokens, plan.longest)
    engine.sleep(keep_weights=True)  # as during an update; woken at once, so the engine is left as it was
    try:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        cached = torch.cuda.memory_reserved(device) - allocated
        lent = engine_loan_bytes(device)
    finally:
        engine.wake()
    to_come = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None)
    gpu = GpuFigures(free, cached, total, usable_gpu_bytes(config.gpu_memory_gib, device), to_come,
                     capped_allocated=allocated if config.gpu_memory_gib else None, lent=lent)
    try:
        measured, line = resolve_token_budget(gpu, kept, transient, chunk, config.max_seq_length, checkpointing,
                                              smallest_chunk=chunk_tokens // 2 < MIN_CHUNK_TOKENS,
                                              sp_size=config.sequence_parallel_size)
        budget = min(planned, measured)
        line = (f"micro-batches of up to {budget} tokens (--max_tokens_per_micro_batch auto: the memory plan's "
                f"{planned}" + (f", lowered: the room measured after loading holds {measured}" if measured < planned
                                else f"; the room measured after loading holds {measured}") + ")" + line[
                    line.index(":"):])
    except ConfigError as exc:
        budget, line, error = 0, "", exc
    least = -int(dist_utils.all_max([-float(budget)])[0])
    if least == 0:
        raise error if budget == 0 else ConfigError(
            "--max_tokens_per_micro_batch auto: another rank's GPU cannot train one row of --max_seq_length "
            f"{config.max_seq_length} tokens (its error gives the figures)")
    (logger.warning if budget < planned else logger.info)(
        line + (f"; {least} on every rank, the least any rank fits" if least < budget else ""))
    return least, chunk_tokens
