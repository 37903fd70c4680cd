"""What a colocated vLLM engine (0.26, in-process, its default V2 model runner for dense models) holds beside its
weights and KV cache, and what every CUDA process holds.

Given the KV cache in bytes, vLLM still profiles one forward of its largest batch (T = max_num_batched_tokens) and
warms its sampler up on min(S, T / 2) rows (S = max_num_seqs), keeps per-sequence sampler tables, and captures its
CUDA graphs after the cache is allocated, unchecked. Per GPU, in bytes (h, I, V: hidden, MLP and vocabulary sizes;
r: vLLM's LoRA rank; vllm/v1/worker/gpu/model_runner.py, gpu/sample/, config/vllm.py of v0.26.0):

    vllm = 4.25 S V + 528 V                        sampler tables (penalties, grammar bitmask) and top-k buffers
         + max(e T (6 I + 6 h), 8 S V + 2 T h)     the largest forward (e = 1.3 eager) or the sampler's warm-up
         + [graphs] Tg (6 I + 6 h) + G 2 MiB       the graph pool: its largest capture plus ~2 MiB a graph,
                                                   Tg = min(512, 2 S, T), G = 51 piecewise + full decode graphs
                                                   (35 at S = 256, 51 from 512), twice with LoRA
         + [LoRA] 12 T r                           the LoRA kernels' fp32 buffers
         + [4-bit] 2 I h + 2 T I                   a dequantized shard and the 4-bit layers' output copies
         + VLLM_NON_TORCH_BYTES                    kernels, workspaces, fragmentation
         + AWAKE_SLACK_BYTES                       measured beyond the rest while it decodes
    asleep, vLLM keeps its tables, its graph pool and what is outside torch (vllm_asleep_bytes): sleep frees its
    pools (weights, KV cache), not those

T and S are the plan's (vLLM's own defaults for a card of the budget's size: 16384 and 1024 from 70 GiB, else 8192
and 256), passed to vLLM explicitly, so a capped large GPU runs as the card it stands for.
"""
from __future__ import annotations

from grpo.memory.activations import ModelShape

GIB, MIB = 2**30, 2**20
LARGE_CARD_BYTES = 70 * GIB  # vLLM's larger defaults from here (vllm/engine/arg_utils.py)
# kernels, workspaces and what no formula here counts; set from the runs of 2026-11-29 (benchmarks/RESULTS.md: four
# 7-9B shapes in 4 bits under --gpu_memory_gib 24, whose rollouts peaked 1.1-1.9 GiB above the formulas with 0.75)
VLLM_NON_TORCH_BYTES = 5 * GIB // 4
# awake, beside the parts above: the rollouts of those runs peaked 1.0-1.4 GiB above them (torch's blocks of the
# decode steps, which vLLM's profile run does not reach)
AWAKE_SLACK_BYTES = GIB
# the CUDA context, cuBLAS workspaces and the kernels' modules of one process, which torch does not count
CONTEXT_BYTES = GIB // 2


def engine_batch_limits(budget: int) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs): vLLM's defaults for the offline LLM class on a card of `budget`."""
    return (16384, 1024) if budget >= LARGE_CARD_BYTES else (8192, 256)


def vllm_asleep_bytes(shape: ModelShape, max_seqs: int, lora_rank: int = 0, eager: bool = False) -> int:
    """What vLLM keeps while it sleeps, whatever the level: its sampler tables, its CUDA graph pool and the memory
    outside torch (module docstring's terms)."""
    per_token = 6 * shape.intermediate + 6 * shape.hidden
    tables = int(4.25 * max_seqs * shape.vocab) + 528 * shape.vocab
    graphs = 0
    if not eager:
        count = (51 + (35 if max_seqs < 512 else 51)) * (2 if lora_rank else 1)
        graphs = min(512, 2 * max_seqs) * per_token + count * 2 * MIB
    return tables + graphs + VLLM_NON_TORCH_BYTES


def vllm_own_bytes(shape: ModelShape, batched_tokens: int, max_seqs: int, lora_rank: int = 0,
                   four_bit: bool = False, eager: bool = False) -> int:
    """vLLM's own memory beside its weights and cache, awake (module docstring)."""
    h, inter, vocab, T, S = shape.hidden, shape.intermediate, shape.vocab, batched_tokens, max_seqs
    largest = max(int((1.3 if eager else 1.0) * T * (6 * inter + 6 * h)), 8 * S * vocab + 2 * T * h)
    lora = 12 * T * lora_rank
    quantized = 2 * inter * h + 2 * T * inter if four_bit else 0
    return vllm_asleep_bytes(shape, S, lora_rank, eager) + largest + lora + quantized + AWAKE_SLACK_BYTES
