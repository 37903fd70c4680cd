"""--vllm_kv_cache_gib: the KV cache's bytes per token and the step's need against numbers worked by hand, the size
the memory plan gives the cache (grpo.memory.plan) on published models' configs, and the flag's parsing."""
import os
import subprocess
import sys

import pytest
from transformers import DeepseekV3Config, LlamaConfig, Qwen2VLConfig, Qwen3NextConfig

from grpo.config import parse_args
from grpo.config.options import GRPOConfig
from grpo.errors import ConfigError
from grpo.memory import planner
from grpo.memory.kv_cache import auto_kv_cache_bytes, completions_per_prompt, kv_bytes_per_token
from grpo.memory.plan import LEAST_TRAIN_TOKENS, GpuBudget

from .trainer_setup import ROOT, child_env

GIB = 2**30
LLAMA_8B = os.path.join(ROOT, "tests", "model_configs", "llama-3.1-8b")
LLAMA_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B: 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 131,072
# the 0.68B Llama of the rollout benchmark: 20 layers, 16 heads of 96 over hidden 1536, 8 KV heads
LLAMA_068 = LlamaConfig(num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=8, hidden_size=1536)


def test_bytes_per_token_by_hand():
    # 2 (K, V) x 20 layers x 8 KV heads x 96 x 2 bytes (bf16)
    assert kv_bytes_per_token(LLAMA_068) == 2 * 20 * 8 * 96 * 2 == 61_440
    # tensor parallelism splits the KV heads: 4 per GPU over 2 GPUs
    assert kv_bytes_per_token(LLAMA_068, tensor_parallel_size=2) == 30_720
    # more GPUs than KV heads: vLLM replicates, one head per GPU
    assert kv_bytes_per_token(LLAMA_068, tensor_parallel_size=16) == 2 * 20 * 1 * 96 * 2
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 576 / 9 = 64
    smollm2 = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_bytes_per_token(smollm2) == 2 * 30 * 3 * 64 * 2 == 23_040
    # an explicit head_dim wins over hidden / heads
    assert kv_bytes_per_token(LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          hidden_size=64, head_dim=32)) == 2 * 2 * 2 * 32 * 2


@pytest.mark.parametrize("config", [DeepseekV3Config(), Qwen3NextConfig()], ids=["mla", "hybrid linear attention"])
def test_caches_auto_cannot_size(config):
    assert kv_bytes_per_token(config) is None
    assert auto_kv_cache_bytes(None, 128, 384, 384) is None


def test_a_vision_language_models_cache_is_its_language_models():
    config = Qwen2VLConfig(text_config={"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
                                        "hidden_size": 256})
    # 2 (K and V) x 3 layers x 2 KV heads x 32 head_dim x 2 bytes
    assert kv_bytes_per_token(config) == 2 * 3 * 2 * 32 * 2 == 768


def test_a_field_that_refuses_to_be_read_means_no_single_size():
    class PerLayerHeadDim:  # as transformers' Gemma-4 text config, whose head_dim differs per layer
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 2, 4, 2, 64

        @property
        def head_dim(self):
            raise RuntimeError("head_dim differs per layer")

    assert kv_bytes_per_token(PerLayerHeadDim()) is None


def test_auto_size_by_hand():
    # 16 prompts x 8 samples of at most 128 + 256 tokens, +25%: 61,440 tokens x 61,440 bytes = 3.515625 GiB
    assert auto_kv_cache_bytes(61_440, 128, 384, 384) == 61_440 * 61_440
    assert auto_kv_cache_bytes(61_440, 128, 384, 384) / 2**30 == 3.515625
    # never less than one max_seq_length sequence and 256 tokens of slack (vLLM's start-up check, whole blocks)
    assert auto_kv_cache_bytes(100, 1, 128, 768) == (768 + 256) * 100


def plan_parts(gpu=None, completion_tokens=None, model=LLAMA_8B, **flags):
    """(plan, run shape, ModelSize, budget, model config) of Llama-3.1-8B, qlora with vLLM, on `gpu` (a 24 GiB card)."""
    config = GRPOConfig(**{"model_name_or_path": model, "rollout_engine": "vllm", "tuning_strategy": "qlora",
                           **flags})
    return planner.plan_parts(config, model, completion_tokens, gpu=gpu or planner.named_card(24))


