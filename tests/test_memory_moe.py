"""The memory plan of a mixture of experts (tests/model_configs/qwen3-30b-a3b, Qwen3-30B-A3B's published config.json)
against figures worked by hand: qlora's 4-bit fused experts in the weight bytes, the training transient of LoRA on
the experts (peft's folded W + s B A stacks), the weight sync's merge of one expert stack, the load as measured, and
--plan_only at 80 and 48 GiB."""
import os

import pytest

from grpo.config.options import GRPOConfig
from grpo.memory import planner
from grpo.memory.activations import expert_fold_bytes
from grpo.memory.model_size import CODEBOOK_BYTES, four_bit_bytes_per_value, model_size, weight_bytes
from grpo.memory.engine import CONTEXT_BYTES
from grpo.memory.parts import sync_merge_bytes
from grpo.memory.plan import auto_checkpointing, plan_memory

from .trainer_setup import ROOT

GIB = 2**30
MOE = os.path.join(ROOT, "tests", "model_configs", "qwen3-30b-a3b")

# Qwen3-30B-A3B: hidden H 2048, 48 layers, 32 heads of 128, 4 KV heads, vocabulary 151936, untied output;
# 128 experts E of width I 768 a layer (fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]), a router of 128 x 2048
EMBED = 151_936 * 2048                      # 311,164,928, twice (embeddings, output layer)
ATTENTION = 2 * 2048 * 4096 + 2 * 2048 * 512  # q, o 2048x4096; k, v 2048x512 = 18,874,368 a layer (4-bit linears)
GATE_UP, DOWN = 128 * 1536 * 2048, 128 * 2048 * 768  # 402,653,184 and 201,326,592 a layer (4-bit experts)
SMALL = 2 * 128 + 2 * 2048 + 128 * 2048     # q / k norms, the two layer norms, the router: 266,496 a layer (16-bit)
P = 2 * EMBED + 48 * (ATTENTION + GATE_UP + DOWN + SMALL) + 2048  # + the final norm
Q_LINEAR, Q_EXPERTS = 48 * ATTENTION, 48 * (GATE_UP + DOWN)
# LoRA at rank 16 on all-linear: attention 16 (in + out) per layer; every expert of every stack 16 (in + out)
A = 48 * (16 * ((2048 + 4096) * 2 + (2048 + 512) * 2) + 128 * 16 * ((1536 + 2048) + (2048 + 768)))


def options(**flags) -> GRPOConfig:
    return GRPOConfig(**{"model_name_or_path": MOE, "rollout_engine": "vllm", "tuning_strategy": "qlora",
                         "per_device_train_batch_size": 8, "k_samples": 8, "rollout_max_new_tokens": 512, **flags})


@pytest.fixture(scope="module")
def counted():
    config = options()
    hf_config = planner.load_model_config(MOE, False)
    return hf_config, model_size(hf_config, config)


def plan(config, hf_config, size, cap_gib):
    run = planner.run_shape(config, hf_config, size, MOE)
    return plan_memory(run, size, planner.named_card(cap_gib), hf_config), run


def test_the_counts_by_hand(counted):
    _, size = counted
    assert (P, Q_LINEAR, Q_EXPERTS, A) == (30_532_122_624, 905_969_664, 28_991_029_248, 642_514_944)
    assert size.parameters == P
    assert size.quantized == Q_LINEAR + Q_EXPERTS  # Q: linear layers and fused experts
    assert size.quantized_experts == Q_EXPERTS and size.expert_stacks == 96
    assert size.adapter == A
    assert (size.adapted_expert_layer, size.largest_adapted_stack, size.adapted_expert_layers) == \
        (GATE_UP + DOWN, GATE_UP, 48)


def test_qlora_holds_the_experts_in_4_bits(counted):
    """q Q + the codebooks + 2 (P - Q) + 2 A at --qlora_block_size 32 (the default) and 64: about 16 GiB of base
    instead of the 55.6 it took with 16-bit experts."""
    _, size = counted
    assert options().qlora_block_size == 32
    # q = 1/2 + 1/32 + 4/8192 = 4356/8192; Q = 3,649,536 x 8192
    assert four_bit_bytes_per_value(32) * (Q_LINEAR + Q_EXPERTS) == 3_649_536 * 4356 == 15_897_378_816
    base_32 = 15_897_378_816 + 96 * 4 * (16 + 256) + 2 * (P - Q_LINEAR - Q_EXPERTS)
    assert base_32 == 15_897_378_816 + 104_448 + 1_270_247_424 == 17_167_730_688   # 15.99 GiB
    assert weight_bytes(size, "qlora", 2, 32) == base_32 + 2 * A == 18_452_760_576   # 17.19 GiB with the adapters
    assert CODEBOOK_BYTES == 1088
    # block 64: q = 8452/16384, Q = 1,824,768 x 16384
    assert weight_bytes(size, "qlora", 2, 64) == 1_824_768 * 8452 + 104_448 + 1_270_247_424 + 2 * A
    before = int(four_bit_bytes_per_value(32) * Q_LINEAR) + 2 * (P - Q_LINEAR) + 2 * A  # experts 16-bit
    assert 56 < before / GIB < 57 and 16.5 < weight_bytes(size, "qlora", 2, 32) / GIB < 17.5


