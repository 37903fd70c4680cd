"""The memory plan: from the model's config, the options and the GPU's budget, each phase's peak and every automatic
memory choice (the engine's weights and sleep level, vLLM's KV cache in bytes, the micro-batch token budget, the
log-prob chunk, gradient checkpointing), made once, before any weight loads. Everything else reads the plan.

The parts (bytes on one GPU; b = 2 for bf16, T = trainable parameters, dp = data-parallel ranks sharing ZeRO's
partitions; model_size.py, kv_cache.py, activations.py, engine.py):

    base        the frozen weights: qlora q Q + b (P - Q), lora / full b P     (held once where the engine shares them)
    adapters    b A
    optimizer   12 T / dp          fp32 master weights and Adam's two moments (ZeRO partitions them)
    gradients   (2 + 4 / dp) T     bf16 gradients and their fp32 partition (during the update only)
    engine      the engine's own weights: merged b P / tp; adapter its LoRA slots; in_place nothing
    kv          vLLM's KV cache (explicit bytes)
    vllm        what vLLM holds beside weights and cache (activations of its largest batch, sampler, CUDA graphs)
    context     the CUDA context and library workspaces

    rollout   = context + base + adapters + optimizer + engine + kv + vllm
    logprobs  = context + base + adapters + optimizer + asleep + step tensors
                + forward(t)  [a pass before the update: --kl_beta > 0]  (+ reference, full with beta > 0)
    train     = context + base + adapters + optimizer + gradients + asleep + 0.9 micro_batch(t) + 1.5 GiB
                + expert transient
                (micro_batch(t): activations.py's equation; the share and the overhead as measured, see below;
                expert transient: LoRA on fused experts, peft's W + s B A of each adapted stack, one layer's with
                checkpointing, every layer's without: activations.expert_fold_bytes)
    sync      = max(train, context + base + adapters + optimizer + engine + merge)
                merge = 2 b (largest layer), and with adapted fused experts at least 3 x 4 x the largest adapted
                stack (fp32: the stack read, the delta, the merged copy: grpo.sync.expert_adapters)
                (it follows the update, whose blocks torch still holds)
    load      = context + b P  (qlora with fused experts only: the 16-bit model, as measured; see LOAD below)
    asleep    = what the sleeping engine still holds: its sampler tables, graph pool and memory outside torch
                (engine.vllm_asleep_bytes), its weights where it keeps them (sleep level 0, or shared); what it
                unmaps is free for training, under --gpu_memory_gib too (grpo.runtime.gpu_budget lends it to torch's
                cap while the engine sleeps), so a cap plans as a card of its size

Choices, in this order: the engine's weights (auto: by preference, the faster mode where its 16-bit copy is small
next to the budget, the first that fits with the step's sequences in its cache at once, else the one whose cache holds
the most), the KV cache (the step's sequences at once where they fit; with an engine that stays awake
(--vllm_sleep false) at most what leaves training micro-batches of LEAST_TRAIN_TOKENS; never below one
--max_seq_length sequence: rollouts then run in waves), the token
budget (the most tokens whose activations fit beside the rest both as measured and as ESTIMATE_MARGIN x the
equation, at least one row), the log-prob chunk (halved while it is what
limits the budget). A plan whose smallest settings do not fit is refused (advice.py says what fits).
Server mode: the rollout ranks' weights (preferred_weights; their GPUs are not this plan's), nothing on this GPU.

The engine's builder (grpo.rollout.engines) takes these choices as values: it checks the planned weights against the
loaded policy (what config.json cannot show, e.g. a saved adapter with DoRA), falls back where the policy refuses
them, and sleeps an engine on unplanned weights at UNPLANNED_SLEEP_LEVEL (MemoryPlan.sleep_level_for).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from grpo.config.choices import MICRO_BATCH_TOKENS
from grpo.config.strategy import Strategy
from grpo.memory.activations import (ESTIMATE_MARGIN, GIB, MIN_CHUNK_TOKENS, activation_bytes_per_token,
                                     block_scores_per_token, eager_gradient_extra, expert_fold_bytes,
                                     fitted_chunk_tokens, logprob_chunk_bytes, micro_batch_bytes, token_budget,
                                     tokens_that_fit)
from grpo.memory.engine import CONTEXT_BYTES, engine_batch_limits, vllm_asleep_bytes, vllm_own_bytes
from grpo.memory.kv_cache import FLOOR_SLACK_TOKENS, auto_kv_cache_bytes, kv_bytes_per_token
from grpo.memory.model_size import ModelSize
from grpo.memory.parts import engine_weight_bytes, load_peak_bytes, sync_merge_bytes, trainer_parts

# A micro-batch's training memory on a GPU against activations.py's equation: 17 runs of five 7-9B shapes (Qwen2.5,
# Llama 3.1, Qwen3, Mistral, Gemma 2), qlora, micro-batches of 4,096-16,384 tokens (benchmarks/RESULTS.md,
# 2026-11-29 05:30-06:00) took 0.9 of the equation's bytes plus 1.5 GiB (torch's blocks of the step's tensors and of
# the last log-prob chunk), each run within 0.8 GiB of that. The plan's train phase is this; the micro-batch budget
# is the most tokens for which both this and ESTIMATE_MARGIN x the equation fit (room for shapes not measured).
MEASURED_ACTIVATION_SHARE = 0.9
ACTIVATION_OVERHEAD_BYTES = int(1.5 * GIB)
# Between the rollout and the update with no log-prob pass (no --kl_beta): the step's tensors and the blocks torch
# keeps from the rollout's bookkeeping, 1.0-2.6 GiB in the same runs (Qwen2.5-7B the most)
STEP_TENSORS_BYTES = int(1.5 * GIB)
# --rollout_weights auto, qlora: the engine holds the 4-bit base plus the adapter once the merged 16-bit copy would
# take more than this share of the budget. Below it both fit and merged is faster: on one H100 at Qwen2.5-7B's shape
# (a 15 GiB copy, 19% of the GPU) merged took 8.1 s/step with eager vLLM (26.4 GiB peak), adapter 8.5 s/step with
# CUDA graphs and 27.7 eager (19.0 GiB peak); at 0.68B with lora, 1.76 against 2.26 (benchmarks/RESULTS.md)
ADAPTER_FROM_SHARE = 0.4
# default --vllm_sleep_level, lora / qlora with merged weights on one GPU: the engine keeps its 16-bit copy through
# training (level 0: a sync writes the adapted layers in place) where the copy takes at most this share of the
# budget; level 2 frees it. At Qwen2.5-7B's shape on one H100 (a 15 GiB copy, 19%), level 2's sync took 0.15-0.18 s
KEEP_WEIGHTS_UP_TO_SHARE = 0.25
# --rollout_weights auto, lora: in_place (one 16-bit base) where its 16-bit copy takes IN_PLACE_FROM_BYTES or more, or
# more than KEEP_WEIGHTS_UP_TO_SHARE of the budget; merged (kept through training) below both. On one H100 at
# Qwen2.5-7B's shape (a 14.2 GiB copy): in_place 5.15 s/step at a 30.8 GiB peak, merged 5.16 at 43.3 GiB; at 0.68B
# in_place took 0.05-0.15 s more of a 2.0 s step, so merged keeps small models (benchmarks/RESULTS.md, 2026-11-27)
IN_PLACE_FROM_BYTES = 8 * 2**30
# the sleep level of an engine whose weights are not the planned ones (the loaded policy refused them): its memory was
# not planned, so it frees whatever it can while training (an engine holding the base once keeps it at any level)
UNPLANNED_SLEEP_LEVEL = 2
# an engine that stays awake keeps its KV cache through training: it gets what the step's sequences need as long as
# training keeps micro-batches of this many tokens (or one row): rollouts in waves cost more than smaller micro-batches
LEAST_TRAIN_TOKENS = 4096
WARN_ABOVE_PLAN = 1.10  # a measured phase this much over its plan is said in the log


@dataclass(frozen=True)
class GpuBudget:
    """What this run may use of one GPU. `total`: the GPU's memory (or the named card's); `free`: free on it before
    the run loaded anything, this process's context included (None where no GPU is asked: a card named by
    --gpu_memory_gib); `cap`: --gpu_memory_gib. The run's own cap bounds it; other processes lower what is free,
    never the cap twice."""
    total: int
    free: int | None
    cap: int | None
    name: str

    @property
    def budget(self) -> int:
        bound = min(self.cap, self.total) if self.cap else self.total
        return bound if self.free is None else min(bound, self.free)

    @property
    def margin(self) -> int:
        """Kept back from every phase: allocator fragmentation, what no equation counts."""
        return max(GIB, self.budget // 20)


@dataclass(frozen=True)
class RunShape:
    """What of the options the plan reads, resolved: engine, lengths, batch, parallelism."""
    strategy: Strategy        # (its name converts)
    engine: str               # "vllm", "hf" or "server" (this rank trains; the rollout ranks generate)
    tp: int
    dp: int                   # data-parallel ranks (ZeRO partitions)
    zero3: bool
    sequences: int            # sequences one engine generates per step
    longest: int              # prompt + completion tokens of the longest sequence
    max_seq_length: int
    sp: int
    kl_reference: bool        # full fine-tuning with beta > 0: a frozen copy of the model
    lora_rank: int
    lora_dropout: bool
    block_size: int
    chunk_tokens: int
    full_logits: bool
    checkpointing: bool | None   # --gradient_checkpointing (None: auto)
    micro_batch_tokens: str | int
    kv_cache: str | float     # --vllm_kv_cache_gib as parsed: "auto", "share" or GiB
    rollout_weights: str      # --rollout_weights (auto or a mode)
    sleep_level: int | None
    vllm_sleep: bool
    eager: bool
    capable: tuple[str, ...]  # engine weight modes this model and these options can take, by preference
    logprob_pass: bool = True  # a no-grad pass before the update (--kl_beta > 0: the reference's, or the policy's)
    server_vllm: bool = False  # engine "server": the rollout ranks run vLLM (whose weights the plan chooses too)

    def __post_init__(self):
        object.__setattr__(self, "strategy", Strategy(self.strategy))


@dataclass(frozen=True)
class MemoryPlan:
    gpu: str
    budget: int
    capped: bool
    rollout_weights: str | None   # merged / adapter / in_place: a colocated vLLM engine's, or server mode's rollout
                                  # ranks' (vLLM); None for an HF engine
    sleep_level: int | None       # a colocated vLLM engine's
    kv_cache_bytes: int | None    # vLLM's KV cache (None: the engine has no cache of its own to size)
    kv_needed_bytes: int | None   # what the step's sequences need at once
    kv_per_token: int | None
    engine_batched_tokens: int | None   # vLLM's max_num_batched_tokens and max_num_seqs, passed to it
    engine_max_seqs: int | None
    sequences: int
    longest: int
    micro_batch_tokens: int
    logprob_chunk_tokens: int
    gradient_checkpointing: bool
    parts: dict = field(default_factory=dict)    # name -> bytes
    phases: dict = field(default_factory=dict)   # phase -> planned peak bytes
    fits: bool = True
    why_not: str = ""
    notes: tuple = ()

    @property
    def peak(self) -> int:
        return max(self.phases.values()) if self.phases else 0

    @property
    def sequences_at_once(self) -> float:
        if not self.kv_cache_bytes or not self.kv_per_token:
            return float(self.sequences)
        return self.kv_cache_bytes / (self.kv_per_token * self.longest)

    def to_json(self) -> dict:
        return asdict(self)

    def sleep_level_for(self, weights: str) -> int:
        """The colocated engine's sleep level for the weights it took: the planned level for the planned weights;
        UNPLANNED_SLEEP_LEVEL where the loaded policy made it take others (grpo.rollout.engines.engine_weights)."""
        if weights == self.rollout_weights and self.sleep_level is not None:
            return self.sleep_level
        return UNPLANNED_SLEEP_LEVEL


def measured_activation_bytes(equation_bytes: int) -> int:
    """A micro-batch's training memory as measured:  0.9 x the equation + 1.5 GiB  (constants above)."""
    return int(MEASURED_ACTIVATION_SHARE * equation_bytes) + ACTIVATION_OVERHEAD_BYTES