def test_the_plan_sizes_the_cache_for_the_steps_sequences():
    # 2 x 3 prompts x 4 samples = 24 sequences of at most 128 + 64 tokens, +25% = 5,760 tokens
    flags = dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, k_samples=4, max_prompt_length=128,
                 rollout_max_new_tokens=64, max_seq_length=512)
    plan, run = plan_parts(**flags)[:2]
    assert (run.sequences, run.longest, run.max_seq_length) == (24, 192, 512)
    assert plan.kv_cache_bytes == plan.kv_needed_bytes == 5_760 * LLAMA_PER_TOKEN
    assert plan.kv_per_token == LLAMA_PER_TOKEN and plan.sequences_at_once == 30.0  # 24 x 1.25
    # multi-turn episodes grow to their token budget: 24 x (128 + 256) tokens, +25% = 11,520; never past the sequence
    assert plan_parts(completion_tokens=256, **flags)[0].kv_cache_bytes == 11_520 * LLAMA_PER_TOKEN
    assert plan_parts(completion_tokens=10_000, **flags)[0].kv_cache_bytes == 15_360 * LLAMA_PER_TOKEN
    # an 80 GiB GPU holds the same: the step's need, not what the GPU has room for
    assert plan_parts(GpuBudget(80 * GIB, 80 * GIB, None, "H100"), **flags)[0].kv_cache_bytes == \
        5_760 * LLAMA_PER_TOKEN
    # given in GiB: as given, whatever the step needs
    assert plan_parts(vllm_kv_cache_gib="1.5", **flags)[0].kv_cache_bytes == 3 * 2**29


def test_never_less_than_one_max_seq_length_sequence():
    # 1 prompt x 2 samples of 64 + 64 tokens need 1.25 x 256 = 320 tokens; vLLM starts only with room for one
    # --max_seq_length sequence: 4096 + 256 tokens of whole blocks
    plan = plan_parts(per_device_train_batch_size=1, k_samples=2, max_prompt_length=64, rollout_max_new_tokens=64,
                      max_seq_length=4096)[0]
    assert plan.kv_needed_bytes == plan.kv_cache_bytes == (4096 + 256) * LLAMA_PER_TOKEN


def test_a_sequence_parallel_engine_holds_its_share_of_the_completions(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, k_samples=3, max_prompt_length=128,
                 rollout_max_new_tokens=64, max_seq_length=512, sequence_parallel_size=2)
    # k = 3 over a group of 2: the fuller engine generates 2 of each prompt's; 6 prompts x 2 = 12 sequences of
    # 128 + 64 tokens, +25% = 2,880 tokens
    assert completions_per_prompt(GRPOConfig(**flags)) == 2
    plan, run = plan_parts(**flags)[:2]
    assert (run.sequences, run.dp, run.sp) == (12, 1, 2)
    assert plan.kv_needed_bytes == 2_880 * LLAMA_PER_TOKEN
    # the first rank generating them all: 6 x 3 = 18 sequences, 4,320 tokens
    first = plan_parts(sequence_parallel_rollout="first", **flags)[0]
    assert first.kv_needed_bytes == 4_320 * LLAMA_PER_TOKEN