def test_the_expert_transient_by_hand(counted):
    """b (E 2I H + E H I) for the two folded stacks + b E 2I H for one temporary, a layer at a time with
    checkpointing (1.875 GiB at Qwen3-30B-A3B's shape), every layer's folds without it."""
    _, size = counted
    with_ckpt = 2 * (GATE_UP + DOWN) + 2 * GATE_UP
    assert with_ckpt == 2_013_265_920 and with_ckpt / GIB == 1.875
    assert expert_fold_bytes(GATE_UP + DOWN, GATE_UP, 48, True, 2) == with_ckpt
    assert expert_fold_bytes(GATE_UP + DOWN, GATE_UP, 48, False, 2) == 2 * 48 * (GATE_UP + DOWN) + 2 * GATE_UP
    assert expert_fold_bytes(0, 0, 48, True, 2) == 0


@pytest.mark.parametrize("strategy", ["qlora", "lora"])
def test_the_plan_counts_the_transient_the_merge_and_the_load(counted, strategy):
    hf_config, size = counted
    config = options(tuning_strategy=strategy)
    p, run = plan(config, hf_config, size, 140)
    assert p.fits and p.gradient_checkpointing
    assert p.parts["expert transient"] == 2_013_265_920
    assert p.phases["train"] >= p.parts["activations"] + p.parts["expert transient"] + p.parts["base"]
    # the sync merges one expert stack in fp32 (read, delta, merged): 3 x 4 x E 2I H = 4.5 GiB > 2 x 2 x the layer
    assert sync_merge_bytes(run, size) == 12 * GATE_UP == int(4.5 * GIB) > 4 * size.largest_layer
    # qlora loads the 16-bit model (as measured under transformers 5.17) before quantizing its experts
    if strategy == "qlora":
        assert p.phases["load"] == CONTEXT_BYTES + 2 * P
    else:
        assert "load" not in p.phases
    off, _ = plan(options(tuning_strategy=strategy, gradient_checkpointing=False), hf_config, size, 140)
    assert not off.gradient_checkpointing
    assert off.parts["expert transient"] == 2 * 48 * (GATE_UP + DOWN) + 2 * GATE_UP


def test_no_expert_transient_without_adapted_experts():
    config = options(lora_target_modules="q_proj,k_proj,v_proj,o_proj")
    hf_config = planner.load_model_config(MOE, False)
    size = model_size(hf_config, config)
    assert size.adapted_expert_layer == 0 and size.adapter == 13_369_344
    assert size.quantized == Q_LINEAR + Q_EXPERTS  # qlora still holds the experts in 4 bits
    p, _ = plan(config, hf_config, size, 140)
    assert p.parts["expert transient"] == 0


def test_auto_checkpointing_is_on_for_adapted_experts_on_a_gpu():
    assert auto_checkpointing(500_000_000, True, None, adapted_experts=True)
    assert not auto_checkpointing(500_000_000, True, None)
    assert not auto_checkpointing(500_000_000, True, False, adapted_experts=True)


@pytest.mark.parametrize("gib", [80, 48])
def test_plan_only_at_80_and_48_gib(gib, capsys):
    """A colocated vLLM engine holds its own 16-bit copy (merged: qlora's 4-bit experts are no checkpoint vLLM
    loads), 56.9 GiB beside the trainer's 24 GiB: refused at both, with what fits; the HF engine fits 80 GiB (and is
    said first there), not 48."""
    from grpo.config import parse_args

    argv = ["--model_name_or_path", MOE, "--tuning_strategy", "qlora", "--rollout_engine", "vllm",
            "--gpu_memory_gib", str(gib), "--per_device_train_batch_size", "8", "--k_samples", "8",
            "--rollout_max_new_tokens", "512", "--plan_only"]
    assert planner.print_plan(parse_args(argv)) == 1
    out = capsys.readouterr().out
    assert "load (16-bit experts)" in out and "expert transient 1.88" in out and "base 15.99" in out
    fixes = out.split("What fits: ")[1].split("\n")[0]
    assert "a GPU with" in fixes and "--tuning_strategy qlora" not in fixes
    hf = parse_args([a if a != "vllm" else "hf" for a in argv])
    if gib == 80:  # the HF engine fits, and the refusal says so, before the larger card
        assert planner.print_plan(hf) == 0
        assert fixes.index("--rollout_engine hf") < fixes.index("a GPU with")
    else:
        assert planner.print_plan(hf) == 1 and "--rollout_engine hf" not in fixes