def equation_room(room: int) -> int:
    """The room, as activations.py's tokens_that_fit reads it (ESTIMATE_MARGIN x the equation <= room), that also
    keeps the measured form within `room`:  min(room, ESTIMATE_MARGIN (room - overhead) / share)."""
    measured = ESTIMATE_MARGIN * (room - ACTIVATION_OVERHEAD_BYTES) / MEASURED_ACTIVATION_SHARE
    return int(max(min(room, measured), 0))


def auto_checkpointing(parameters: int, on_gpu: bool, option: bool | None, adapted_experts: bool = False) -> bool:
    """--gradient_checkpointing auto: on from 1B parameters (at 7B, 16k tokens of activations without it take more
    than an 80 GB GPU has; at 0.5B they fit beside the weights) and always on a CPU (RAM is short there); on a GPU
    also for LoRA on a mixture of experts' fused experts, whatever its size (without checkpointing every layer's
    folded 16-bit stacks stay for the backward: activations.expert_fold_bytes)."""
    from grpo.model.loading import checkpointing_by_size  # the one rule (a policy loaded without a plan reads it too)

    if option is not None:
        return option
    return checkpointing_by_size(parameters, on_cpu=not on_gpu) or (on_gpu and adapted_experts)


def preferred_weights(run: RunShape, size: ModelSize, budget: int) -> list[str]:
    """The engine's weight modes to try, best first: an explicit --rollout_weights alone; auto by the measured
    rules (ADAPTER_FROM_SHARE, IN_PLACE_FROM_BYTES, KEEP_WEIGHTS_UP_TO_SHARE), then the others it can take. Server
    mode's rollout ranks (their GPUs hold nothing else): the adapter wherever they can take it (a sync sends the
    adapter's bytes, not the model's), else merged."""
    if run.rollout_weights != "auto":
        return [run.rollout_weights]
    copy = 2 * size.parameters
    if run.engine == "server":
        order = ["adapter", "merged"]
    elif run.strategy.four_bit_base:
        first = "merged" if copy <= ADAPTER_FROM_SHARE * budget else "adapter"
        order = [first, "adapter", "merged"]
    elif run.strategy.has_adapter:
        small = copy < IN_PLACE_FROM_BYTES and copy <= KEEP_WEIGHTS_UP_TO_SHARE * budget
        order = ["merged", "in_place", "adapter"] if small else ["in_place", "adapter", "merged"]
    else:
        order = ["merged"]
    capable = [mode for mode in order if mode in run.capable]
    return list(dict.fromkeys(capable or ["merged"]))