def test_under_a_cap_the_cache_is_left_smaller_and_says_how_many_sequences_it_holds():
    # 4 prompts x 8 samples of 256 + 8192 tokens: 1.25 x 32 x 8448 = 337,920 tokens, 41.25 GiB
    flags = dict(per_device_train_batch_size=4, k_samples=8, rollout_max_new_tokens=8192)
    needed = 337_920 * LLAMA_PER_TOKEN
    assert needed == 41.25 * GIB
    # the whole 80 GiB GPU, the engine asleep through training: all of it
    plan = plan_parts(GpuBudget(80 * GIB, 80 * GIB, None, "H100"), **flags)[0]
    assert plan.kv_cache_bytes == plan.kv_needed_bytes == needed
    assert not any("at once" in note for note in plan.notes)
    # --gpu_memory_gib 24 (as a 24 GiB card): the cache gets what the budget leaves beside the engine and the
    # trainer while it generates (unmapped while training, it costs training nothing); the rest of the step runs in
    # waves
    plan, run = plan_parts(planner.named_card(24), **flags)[:2]
    assert plan.fits and (8448 + 256) * LLAMA_PER_TOKEN <= plan.kv_cache_bytes < needed
    assert plan.micro_batch_tokens >= max(run.max_seq_length, LEAST_TRAIN_TOKENS)
    at_once = plan.kv_cache_bytes / (LLAMA_PER_TOKEN * 8448)
    assert 1 < at_once < 32 and at_once == plan.sequences_at_once
    assert f"the KV cache holds about {at_once:.1f} of the step's 32 sequences at once (41.2 GiB would hold them " \
           "all): vLLM runs the rest in waves" in plan.notes
    # 4 GiB more, more of the step at once
    assert plan_parts(planner.named_card(28), **flags)[0].kv_cache_bytes > plan.kv_cache_bytes
    # an engine awake through training (--vllm_sleep false) keeps its cache there too: left smaller on the GPU
    awake = plan_parts(GpuBudget(80 * GIB, 80 * GIB, None, "H100"), vllm_sleep=False, **flags)[0]
    assert awake.kv_cache_bytes <= needed and awake.micro_batch_tokens >= LEAST_TRAIN_TOKENS


def test_under_a_tight_cap_the_cache_keeps_its_floor():
    # where the rollout leaves less than one --max_seq_length sequence, the cache keeps that one (vLLM starts with no
    # less) and the plan says what does not fit
    flags = dict(per_device_train_batch_size=4, k_samples=8, rollout_max_new_tokens=8192)
    plan = plan_parts(planner.named_card(12), **flags)[0]
    assert plan.kv_cache_bytes == (8448 + 256) * LLAMA_PER_TOKEN == 1.0625 * GIB
    assert not plan.fits and plan.why_not.startswith("train needs")


def tiny_config_dir(config, folder) -> str:
    config.save_pretrained(str(folder))
    return str(folder)


MLA = DeepseekV3Config(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, n_routed_experts=4,
                       num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32,
                       qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1)
HYBRID = Qwen3NextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, num_experts=4, moe_intermediate_size=128,
                         num_experts_per_tok=2)


@pytest.mark.parametrize("config", [MLA, HYBRID], ids=["mla", "hybrid linear attention"])
def test_a_model_without_a_plain_cache_is_left_to_vllms_share(config, tmp_path):
    model = tiny_config_dir(config, tmp_path)
    plan = plan_parts(model=model, tuning_strategy="lora")[0]
    assert plan.kv_per_token is None and plan.kv_needed_bytes is None and plan.kv_cache_bytes is None
    assert any("no plain per-token K/V cache to size; vLLM's memory share sizes it" in note for note in plan.notes)
    assert plan.sequences_at_once == plan.sequences  # nothing to say how many it holds
    # given in GiB, the cache is as given
    assert plan_parts(model=model, tuning_strategy="lora", vllm_kv_cache_gib="2")[0].kv_cache_bytes == 2 * GIB


def test_an_engine_without_weights_of_its_own_has_no_cache_to_size():
    # the HF engine generates with the policy itself: no vLLM cache, its generation counted in the rollout phase as
    # the step's K/V twice (2 x 24 x 192 x 1.25 tokens) and fp32 logits of one position per sequence
    plan = plan_parts(rollout_engine="hf", per_device_train_batch_size=2, gradient_accumulation_steps=3,
                      k_samples=4, max_prompt_length=128, rollout_max_new_tokens=64, max_seq_length=512)[0]
    assert plan.rollout_weights is None and plan.kv_cache_bytes is None
    assert plan.kv_needed_bytes == 5_760 * LLAMA_PER_TOKEN
    trainer = sum(plan.parts[name] for name in ("context", "base", "adapters", "optimizer"))
    assert plan.phases["rollout"] == trainer + 2 * 5_760 * LLAMA_PER_TOKEN + 24 * 128_256 * 4


