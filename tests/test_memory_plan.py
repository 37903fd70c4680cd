"""The memory plan (grpo.memory) of published models' configs (tests/model_configs: config.json files, no weights),
against figures worked by hand: parameter counts, weight bytes per strategy, KV cache and activation bytes per token,
vLLM's own memory, the micro-batch budget, the automatic choices; --plan_only without a GPU; the refusal of a plan
that does not fit with what fits instead; a budget shared with other processes on one GPU."""
import dataclasses
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time

import pytest
import torch

from grpo.config import parse_args
from grpo.config.options import GRPOConfig
from grpo.errors import ConfigError
from grpo.memory import planner
from grpo.memory.activations import ModelShape, activation_bytes_per_token, logprob_chunk_bytes, micro_batch_bytes
from grpo.memory.advice import cheapest_fixes
from grpo.memory.engine import engine_batch_limits, vllm_asleep_bytes, vllm_own_bytes
from grpo.memory.kv_cache import kv_bytes_per_token
from grpo.memory.model_size import four_bit_bytes_per_value, model_size, weight_bytes
from grpo.memory.plan import (LEAST_TRAIN_TOKENS, GpuBudget, equation_room, measured_activation_bytes,
                              plan_memory, preferred_weights)
from grpo.memory.report import PLAN_FILE, plan_table, save_plan
from grpo.train.token_budget import GpuFigures

from .trainer_setup import ROOT, child_env

GIB = 2**30
CONFIGS = os.path.join(ROOT, "tests", "model_configs")
MODELS = ["llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "mistral-7b", "gemma-2-9b", "phi-3-mini", "qwen2.5-vl-7b",
          "llama-3.2-3b"]

# Llama-3.1-8B: hidden 4096, MLP 14336, 32 layers, 32 heads of 128, 8 KV heads, vocabulary 128256, untied output
LLAMA_P = 8_030_261_248   # 2 x 128256 x 4096 (embeddings, output) + 32 x 218,112,000 (a layer) + 4096 (final norm)
LLAMA_Q = 32 * 218_103_808  # q, o 4096x4096; k, v 4096x1024; gate, up, down 4096x14336 = 218,103,808 a layer
LLAMA_A = 32 * 1_310_720  # r = 16: 16 (4096 + 4096) x 2 (q, o) + 16 (4096 + 1024) x 2 (k, v) + 16 (4096 + 14336) x 3


def path(name: str) -> str:
    return os.path.join(CONFIGS, name)


def options(name: str, **flags) -> GRPOConfig:
    return GRPOConfig(**{"model_name_or_path": path(name), "rollout_engine": "vllm", "tuning_strategy": "qlora",
                         **flags})


@pytest.fixture(scope="module")
def counted():
    """(model config, ModelSize) of a config and the options that change the count, each counted once."""
    cache = {}

    def count(config):
        key = (config.model_name_or_path, config.tuning_strategy, config.lora_rank, config.lora_target_modules,
               config.lora_exclude_modules, config.qlora_skip_modules)
        if key not in cache:
            hf_config = planner.load_model_config(config.model_name_or_path, False)
            cache[key] = hf_config, model_size(hf_config, config)
        return cache[key]

    return count


@pytest.fixture(scope="module")
def plan_of(counted):
    """(plan, run shape, ModelSize) of `config` on `gpu`, as planner.plan_parts makes it, from the cached count."""
    def plan(config, gpu, completion_tokens=None):
        hf_config, size = counted(config)
        run = planner.run_shape(config, hf_config, size, config.model_name_or_path, completion_tokens)
        return plan_memory(run, size, gpu, hf_config), run, size

    return plan