def default_sleep_level(run: RunShape, weights: str, size: ModelSize, budget: int) -> int:
    """--vllm_sleep_level auto: 0 for lora / qlora with merged weights on one GPU where the 16-bit copy takes at most
    KEEP_WEIGHTS_UP_TO_SHARE of the budget (a sync then writes the adapted layers alone); an engine holding the base
    once keeps it (1); 2 otherwise."""
    if run.sleep_level is not None:
        return run.sleep_level
    if weights in ("adapter", "in_place"):
        return 1
    if not run.strategy.has_adapter or run.tp > 1:
        return 2
    return 0 if 2 * size.parameters <= KEEP_WEIGHTS_UP_TO_SHARE * budget else 2


def plan_memory(run: RunShape, size: ModelSize, gpu: GpuBudget | None, hf_config) -> MemoryPlan:
    """The plan (module docstring). `gpu` None: a CPU run, planned in RAM with no budget to refuse against."""
    on_gpu = gpu is not None
    float_bytes = 2 if on_gpu else 4
    adapted_experts = run.strategy.has_adapter and size.adapted_expert_layer > 0
    checkpointing = auto_checkpointing(size.parameters, on_gpu, run.checkpointing, adapted_experts)
    kept, transient = activation_bytes_per_token(size.shape, checkpointing, float_bytes,
                                                 float_bytes if run.strategy.has_adapter else 0,
                                                 run.lora_dropout, run.full_logits, row_tokens=run.longest)
    chunk = logprob_chunk_bytes(run.chunk_tokens, size.shape.vocab, run.full_logits, size.shape.capped_logits,
                                float_bytes)
    per_token = kv_bytes_per_token(hf_config, run.tp)
    kv_needed = auto_kv_cache_bytes(per_token, run.sequences, run.longest, run.max_seq_length)
    trainer = trainer_parts(run, size, float_bytes)
    folds = expert_fold_bytes(size.adapted_expert_layer, size.largest_adapted_stack, size.adapted_expert_layers,
                              checkpointing, float_bytes) if adapted_experts else 0
    row_tokens = -(-run.max_seq_length // run.sp)
    common = dict(sequences=run.sequences, longest=run.longest, kv_per_token=per_token,
                  gradient_checkpointing=checkpointing)
    # server mode: the rollout ranks' engines, on GPUs of their own, take the weights chosen here (sent to them with
    # the engine's spec); nothing of them is on this rank's GPU
    served = preferred_weights(run, size, 0)[0] if run.engine == "server" and run.server_vllm else None
    if not on_gpu:
        tokens = run.micro_batch_tokens if run.micro_batch_tokens != "auto" else MICRO_BATCH_TOKENS
        fixed = sum(v for k, v in trainer.items() if k != "gradients")
        generation = (kv_needed or 0) * 2 + run.sequences * size.shape.vocab * 4
        phases = {"rollout": fixed + generation,
                  "train": fixed + trainer["gradients"] + micro_batch_bytes(max(tokens, 1), kept, transient, chunk)
                  + folds}
        return MemoryPlan("CPU", 0, False, served, None, None, kv_needed, **common, engine_batched_tokens=None,
                          engine_max_seqs=None, micro_batch_tokens=tokens,
                          logprob_chunk_tokens=run.chunk_tokens, parts={**trainer, "expert transient": folds},
                          phases=phases,
                          notes=("a CPU run: planned in RAM, nothing refused",))
    budget, margin, capped = gpu.budget, gpu.margin, gpu.cap is not None
    plans = [_plan_with(run, size, gpu, trainer, weights, checkpointing, kept, transient, chunk, per_token,
                        kv_needed, row_tokens, common, hf_config, folds)
             for weights in (preferred_weights(run, size, budget) if run.engine == "vllm" else [None])]
    if served is not None:
        plans = [replace(plan, rollout_weights=served) for plan in plans]
    fitting = [plan for plan in plans if plan.fits]
    if not fitting:
        return plans[0]
    # the first by preference whose cache holds the step's sequences at once; else the one holding the most
    at_once = [plan for plan in fitting if plan.sequences_at_once >= plan.sequences]
    return at_once[0] if at_once else max(fitting, key=lambda plan: plan.sequences_at_once)


def _plan_with(run: RunShape, size: ModelSize, gpu: GpuBudget, trainer: dict, weights: str | None,
               checkpointing: bool, kept: int, transient: int, chunk: int, per_token: int | None,
               kv_needed: int | None, row_tokens: int, common: dict, hf_config=None, folds: int = 0) -> MemoryPlan:
    budget, margin, capped = gpu.budget, gpu.margin, gpu.cap is not None  # (a cap plans as a card of its size)
    notes = []
    held = sum(v for k, v in trainer.items() if k != "gradients")  # what the trainer holds through the step
    context = CONTEXT_BYTES
    sleep_level = batched_tokens = max_seqs = None
    engine = own = vllm_asleep = 0
    kept_physical = 0
    if weights is not None:
        from grpo.rollout.vllm_lora import engine_lora_rank

        sleep_level = default_sleep_level(run, weights, size, budget)
        engine = engine_weight_bytes(weights, run, size)
        batched_tokens, max_seqs = engine_batch_limits(budget)
        lora_rank = engine_lora_rank(run.lora_rank) if weights == "adapter" else 0
        own = vllm_own_bytes(size.shape, batched_tokens, max_seqs, lora_rank=lora_rank,
                             four_bit=run.strategy.four_bit_base and weights == "adapter", eager=run.eager)
        vllm_asleep = vllm_asleep_bytes(size.shape, max_seqs, lora_rank, run.eager)
        # asleep, the engine keeps its weights at level 0, its LoRA slots always (the base is the trainer's), and
        # everything without --vllm_sleep; what it unmaps is free for training, under a cap too (lent to torch's
        # cap while it sleeps: grpo.runtime.gpu_budget)
        kept_weights = not run.vllm_sleep or weights != "merged" or sleep_level == 0
        kept_physical = engine if kept_weights else 0
    fixed_train = context + held + trainer["gradients"] + kept_physical + vllm_asleep + folds
    fixed_rollout = context + held + engine + own
    floor = (run.max_seq_length + FLOOR_SLACK_TOKENS) * per_token if per_token else 0

    def training_fit(room: int) -> tuple[int, int, int]:
        """(tokens that fit, chunk tokens, chunk bytes) for training room `room`, the chunk halved where it binds."""
        room = equation_room(room)
        tokens_chunk, chunk_bytes = run.chunk_tokens, chunk
        if chunk_bytes and run.micro_batch_tokens == "auto":
            tokens_chunk, chunk_bytes = fitted_chunk_tokens(max(room, 0) / ESTIMATE_MARGIN, tokens_chunk,
                                                            chunk_bytes, kept, transient)
        return tokens_that_fit(room, kept, transient, chunk_bytes), tokens_chunk, chunk_bytes

    # the KV cache: the step's sequences at once where they fit (module docstring)
    if weights is None:
        kv_bytes = None
    elif run.kv_cache not in ("auto", "share"):
        kv_bytes = int(run.kv_cache * GIB)
    elif per_token is None:
        kv_bytes = None
        notes.append(f"{type(hf_config).__name__}: no plain per-token K/V cache to size; vLLM's memory share sizes it "
                     "(--vllm_gpu_memory_utilization), which this plan does not count")
    else:
        room_rollout = budget - margin - fixed_rollout
        kv_bytes = max(floor, min(kv_needed if run.kv_cache == "auto" else room_rollout, room_rollout))
        if not run.vllm_sleep:  # the cache stays through training: leave training its least budget
            least = max(row_tokens, LEAST_TRAIN_TOKENS)
            while kv_bytes > floor and training_fit(budget - margin - fixed_train - kv_bytes)[0] < least:
                kv_bytes = max(floor, kv_bytes - GIB // 4)
    kv_kept = (kv_bytes or 0) if not run.vllm_sleep else 0
    # the micro-batch token budget and the log-prob chunk
    fit_tokens, chunk_tokens, chunk = training_fit(budget - margin - fixed_train - kv_kept)
    if run.micro_batch_tokens == "auto":
        tokens = token_budget(fit_tokens, row_tokens)
    else:
        tokens = int(run.micro_batch_tokens) or run.sequences * run.longest
    activations = measured_activation_bytes(micro_batch_bytes(tokens, kept, transient, chunk))
    # a no-grad forward: one layer's activations at a time (its backward's gradients never come) and the chunk
    # (eager attention's soft-cap gradients never come either; its scores as measured stay)
    no_grad = 4 * size.shape.intermediate * 2 + eager_gradient_extra(2) * block_scores_per_token(size.shape,
                                                                                                 run.longest)
    masks = 2 * 2 * run.longest if size.shape.score_heads else 0  # soft-capped attention's two masks, as in training
    # (bf16 on a GPU; a chunk without gradients holds half its training bytes: logprob_chunk_bytes)
    forward = tokens * (max(transient - no_grad, 0) + masks) + chunk // 2
    # (with adapted fused experts, each layer's folds live through its no-grad forward only: one layer's at a time)
    one_fold = expert_fold_bytes(size.adapted_expert_layer, size.largest_adapted_stack, 1, True, 2) if folds else 0
    forward = STEP_TENSORS_BYTES + (forward + one_fold if run.logprob_pass else 0)
    # physical peaks (what the driver reports for this process): what must fit the budget
    phases = {
        "rollout": fixed_rollout + (kv_bytes or 0) if weights is not None else
        0 if run.engine == "server" else context + held + 2 * (kv_needed or 0) + run.sequences * size.shape.vocab * 4,
        "logprobs": context + held + kept_physical + kv_kept + vllm_asleep + forward,
        "train": context + held + trainer["gradients"] + kept_physical + kv_kept + vllm_asleep + activations + folds,
    }
    if weights is not None:  # right after the update: torch still holds its blocks, the engine's weights come back
        phases["sync"] = max(phases["train"], context + held + engine + vllm_asleep + sync_merge_bytes(run, size))
    load = load_peak_bytes(run, size)
    if load:
        phases = {"load": context + load, **phases}
    phases = {name: int(value) for name, value in phases.items() if value}
    parts = {"context": context, **trainer, "engine weights": engine, "kv cache": kv_bytes or 0, "vllm": own,
             "activations": activations, "expert transient": folds}
    fits, why_not = True, ""
    over = {name: value for name, value in phases.items() if value > budget - margin}
    if over:
        fits = False
        name = max(over, key=over.get)
        why_not = (f"{name} needs {over[name] / GIB:.1f} GiB, more than the {(budget - margin) / GIB:.1f} GiB the "
                   f"budget leaves after {margin / GIB:.1f} kept back")
    elif kv_bytes and per_token and kv_bytes / (per_token * run.longest) < run.sequences:
        at_once = kv_bytes / (per_token * run.longest)
        notes.append(f"the KV cache holds about {at_once:.1f} of the step's {run.sequences} sequences at once "
                     f"({kv_needed / GIB:.1f} GiB would hold them all): vLLM runs the rest in waves")
    if run.micro_batch_tokens == "auto" and chunk_tokens < run.chunk_tokens:
        notes.append(f"log-probs in chunks of {chunk_tokens} tokens, not {run.chunk_tokens}, to fit")
    return MemoryPlan(gpu.name, budget, capped, weights, sleep_level, kv_bytes, kv_needed, **common,
                      engine_batched_tokens=batched_tokens, engine_max_seqs=max_seqs, micro_batch_tokens=tokens,
                      logprob_chunk_tokens=chunk_tokens, parts=parts, phases=phases, fits=fits, why_not=why_not,
                      notes=tuple(notes))