def test_flag_values_and_defaults(monkeypatch):
    assert parse_args(["--vllm_kv_cache_gib", "AUTO"]).vllm_kv_cache == "auto"
    assert parse_args(["--vllm_kv_cache_gib", "4"]).vllm_kv_cache == 4.0
    for bad in ("lots", "0", "-2", "inf", "0.0001"):
        with pytest.raises(ConfigError, match="--vllm_kv_cache_gib: got .* give auto, share or a number of GiB"):
            parse_args(["--vllm_kv_cache_gib", bad])
    monkeypatch.setenv("WORLD_SIZE", "2")
    server = ["--rollout_mode", "server", "--rollout_gpus", "1"]
    assert parse_args(server).vllm_kv_cache == "share"  # rollout ranks only generate: all of their share
    assert parse_args(server + ["--vllm_kv_cache_gib", "8"]).vllm_kv_cache == 8.0
    with pytest.raises(ConfigError, match="--vllm_kv_cache_gib: auto is for colocated engines"):
        parse_args(server + ["--vllm_kv_cache_gib", "auto"])


def test_wake_keeps_torch_cache_only_with_room_to_spare():
    from grpo.rollout.vllm_memory import WAKE_MARGIN_BYTES, room_beside_cache

    gib = 2**30
    assert WAKE_MARGIN_BYTES == gib
    # 3.5 GiB of KV cache to map: 4.5 GiB free is exactly enough with the 1 GiB margin, a byte less is not
    assert room_beside_cache(int(4.5 * gib), int(3.5 * gib))
    assert not room_beside_cache(int(4.5 * gib) - 1, int(3.5 * gib))
    # nothing to map still needs the margin (vLLM's own temporaries outside torch's cache)
    assert not room_beside_cache(gib // 2, 0)


# two gloo ranks whose GPUs have different memory free: both must plan from the least (the ranks of a
# tensor-parallel group size their KV caches alike)
RANKS_AGREE = """
import sys, torch, torch.distributed as dist
from tests.spawn_ranks import join_world, spawn_ranks

def rank_main(rank, port, model):
    join_world(rank, port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    gib = 2**30
    from grpo.config.options import GRPOConfig
    from grpo.memory import planner
    from grpo.memory.plan import GpuBudget

    # rank 0: 70 GiB free of 80; rank 1: 40 (another process holds the rest); both capped at 60
    mine = GpuBudget(80 * gib, (70 - 30 * rank) * gib, 60 * gib, f"GPU {rank}")
    planner.local_gpu_budget = lambda cap_gib: mine
    config = GRPOConfig(model_name_or_path=model, rollout_engine="vllm", tuning_strategy="qlora",
                        per_device_train_batch_size=4, k_samples=8, rollout_max_new_tokens=8192,
                        gpu_memory_gib=60)
    own = planner.checked_plan(config, model, gpu=mine)
    agreed = planner.agreed_plan(own, config, model, config.rollout_max_new_tokens)
    assert own.budget == (60 - 20 * rank) * gib, own.budget
    assert agreed.budget == 40 * gib, agreed.budget
    figures = torch.tensor([float(agreed.kv_cache_bytes), float(agreed.micro_batch_tokens)], dtype=torch.float64)
    others = figures.clone()
    dist.all_reduce(others, op=dist.ReduceOp.MAX)
    assert torch.equal(figures, others), (figures, others)  # the same cache and budget on both ranks

if __name__ == "__main__":
    spawn_ranks(rank_main, sys.argv[1])
    print("agreed")
"""


def test_every_rank_plans_for_the_least_budget(tmp_path):
    script = tmp_path / "ranks_agree.py"
    script.write_text(RANKS_AGREE)
    proc = subprocess.run([sys.executable, str(script), LLAMA_8B], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=child_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("agreed"), proc.stderr[-3000:]


def test_one_rank_keeps_its_own_plan():
    plan = plan_parts()[0]
    assert planner.agreed_plan(plan, None, LLAMA_8B, 256) is plan
    assert planner.agreed_plan(None, None, LLAMA_8B, 256) is None