# ---- what the model's parts take ----
@pytest.mark.parametrize("name, parameters, quantized, adapter", [
    # worked above
    ("llama-3.1-8b", LLAMA_P, LLAMA_Q, LLAMA_A),
    # embeddings and output 128256 x 3072 tied (once); a layer: q, o 3072x3072, k, v 3072x1024, gate, up, down
    # 3072x8192 = 100,663,296, two norms 6144; P = 394,002,432 + 28 x 100,669,440 + 3072;
    # A = 28 x (16 (6144) x 2 + 16 (4096) x 2 + 16 (11264) x 3) = 28 x 868,352
    ("llama-3.2-3b", 3_212_749_824, 28 * 100_663_296, 28 * 868_352),
    # a layer: q 3584x3584 (+ bias 3584), k, v 3584x512 (+ 512 each), o 3584x3584, gate, up, down 3584x18944:
    # 233,046,016 weights, 4608 biases, 7168 of norms; P = 2 x 152064 x 3584 + 28 x 233,057,792 + 3584;
    # A = 28 x (16 (7168) x 2 + 16 (4096) x 2 + 16 (22528) x 3) = 28 x 1,441,792
    ("qwen2.5-7b", 7_615_616_512, 28 * 233_046_016, 28 * 1_441_792),
    # a layer: q, o 4096x4096, k, v 4096x1024, gate, up, down 4096x12288 = 192,937,984, norms 2 x 4096 + q_norm and
    # k_norm 2 x 128; P = 2 x 151936 x 4096 + 36 x 192,946,432 + 4096; A = 36 x (16 (8192) x 2 + 16 (5120) x 2 +
    # 16 (16384) x 3) = 36 x 1,212,416
    ("qwen3-8b", 8_190_735_360, 36 * 192_937_984, 36 * 1_212_416),
    # Llama-3.1-8B's layers with a 32768 vocabulary: P = 2 x 32768 x 4096 + 32 x 218,112,000 + 4096
    ("mistral-7b", 7_248_023_552, LLAMA_Q, LLAMA_A),
    # 16 heads of 256 (q 3584 -> 4096), 8 KV heads (k, v 3584 -> 2048), MLP 14336: 14,680,064 x 2 + 7,340,032 x 2 +
    # 51,380,224 x 3 = 198,180,864 a layer, four norms 4 x 3584; tied 256000 x 3584 embeddings;
    # P = 917,504,000 + 42 x 198,195,200 + 3584; A = 42 x (16 (7680) x 2 + 16 (5632) x 2 + 16 (17920) x 3)
    ("gemma-2-9b", 9_241_705_984, 42 * 198_180_864, 42 * 1_286_144),
    # fused qkv_proj 3072 -> 9216 and gate_up_proj 3072 -> 16384: 28,311,552 + 9,437,184 + 50,331,648 + 25,165,824 =
    # 113,246,208 a layer; P = 2 x 32064 x 3072 + 32 x 113,252,352 + 3072; A = 32 x 16 (12288 + 6144 + 19456 + 11264)
    ("phi-3-mini", 3_821_079_552, 32 * 113_246_208, 32 * 786_432),
    # Qwen2.5-7B's language model plus a 676,550,144-parameter vision tower (below), never quantized nor adapted
    ("qwen2.5-vl-7b", 7_615_616_512 + 676_550_144, 28 * 233_046_016, 28 * 1_441_792),
])
def test_parameter_counts_of_published_configs(counted, name, parameters, quantized, adapter):
    _, size = counted(options(name))
    assert (size.parameters, size.quantized, size.adapter) == (parameters, quantized, adapter)
    assert size.adapter_all_linear == adapter  # the default targets are every linear layer: vLLM's slots as well
    assert not size.fused_experts


def test_the_vision_tower_counted_by_hand(counted):
    _, size = counted(options("qwen2.5-vl-7b"))
    # patch embedding: a Conv3d of 3 channels x (2 x 14 x 14) to 1280, no bias: 1,505,280
    # a block: two norms 2560; qkv 1280 -> 3840 + bias 4,919,040; proj 1280 -> 1280 + bias 1,639,680; gate, up
    # 1280 -> 3420 + bias 4,381,020 each; down 3420 -> 1280 + bias 4,378,880: 19,702,200; 32 blocks 630,470,400
    # merger: norm 1280; 5120 -> 5120 + bias 26,219,520; 5120 -> 3584 + bias 18,353,664: 44,574,464
    assert size.vision == 1_505_280 + 32 * 19_702_200 + 44_574_464 == 676_550_144
    assert size.shape == ModelShape(hidden=3584, intermediate=18944, layers=28, q_dim=3584, vocab=152064)


@pytest.mark.parametrize("name, layer", [
    ("llama-3.1-8b", 218_103_808 + 2 * 4096),         # its linear layers and two norms
    ("qwen2.5-7b", 233_046_016 + 4608 + 2 * 3584),     # and q, k, v's biases
    ("gemma-2-9b", 198_180_864 + 4 * 3584),            # four norms
])
def test_the_largest_layer_a_weight_sync_merges_at_once(counted, name, layer):
    assert counted(options(name))[1].largest_layer == layer


def test_the_largest_layer_of_a_vision_language_model_is_a_decoder_layer(counted):
    # as Qwen2.5-7B's; a vision block (19,702,200) would put a weight sync's merge 0.8 GiB under what it takes
    assert counted(options("qwen2.5-vl-7b"))[1].largest_layer == 233_057_792


def test_weight_bytes_per_strategy_worked_by_hand(counted):
    _, size = counted(options("llama-3.1-8b"))
    # q = 1/2 + 1/64 + 4 / (256 x 64) = 8452 / 16384 bytes a 4-bit value at bitsandbytes' block of 64
    assert four_bit_bytes_per_value(64) == 0.5 + 1 / 64 + 4 / 16384 == 8452 / 16384
    assert four_bit_bytes_per_value(32) == 0.5 + 1 / 32 + 4 / 8192 == 4356 / 8192
    assert weight_bytes(size, "full") == 2 * LLAMA_P == 16_060_522_496
    assert weight_bytes(size, "lora") == 2 * LLAMA_P + 2 * LLAMA_A == 16_144_408_576
    # q Q + 2 (P - Q) + 2 A: 425,984 x 8452 + 2 x 1,050,939,392 + 2 x 41,943,040 (Q = 16384 x 425,984)
    assert weight_bytes(size, "qlora", block_size=64) == 3_600_416_768 + 2_101_878_784 + 83_886_080 == 5_786_181_632
    # the default block of 32: Q = 8192 x 851,968, q = 4356 / 8192
    assert weight_bytes(size, "qlora", block_size=32) == 851_968 * 4356 + 2_101_878_784 + 83_886_080
    assert weight_bytes(size, "full", float_bytes=4) == 4 * LLAMA_P  # fp32 on a CPU


def test_what_the_options_change_in_the_count(counted):
    # two targets: A = 32 x (16 (4096 + 4096) + 16 (4096 + 1024)) = 32 x 212,992
    _, size = counted(options("llama-3.1-8b", lora_target_modules="q_proj,v_proj"))
    assert size.adapter == 32 * 212_992 == 6_815_744
    assert size.adapter_all_linear == LLAMA_A  # vLLM's LoRA slots still span every linear layer
    # down_proj left in 16 bits: Q loses 32 x 4096 x 14336
    _, size = counted(options("llama-3.1-8b", qlora_skip_modules="down_proj"))
    assert size.quantized == LLAMA_Q - 32 * 58_720_256 == 5_100_273_664
    _, size = counted(options("llama-3.1-8b", tuning_strategy="full"))
    assert (size.parameters, size.adapter) == (LLAMA_P, 0)


@pytest.mark.parametrize("name, per_token", [
    ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),    # 2 (K, V) x layers x KV heads x head_dim x 2 bytes = 131,072
    ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),      # 57,344
    ("qwen3-8b", 2 * 36 * 8 * 128 * 2),        # 147,456
    ("mistral-7b", 2 * 32 * 8 * 128 * 2),      # 131,072
    ("gemma-2-9b", 2 * 42 * 8 * 256 * 2),      # 344,064: sliding and full attention layers alike
    ("phi-3-mini", 2 * 32 * 32 * 96 * 2),      # 393,216: no grouped KV heads
    ("qwen2.5-vl-7b", 2 * 28 * 4 * 128 * 2),   # its language model's
    ("llama-3.2-3b", 2 * 28 * 8 * 128 * 2),    # 114,688
])
def test_kv_bytes_per_token_of_published_configs(counted, plan_of, name, per_token):
    hf_config, _ = counted(options(name))
    assert kv_bytes_per_token(hf_config) == per_token
    assert plan_of(options(name), planner.named_card(24))[0].kv_per_token == per_token


def test_activations_per_token_with_and_without_checkpointing(counted, plan_of):
    _, size = counted(options("llama-3.1-8b"))
    # H 4096, I 14336, q 4096, L 32; bf16 activations and adapters (a = b = 2), LoRA dropout (d = 1):
    #   layer    = 8H + 4qa + 3Ia + (b + d)(5H + q + I) = 32,768 + 32,768 + 86,016 + 3 x 38,912 = 268,288
    #   backward = 4Ia = 114,688;  ends = H (2a + 4) = 32,768
    #   checkpointing: kept = L H a + ends = 262,144 + 32,768;  transient = layer + backward
    #   without:       kept = L layer + ends = 8,585,216 + 32,768;  transient = backward
    with_ckpt, without = (294_912, 382_976), (8_617_984, 114_688)
    assert activation_bytes_per_token(size.shape, True, 2, 2, True, False) == with_ckpt
    assert activation_bytes_per_token(size.shape, False, 2, 2, True, False) == without
    chunk = logprob_chunk_bytes(1024, size.shape.vocab, False)
    assert chunk == 20 * 1024 * 128_256 == 2_626_682_880
    # the plan: checkpointing on by itself at 8B (from 1B parameters), off where asked; its activations are
    # 0.9 x (t kept + max(chunk, t transient)) + 1.5 GiB for its budget of t tokens, as measured on GPUs (the budget
    # keeps 1.5 x the equation within the room too). Without checkpointing 8.2 MiB a token
    # leave little beside the chunk, which is halved (down to 128 tokens) while it is what limits the budget
    cases = (({}, with_ckpt, True, 1024), ({"gradient_checkpointing": False}, without, False, 128))
    for flags, (kept, transient), on, chunk_tokens in cases:
        plan = plan_of(options("llama-3.1-8b", **flags), planner.named_card(80))[0]
        assert (plan.gradient_checkpointing, plan.logprob_chunk_tokens) == (on, chunk_tokens)
        tokens, chunk = plan.micro_batch_tokens, 20 * chunk_tokens * 128_256
        equation = tokens * kept + max(chunk, tokens * transient)
        assert plan.parts["activations"] == int(0.9 * equation) + int(1.5 * 2**30)
    assert "log-probs in chunks of 128 tokens, not 1024, to fit" in plan.notes


def test_vllms_own_memory_and_the_rollout_peak_worked_by_hand(plan_of):
    # Llama-3.1-8B, qlora, on a 24 GiB card: an adapter engine, vLLM's batches of T = 8192 tokens, S = 256 sequences
    plan, _, size = plan_of(options("llama-3.1-8b"), planner.named_card(24))
    assert (plan.rollout_weights, plan.engine_batched_tokens, plan.engine_max_seqs) == ("adapter", 8192, 256)
    assert engine_batch_limits(70 * GIB) == (16384, 1024) and engine_batch_limits(70 * GIB - 1) == (8192, 256)
    # tables 4.25 S V + 528 V = 139,542,528 + 67,719,168; the largest forward T (6I + 6h) = 8192 x 110,592 (more
    # than the sampler's 8 S V + 2 T h = 329,777,152); graphs: 512 x 110,592 + (51 + 35) x 2 (LoRA) graphs x 2 MiB;
    # LoRA 12 T r = 1,572,864; 4-bit 2 I h + 2 T I = 117,440,512 + 234,881,024; 1.25 GiB beside torch; 1 GiB
    # awake beyond the rest
    own = (139_542_528 + 67_719_168 + 905_969_664 + 56_623_104 + 172 * 2 * 2**20 + 1_572_864 + 352_321_536
           + 1_342_177_280 + GIB)
    assert own == 4_300_378_112
    # asleep it keeps the tables, the graph pool and what is beside torch
    assert vllm_asleep_bytes(size.shape, 256, lora_rank=16) == 139_542_528 + 67_719_168 + 56_623_104 \
        + 172 * 2 * 2**20 + 1_342_177_280 == 1_966_772_224
    assert vllm_own_bytes(size.shape, 8192, 256, lora_rank=16, four_bit=True) == own == plan.parts["vllm"]
    # the engine's LoRA slots: 2 A (rank 16 of 16) + 2 r (2 V + 2 h) for the embeddings' = 83,886,080 + 8,470,528
    assert plan.parts["engine weights"] == 2 * LLAMA_A + 2 * 16 * (2 * 128_256 + 2 * 4096) == 92_356_608
    # the trainer: base q Q + 2 (P - Q) at blocks of 32; optimizer 12 A (fp32 master, two moments); gradients 6 A
    assert plan.parts["base"] == 851_968 * 4356 + 2 * (LLAMA_P - LLAMA_Q) == 5_813_051_392
    assert (plan.parts["adapters"], plan.parts["optimizer"], plan.parts["gradients"]) == (2 * LLAMA_A, 12 * LLAMA_A,
                                                                                           6 * LLAMA_A)
    # KV: 16 sequences (2 prompts x 8) of 256 + 256 tokens, +25% = 10,240 tokens x 131,072 bytes = 1.25 GiB
    assert plan.kv_cache_bytes == plan.kv_needed_bytes == 10_240 * 131_072 == 5 * GIB // 4
    # rollout = context + base + adapters + optimizer + engine + kv + vllm
    rollout = GIB // 2 + 5_813_051_392 + 2 * LLAMA_A + 12 * LLAMA_A + 92_356_608 + 5 * GIB // 4 + own
    assert plan.phases["rollout"] == rollout == 12_672_036_864


def test_the_micro_batch_budget_worked_by_hand(plan_of):
    plan, _, _ = plan_of(options("llama-3.1-8b"), planner.named_card(24))
    # budget 24 GiB, 1.2 GiB (5%) kept back; training holds the context, the trainer's parts, its gradients and the
    # adapter engine's slots, what the sleeping vLLM keeps (1,966,772,224); its 1.25 GiB KV cache is unmapped while
    # it sleeps (free for training, under the cap too: lent to torch's cap meanwhile):
    #   room = 25,769,803,776 - 1,288,490,188 - (536,870,912 + 6,400,253,952 + 251,658,240 + 92,356,608)
    #          - 1,966,772,224 = 15,233,401,652;  / 1.5 = 10,155,601,101
    #   (the measured form binds only below 3.75 GiB of room: 1.5 (room - 1.5 GiB) / 0.9 >= room above it)
    #   t = min(room / (kept + transient), (room - chunk) / kept) = min(14,981, 27,310) -> 14,336 (steps of 1024)
    # its activations as measured: 0.9 x (14,336 x 294,912 + 14,336 x 382,976) + 1.5 GiB
    #   = 0.9 x 9,718,202,368 + 1,610,612,736 = 8,746,382,131 + 1,610,612,736 = 10,356,994,867
    assert plan.micro_batch_tokens == 14_336 and plan.logprob_chunk_tokens == 1024
    assert micro_batch_bytes(14_336, 294_912, 382_976, 2_101_346_304) == 9_718_202_368
    assert plan.parts["activations"] == 10_356_994_867
    assert plan.fits and not plan.why_not


def test_activations_as_measured_and_the_room_the_equation_gets():
    # 0.9 x the equation + 1.5 GiB:  0.9 x 2 GiB + 1.5 GiB = 3.3 GiB
    assert measured_activation_bytes(2 * 2**30) == int(0.9 * 2 * 2**30) + int(1.5 * 2**30)
    # the budget keeps both 1.5 x equation <= room and the measured form <= room:
    #   room 3 GiB:  1.5 (3 - 1.5) / 0.9 = 2.5 GiB < 3 GiB  -> the equation gets 2.5 GiB, i.e. at most 2.5 / 1.5 =
    #   1.667 GiB of equation bytes, whose measured form is 0.9 x 1.667 + 1.5 = 3.0 GiB: exactly the room
    assert equation_room(3 * 2**30) == int(2.5 * 2**30)
    assert measured_activation_bytes(int(equation_room(3 * 2**30) / 1.5)) <= 3 * 2**30
    #   room 8 GiB:  1.5 (8 - 1.5) / 0.9 = 10.83 GiB > 8 GiB  -> 1.5 x the equation binds: the room as it is
    assert equation_room(8 * 2**30) == 8 * 2**30
    #   less than the overhead: nothing
    assert equation_room(2**30) == 0


@pytest.mark.parametrize("name, weights, sleep", [
    # 0.4 x 24 GiB = 9.6 GiB: a 16-bit copy above it takes the adapter (sleep level 1, the base held once)
    ("llama-3.1-8b", "adapter", 1),   # 2P = 14.96 GiB
    ("qwen2.5-7b", "adapter", 1),     # 14.18 GiB
    ("qwen3-8b", "adapter", 1),       # 15.26 GiB
    ("mistral-7b", "adapter", 1),     # 13.50 GiB
    ("gemma-2-9b", "adapter", 1),     # 17.21 GiB
    ("qwen2.5-vl-7b", "adapter", 1),  # 15.45 GiB
    # below: merged, kept through training (level 0) up to 0.25 x 24 = 6 GiB, else level 2
    ("phi-3-mini", "merged", 2),      # 2 x 3,821,079,552 = 7.12 GiB
    ("llama-3.2-3b", "merged", 0),    # 2 x 3,212,749,824 = 5.98 GiB
])
def test_the_plans_choices_on_a_24_gib_card(plan_of, name, weights, sleep):
    plan, run, size = plan_of(options(name), planner.named_card(24))
    assert plan.fits, plan.why_not
    assert (plan.rollout_weights, plan.sleep_level) == (weights, sleep)
    assert preferred_weights(run, size, 24 * GIB)[0] == weights
    # the step's 16 sequences of 512 tokens at once, +25%
    assert plan.kv_cache_bytes == plan.kv_needed_bytes == 10_240 * plan.kv_per_token
    assert plan.sequences_at_once == 20.0
    assert plan.budget == 24 * GIB and plan.capped and plan.peak <= 24 * GIB


def test_auto_weights_take_a_mode_whose_cache_holds_the_step(counted, plan_of):
    # Llama-3.1-8B, qlora, 4 prompts x 8 samples of 256 + 8192 tokens under --gpu_memory_gib 60 of an 80 GiB GPU:
    # its 14.96 GiB copy is within 0.4 x 60 = 24 GiB, so merged comes first, but (torch's cap counting the sleeping
    # engine's weights) merged leaves less of the 41.25 GiB the 32 sequences need: the adapter holds them all
    config = options("llama-3.1-8b", per_device_train_batch_size=4, k_samples=8, rollout_max_new_tokens=8192)
    gpu = GpuBudget(80 * GIB, 80 * GIB, 60 * GIB, "H100")
    plan, run, size = plan_of(config, gpu)
    assert preferred_weights(run, size, gpu.budget) == ["merged", "adapter"]
    assert plan.kv_needed_bytes == 337_920 * 131_072  # 1.25 x 32 x 8448 tokens
    merged = plan_memory(dataclasses.replace(run, rollout_weights="merged"), size, gpu, counted(config)[0])
    assert not merged.fits or merged.sequences_at_once < 32
    assert plan.rollout_weights == "adapter" and plan.sequences_at_once > merged.sequences_at_once
    # the whole GPU uncapped: the sleeping engine gives its cache and weights back, and merged holds them all
    plan = plan_of(config, GpuBudget(80 * GIB, 80 * GIB, None, "H100"))[0]
    assert (plan.rollout_weights, plan.sleep_level, plan.kv_cache_bytes) == ("merged", 0, 337_920 * 131_072)


def test_under_a_cap_the_cache_leaves_training_its_least_micro_batch(plan_of):
    # the same step under --gpu_memory_gib 40, 24 and 20: the cache holds fewer of the 32 sequences (the rest run in
    # waves, said in a note), never fewer tokens than one --max_seq_length sequence and 256 more, and training keeps
    # micro-batches of max(one row of 8448, LEAST_TRAIN_TOKENS) tokens
    config = options("llama-3.1-8b", per_device_train_batch_size=4, k_samples=8, rollout_max_new_tokens=8192)
    held = []
    for cap in (40, 24, 20):
        plan = plan_of(config, GpuBudget(80 * GIB, 80 * GIB, cap * GIB, "H100"))[0]
        assert plan.fits, (cap, plan.why_not)
        assert (8448 + 256) * 131_072 <= plan.kv_cache_bytes < plan.kv_needed_bytes
        assert plan.micro_batch_tokens >= max(8448, LEAST_TRAIN_TOKENS)
        at_once = plan.kv_cache_bytes / (131_072 * 8448)
        assert f"the KV cache holds about {at_once:.1f} of the step's 32 sequences at once (41.2 GiB" in \
            " ".join(plan.notes)
        held.append(at_once)
    assert held == sorted(held, reverse=True)


# ---- --plan_only ----
def weightless_copy(name: str, folder) -> str:
    """The published config beside shards no loader could read: a plan that read any weight would fail."""
    shutil.copy(os.path.join(path(name), "config.json"), folder)
    (folder / "model.safetensors").write_bytes(b"not a checkpoint")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight":
                                                                                    "model.safetensors"}}))
    return str(folder)


def plan_only(model: str, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    """`train_grpo.py --plan_only` in a child without a GPU: (its result, the CPU seconds it took)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "train_grpo.py", "--model_name_or_path", model, "--rollout_engine", "vllm",
                           "--plan_only", *flags], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=child_env(CUDA_VISIBLE_DEVICES=""))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def test_plan_only_prints_the_plan_without_a_gpu_or_any_weight(tmp_path):
    model = weightless_copy("llama-3.1-8b", tmp_path)
    started = time.monotonic()
    proc, cpu_seconds = plan_only(model, "--tuning_strategy", "qlora", "--gpu_memory_gib", "24")
    wall = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    # its own work: under 10 s of CPU (the wall time also counts whatever else this machine runs)
    assert cpu_seconds < 10, (cpu_seconds, wall)
    lines = proc.stdout.splitlines()
    assert lines[0] == "memory plan for a 24 GiB card (--gpu_memory_gib; no GPU here): budget 24.00 GiB " \
                       "(--gpu_memory_gib)"
    assert lines[1] == ("  choices: vLLM weights adapter, sleep level 1; KV cache 1.25 GiB (20.0 of 16 sequences of "
                        "512 tokens at once); vLLM batches of 8192 tokens / 256 sequences; micro-batches of 14336 "
                        "tokens, log-prob chunks of 1024, checkpointing on")
    assert lines[2].startswith("  parts (GiB): context 0.50, base 5.41, adapters 0.08, optimizer 0.47, gradients 0.23,"
                               " engine weights 0.09, kv cache 1.25, vllm 4.01, activations 9.65")
    assert lines[3].split() == ["phase", "planned", "peak", "GiB"]
    phases = {line[:32].strip(): float(line[32:]) for line in lines[4:8]}
    # (no --kl_beta: no log-prob pass before the update, the step's tensors only (1.5 GiB); the sync follows the
    # update, whose blocks torch still holds: the training peak)
    assert phases == {"rollout (engine awake)": 11.80, "old / reference log-probs": 9.88,
                      "training (one micro-batch)": 18.26, "weight sync": 18.26}
    assert "DOES NOT FIT" not in proc.stdout and "Loading" not in proc.stderr


def test_plan_only_on_a_cpu_without_a_card_to_plan_for(capsys):
    with pytest.raises(ConfigError, match="--plan_only: there is no GPU here to plan for; name the card with "
                                          "--gpu_memory_gib"):
        planner.print_plan(options("llama-3.1-8b"))
    # the HF engine on a CPU: planned in RAM (fp32), nothing refused
    assert planner.print_plan(options("llama-3.2-3b", rollout_engine="hf")) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory plan for a CPU run (RAM; nothing is refused): micro-batches of 16384 tokens, "
                          "gradient checkpointing on")


# ---- a plan that does not fit ----
OVERSIZED = ["--tuning_strategy", "qlora", "--per_device_train_batch_size", "4", "--k_samples", "8",
             "--rollout_max_new_tokens", "8192"]


def applied(flags: list[str], fix: str, cap: int) -> list[str]:
    """The flags with a suggestion as one would type it ("a GPU with N GiB (--gpu_memory_gib N)" names the cap)."""
    card = re.search(r"--gpu_memory_gib (\d+)", fix)
    if card:
        return flags + ["--gpu_memory_gib", card.group(1)]
    return flags + fix.split() + ["--gpu_memory_gib", str(cap)]


def fixes_of(flags: list[str], cap: int) -> list[str]:
    config = parse_args(flags + ["--gpu_memory_gib", str(cap)])
    plan, run, size, gpu, hf_config = planner.plan_parts(config, config.model_name_or_path)
    assert not plan.fits
    return cheapest_fixes(run, size, gpu, hf_config, config)


def test_a_plan_that_does_not_fit_is_refused_with_what_fits(tmp_path):
    # (Qwen3-8B at 8,192 new tokens: on a 16 GiB card its training needs 15.3 GiB of the 15.0 the budget leaves)
    model = weightless_copy("qwen3-8b", tmp_path)
    proc, _ = plan_only(model, *OVERSIZED, "--gpu_memory_gib", "16")
    assert proc.returncode == 1, proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("the memory plan does not fit a 16 GiB card (--gpu_memory_gib; no GPU here)'s 16.00 GiB "
                            "budget: train needs ")
    what_fits = first.split("What fits: ")[1]
    assert "--rollout_max_new_tokens 4096" in what_fits
    assert re.search(r"--gpu_memory_gib (\d+)", what_fits)
    assert "  DOES NOT FIT: train needs" in proc.stdout  # the table follows, its phases and why
    # each suggestion, applied, fits
    flags = ["--model_name_or_path", path("qwen3-8b"), "--rollout_engine", "vllm", *OVERSIZED]
    fixes = fixes_of(flags, 16)
    assert fixes[0] == "--rollout_max_new_tokens 4096" and "--gpu_memory_gib" in fixes[-1]
    for fix in fixes:
        config = parse_args(applied(flags, fix, 16))
        assert planner.plan_parts(config, config.model_name_or_path)[0].fits, fix
    # a training run is refused the same way before any weight loads
    with pytest.raises(ConfigError, match=r"the memory plan does not fit .* What fits: --rollout_max_new_tokens 4096"):
        config = parse_args(flags + ["--gpu_memory_gib", "16"])
        planner.checked_plan(config, config.model_name_or_path)


@pytest.mark.parametrize("flags, cap", [
    (["--tuning_strategy", "full"], 24),
    (["--tuning_strategy", "lora", "--rollout_weights", "merged"], 24),
    (OVERSIZED, 12),
])
def test_every_suggestion_applied_fits(flags, cap):
    flags = ["--model_name_or_path", path("llama-3.1-8b"), "--rollout_engine", "vllm", *flags]
    fixes = fixes_of(flags, cap)
    assert fixes
    for fix in fixes:
        config = parse_args(applied(flags, fix, cap))
        assert planner.plan_parts(config, config.model_name_or_path)[0].fits, fix


@pytest.mark.parametrize("flags, cap", [
    (OVERSIZED + ["--max_seq_length", "8448"], 14),
    (["--tuning_strategy", "lora", "--gradient_checkpointing", "false", "--rollout_max_new_tokens", "4096"], 24),
], ids=["explicit max_seq_length", "default max_seq_length floor"])
def test_a_shorter_completion_suggested_fits_with_the_max_seq_length_it_leaves(flags, cap):
    flags = ["--model_name_or_path", path("llama-3.1-8b"), "--rollout_engine", "vllm", *flags]
    for fix in fixes_of(flags, cap):
        config = parse_args(applied(flags, fix, cap))
        assert planner.plan_parts(config, config.model_name_or_path)[0].fits, fix


def test_a_server_mode_training_rank_plans_no_generation(plan_of, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = options("llama-3.1-8b", rollout_mode="server", rollout_gpus=1, per_device_train_batch_size=4,
                     k_samples=8, rollout_max_new_tokens=8192)
    plan, run, _ = plan_of(config, planner.named_card(24))
    assert run.engine == "server" and plan.kv_cache_bytes is None and plan.sleep_level is None
    # the 32 sequences of 8448 tokens are generated on the rollout ranks: 2 x 41.25 GiB of KV cache is not here
    assert plan.fits, plan.why_not
    assert "engine weights" not in {name for name, value in plan.parts.items() if value}
    # the rollout ranks' weights are the plan's choice too, whatever this GPU's budget: the adapter where they take it
    assert plan.rollout_weights == "adapter"
    assert "the rollout ranks' vLLM weights adapter" in plan_table(plan)


# ---- one GPU shared with other processes ----
def test_two_caps_on_one_device():
    # --gpu_memory_gib 40 on a 140 GiB H200: the cap binds while 50 GiB are free; where another process leaves only
    # 30 free, those 30 (never the cap less what the others hold: their memory is not free already)
    assert GpuBudget(140 * GIB, 50 * GIB, 40 * GIB, "H200").budget == 40 * GIB
    assert GpuBudget(140 * GIB, 30 * GIB, 40 * GIB, "H200").budget == 30 * GIB
    assert GpuBudget(140 * GIB, 30 * GIB, None, "H200").budget == 30 * GIB
    assert GpuBudget(24 * GIB, None, 40 * GIB, "a 24 GiB card").budget == 24 * GIB  # never past the card
    # kept back: 5% of the budget, at least 1 GiB
    assert GpuBudget(140 * GIB, 50 * GIB, 40 * GIB, "H200").margin == 2 * GIB
    assert GpuBudget(140 * GIB, None, 16 * GIB, "H200").margin == GIB


def test_a_gpu_shared_with_another_process_plans_for_what_is_free(plan_of, monkeypatch):
    # the plan of a run capped at 40 GiB where 30 are free is the plan of a 30 GiB card
    config = options("qwen2.5-7b", tuning_strategy="lora", per_device_train_batch_size=4)
    shared = plan_of(config, GpuBudget(140 * GIB, 30 * GIB, 40 * GIB, "H200"))[0]
    card = plan_of(config, planner.named_card(30))[0]
    assert shared.budget == card.budget == 30 * GIB
    assert dataclasses.replace(shared, gpu="") == dataclasses.replace(card, gpu="")
    # this rank's GPU as the planner reads it: free now, plus this process's context, which every phase counts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    selected = []
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)  # the rank's own GPU, asked after selecting it
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (30 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    gpu = planner.local_gpu_budget(40)
    assert gpu == GpuBudget(140 * GIB, 30 * GIB + GIB // 2, 40 * GIB, "NVIDIA H200 (140 GiB)")
    assert gpu.budget == 30.5 * GIB and selected == [0]
    assert planner.local_gpu_budget(None).budget == 30.5 * GIB
    with pytest.raises(ConfigError, match="--gpu_memory_gib 141: this GPU has 140.0 GiB"):
        planner.local_gpu_budget(141)


def test_the_token_budget_room_counts_another_process_once():
    # the same H200: another process holds 90 GiB, this run (capped at 40) 20 GiB as torch counts it, so 30 are
    # free; 2 GiB (5% of 40) kept back: room = min(30 - 2, 40 - 20 - 2) = 18 GiB. Subtracting what lies beyond the
    # cap (140 - 40) from the free memory as well would leave none.
    shared = GpuFigures(free=30 * GIB, cached=0, total=140 * GIB, usable=40 * GIB, to_come=0,
                        capped_allocated=20 * GIB)
    assert shared.room == 18 * GIB
    # another process holding 110 GiB leaves 10 free: then the free memory binds, min(10 - 2, 18) = 8 GiB
    assert dataclasses.replace(shared, free=10 * GIB).room == 8 * GIB


# ---- the plan as saved beside the run ----
def test_the_plan_is_saved_with_its_table(plan_of, tmp_path):
    plan = plan_of(options("gemma-2-9b"), planner.named_card(24))[0]
    saved = json.loads(open(save_plan(plan, str(tmp_path))).read())
    assert os.path.basename(save_plan(plan, str(tmp_path))) == PLAN_FILE
    assert saved["table"] == plan_table(plan)
    assert (saved["micro_batch_tokens"], saved["kv_cache_bytes"], saved["rollout_weights"]) == (
        plan.micro_batch_tokens, plan.kv_cache_bytes, "adapter")
    assert saved["kv_per_token"] == 2 * 42 * 8 * 256 * 2


def test_the_log_prob_pass_and_the_reference_copy_follow_kl_beta(plan_of):
    """No --kl_beta: no pass before the update (the step's tensors only); --kl_beta: the reference's pass; full
    fine-tuning keeps a frozen copy for it, with the penalty in the loss or (--kl_in_reward) in the reward."""
    card = planner.named_card(80)
    plain = plan_of(options("llama-3.2-3b", tuning_strategy="full"), card)[0]
    for flags in ({"kl_beta": 0.04}, {"kl_beta": 0.04, "kl_in_reward": True}):
        kl = plan_of(options("llama-3.2-3b", tuning_strategy="full", **flags), card)[0]
        # a 16-bit copy of all 3.21B parameters
        assert "reference" not in plain.parts and kl.parts["reference"] == 2 * 3_212_749_824
        assert kl.phases["logprobs"] > plain.phases["logprobs"] + kl.parts["reference"]


def test_lora_on_fused_experts_is_counted():
    """A mixture of experts whose experts transformers fuses: LoRA on each expert of an [E, a, b] tensor is
    E r (a + b) values (grpo.model.expert_targets picks the tensors), counted with the adapters and their optimizer."""
    from transformers import MixtralConfig

    from grpo.memory.model_size import build_on_meta, count_model

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = build_on_meta(config, False)
    # per layer: gate_up_proj [4, 64, 16] -> 4 x 2 x (64 + 16) = 640; down_proj [4, 16, 32] -> 4 x 2 x 48 = 384
    everything = count_model(model, 2, "all-linear")
    attention = count_model(model, 2, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert everything.adapter - attention.adapter == 2 * (640 + 384)
    assert count_model(model, 2, ["w2"]).adapter == 2 * 384  # the checkpoint's name for down_proj
    assert everything.fused_experts


def test_a_rollout_in_many_rounds_is_warned_of_with_what_shortens_it(grpo_log):
    """Mistral-7B on a 16 GiB card with 8,192 new tokens fits, but its KV cache holds one of the step's 32
    sequences: the plan says so, with the changes after which the rollout decodes in at most MAX_WAVES rounds."""
    from grpo.memory.advice import MAX_WAVES, few_waves_fixes, rollout_waves

    flags = ["--model_name_or_path", path("mistral-7b"), "--rollout_engine", "vllm", "--tuning_strategy", "qlora",
             "--per_device_train_batch_size", "4", "--k_samples", "8", "--rollout_max_new_tokens", "8192"]
    config = parse_args(flags + ["--gpu_memory_gib", "16"])
    plan, run, size, gpu, hf_config = planner.plan_parts(config, config.model_name_or_path)
    assert plan.fits and rollout_waves(plan) > MAX_WAVES
    fixes = few_waves_fixes(run, size, gpu, hf_config, config)
    assert fixes[0].startswith("--rollout_max_new_tokens") and "--gpu_memory_gib" in fixes[-1]
    for fix in fixes:
        fixed = planner.plan_parts(parse_args(applied(flags, fix, 16)), config.model_name_or_path)[0]
        assert fixed.fits and rollout_waves(fixed) <= MAX_WAVES, fix
    planner.checked_plan(config, config.model_name_or_path)
    warned = "\n".join(grpo_log)
    assert f"the rollout decodes in about {rollout_waves(plan)} rounds" in warned
    assert f"Fewer rounds: {fixes[0]}" in warned
    # the whole step at once: no warning
    grpo_log.clear()
    short = parse_args(flags[:-1] + ["512", "--gpu_memory_gib", "24"])
    planner.checked_plan(short, short.model_name_or_path)
    assert grpo_log and not any("rounds" in line for line in grpo_log)
