"""Which weights the vLLM engine takes (--rollout_weights: merged, adapter, in_place) and at which level it
sleeps: the memory plan's size rules (grpo.memory.plan) against numbers worked by hand, and what the loaded policy
and its checkpoint still refuse (grpo.rollout.engines); on CPU."""
import dataclasses
import os
import shutil

import pytest
import torch

from grpo.config.options import GRPOConfig
from grpo.errors import ConfigError
from grpo.memory.activations import ModelShape
from grpo.memory.model_size import ModelSize
from grpo.memory.plan import (ADAPTER_FROM_SHARE, IN_PLACE_FROM_BYTES, KEEP_WEIGHTS_UP_TO_SHARE,
                              UNPLANNED_SLEEP_LEVEL, MemoryPlan, RunShape, default_sleep_level, preferred_weights)
from grpo.model.loading import load_policy

from .sync_setup import CPU, IDS, STOCK_4BIT, trained_policy

GIB = 2**30


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model


def run_shape(strategy="qlora", **changes) -> RunShape:
    """What the plan reads of the options, for the size rules: one GPU, auto weights, every mode possible."""
    run = RunShape(strategy=strategy, engine="vllm", tp=1, dp=1, zero3=False, sequences=16, longest=512,
                   max_seq_length=768, sp=1, kl_reference=False, lora_rank=16, lora_dropout=True, block_size=64,
                   chunk_tokens=1024, full_logits=False, checkpointing=None, micro_batch_tokens="auto",
                   kv_cache="auto", rollout_weights="auto", sleep_level=None, vllm_sleep=True, eager=False,
                   capable=("in_place", "adapter", "merged") if strategy == "lora" else ("adapter", "merged"))
    return dataclasses.replace(run, **changes)


def sized(parameters: int) -> ModelSize:
    """A model of `parameters` parameters (all the size rules read: its 16-bit copy is 2 x parameters bytes)."""
    shape = ModelShape(hidden=3584, intermediate=18944, layers=28, q_dim=3584, vocab=152064)
    return ModelSize(parameters, 0, 0, 0, 0, 0, 0, False, shape)


QWEN_7B = sized(7_615_616_512)   # Qwen2.5-7B: a 15,231,233,024-byte (14.19 GiB) copy
LLAMA_3B = sized(3_212_749_824)  # Llama-3.2-3B: 6,425,499,648 bytes (5.98 GiB)


def test_qlora_auto_takes_the_adapter_where_the_16bit_copy_crowds_the_gpu():
    """qlora: merged while a 16-bit copy takes at most ADAPTER_FROM_SHARE (0.4) of the budget (it generates
    faster), adapter beyond; the other mode next, where the first does not fit."""
    assert ADAPTER_FROM_SHARE == 0.4
    qlora = run_shape("qlora")
    # 14.19 GiB against 0.4 x 24 = 9.6 GiB: the adapter; against 0.4 x 36 = 14.4 GiB: merged; 0.4 x 35 = 14.0: not
    assert preferred_weights(qlora, QWEN_7B, 24 * GIB) == ["adapter", "merged"]
    assert preferred_weights(qlora, QWEN_7B, 36 * GIB) == ["merged", "adapter"]
    assert preferred_weights(qlora, QWEN_7B, 35 * GIB) == ["adapter", "merged"]
    # the boundary itself: the copy is 0.4 of 2.5 x 15,231,233,024 bytes
    assert preferred_weights(qlora, QWEN_7B, 38_078_082_560)[0] == "merged"
    assert preferred_weights(qlora, QWEN_7B, 38_078_082_560 - 8)[0] == "adapter"
    # what this model and these options cannot take is left out; an explicit choice is tried alone
    assert preferred_weights(run_shape("qlora", capable=("merged",)), QWEN_7B, 24 * GIB) == ["merged"]
    assert preferred_weights(run_shape("qlora", rollout_weights="merged"), QWEN_7B, 24 * GIB) == ["merged"]
    assert preferred_weights(run_shape("full", capable=("merged",)), QWEN_7B, 24 * GIB) == ["merged"]


def test_lora_auto_merges_in_place_from_8_gib_or_a_quarter_of_the_gpu():
    """lora: merged while its 16-bit copy takes less than IN_PLACE_FROM_BYTES (8 GiB) and at most
    KEEP_WEIGHTS_UP_TO_SHARE (0.25) of the budget, in_place beyond either; adapter where in_place cannot be."""
    assert (IN_PLACE_FROM_BYTES, KEEP_WEIGHTS_UP_TO_SHARE) == (8 * GIB, 0.25)
    lora = run_shape("lora")
    # Qwen2.5-7B's 14.19 GiB is past 8 GiB: in_place on any GPU
    assert preferred_weights(lora, QWEN_7B, 80 * GIB) == ["in_place", "adapter", "merged"]
    assert preferred_weights(lora, QWEN_7B, 10**15)[0] == "in_place"
    # Llama-3.2-3B's 5.98 GiB: within 0.25 x 24 = 6 GiB, merged; 0.25 x 23 = 5.75 GiB, in_place
    assert preferred_weights(lora, LLAMA_3B, 24 * GIB) == ["merged", "in_place", "adapter"]
    assert preferred_weights(lora, LLAMA_3B, 23 * GIB) == ["in_place", "adapter", "merged"]
    # 4.0e9 parameters: 7.45 GiB, under 8 and within 0.25 x 80: merged; 0.68e9 likewise
    assert preferred_weights(lora, sized(4_000_000_000), 80 * GIB)[0] == "merged"
    assert preferred_weights(lora, sized(680_000_000), 80 * GIB)[0] == "merged"
    assert preferred_weights(lora, sized(4_294_967_296), 80 * GIB)[0] == "in_place"  # exactly 8 GiB
    # in_place not possible (a vision-language model, MLA, ZeRO-3, no Triton, ...): the adapter by qlora's order
    no_in_place = run_shape("lora", capable=("adapter", "merged"))
    assert preferred_weights(no_in_place, QWEN_7B, 80 * GIB) == ["adapter", "merged"]
    assert preferred_weights(run_shape("lora", capable=("merged",)), QWEN_7B, 80 * GIB) == ["merged"]
    assert preferred_weights(run_shape("lora", rollout_weights="in_place"), LLAMA_3B, 10**15) == ["in_place"]


def test_a_merged_lora_engine_keeps_its_weights_through_training_where_they_are_small_next_to_the_gpu():
    """--vllm_sleep_level by default: 0 (the KV cache alone, so a sync writes only the adapted layers) for lora /
    qlora with merged weights on one GPU while their 16-bit copy takes at most KEEP_WEIGHTS_UP_TO_SHARE of the
    budget; 2 beyond, for full fine-tuning and under tensor parallelism; 1 for an engine that holds the base once
    (adapter, in_place), which keeps it anyway; an explicit level always wins."""
    # Llama-3.2-3B's 5.98 GiB: within 0.25 x 24 GiB, level 0; past 0.25 x 23 GiB, level 2
    for strategy in ("lora", "qlora"):
        assert default_sleep_level(run_shape(strategy), "merged", LLAMA_3B, 24 * GIB) == 0
        assert default_sleep_level(run_shape(strategy), "merged", LLAMA_3B, 23 * GIB) == 2
    assert default_sleep_level(run_shape("full"), "merged", LLAMA_3B, 80 * GIB) == 2
    assert default_sleep_level(run_shape("qlora", tp=2), "merged", LLAMA_3B, 80 * GIB) == 2
    assert default_sleep_level(run_shape("qlora"), "adapter", LLAMA_3B, 80 * GIB) == 1
    assert default_sleep_level(run_shape("lora"), "in_place", QWEN_7B, 24 * GIB) == 1
    assert default_sleep_level(run_shape("qlora", sleep_level=2), "merged", LLAMA_3B, 80 * GIB) == 2
    assert default_sleep_level(run_shape("qlora", sleep_level=0), "adapter", QWEN_7B, 24 * GIB) == 0


def memory_plan(weights: str | None, sleep_level: int | None) -> MemoryPlan:
    """A plan with these engine choices (the rest as a CPU run's)."""
    return MemoryPlan("a card", 24 * GIB, False, weights, sleep_level, None, None, None, sequences=16, longest=512,
                      engine_batched_tokens=None, engine_max_seqs=None, micro_batch_tokens=16384,
                      logprob_chunk_tokens=1024, gradient_checkpointing=True)


def test_the_engine_sleeps_at_the_plans_level(model_dir):
    """engine_sleep_level: --vllm_sleep_level where given; else the plan's, for the weights it planned; the plan's
    UNPLANNED_SLEEP_LEVEL (2) where the loaded policy made the engine take other weights than planned."""
    from grpo.rollout import engines

    def level(weights, plan, **options):
        cfg = GRPOConfig(**{"model_name_or_path": model_dir, "tuning_strategy": "qlora", "rollout_engine": "vllm",
                            **options})
        return engines.engine_sleep_level(cfg, plan, weights)

    planned = memory_plan("merged", 0)
    assert level("merged", planned) == 0
    assert level("adapter", memory_plan("adapter", 1)) == 1
    assert UNPLANNED_SLEEP_LEVEL == 2
    assert level("merged", memory_plan("adapter", 1)) == 2  # fell back from adapter
    assert level("merged", planned, vllm_sleep_level=2) == 2 and level("adapter", None, vllm_sleep_level=0) == 0
    with pytest.raises(ConfigError, match="vllm_sleep_level"):
        GRPOConfig(model_name_or_path=model_dir, vllm_sleep_level=3)


def test_rollout_weights_take_the_plans_choice_and_fall_back_where_the_policy_cannot_take_it(model_dir,
                                                                                              monkeypatch):
    """qlora with vLLM: auto takes the plan's choice (merged or adapter); the adapter falls back to merged where
    vLLM's LoRA cannot take the model, and an explicit adapter there is an error."""
    from grpo.rollout import engines

    cfg = GRPOConfig(model_name_or_path=model_dir, tuning_strategy="qlora", rollout_engine="vllm", lora_rank=4,
                     lora_alpha=8, lora_dropout=0.0)
    policy = trained_policy(model_dir, "qlora")
    assert engines.engine_weights(cfg, policy, vision=None, planned="merged") == "merged"
    assert engines.engine_weights(cfg, policy, vision=None, planned="adapter") == "adapter"
    with pytest.raises(ValueError, match="auto is the memory plan's choice"):  # decided nowhere else
        engines.engine_weights(cfg, policy, vision=None)
    assert engines.engine_weights(cfg, policy, vision=object(), planned="adapter") == "merged"  # a VL model
    explicit = GRPOConfig(model_name_or_path=model_dir, tuning_strategy="qlora", rollout_engine="vllm",
                          rollout_weights="adapter")
    assert engines.engine_weights(explicit, policy, vision=None, planned="merged") == "adapter"  # as asked
    with pytest.raises(ConfigError, match="vision-language"):
        engines.engine_weights(explicit, policy, vision=object(), planned="adapter")
    # a 16-bit part of a layer vLLM fuses (its skip list names the fused layer): the engine could not load the base
    skips_v = GRPOConfig(**{**cfg.__dict__, "qlora_skip_modules": "model.layers.0.self_attn.v_proj,down_proj"})
    assert engines.engine_weights(skips_v, policy, vision=None, planned="adapter") == "merged"
    with pytest.raises(ConfigError, match=r"cannot take --qlora_skip_modules v_proj \(vLLM quantizes qkv_proj as "
                                          r"one layer.*use --rollout_weights merged"):
        engines.engine_weights(GRPOConfig(**{**skips_v.__dict__, "rollout_weights": "adapter"}), policy, None)
    skips_down = GRPOConfig(**{**cfg.__dict__, "qlora_skip_modules": "down_proj"})  # not fused: still adapter
    assert engines.engine_weights(skips_down, policy, vision=None, planned="adapter") == "adapter"
    # MLA attention (DeepSeek-V2/V3): vLLM's LoRA scored it 0.4-0.8 nats off the policy (tests/gpu/test_vllm_sync.py)
    monkeypatch.setattr(policy.config, "kv_lora_rank", 512, raising=False)
    assert engines.engine_weights(cfg, policy, vision=None, planned="adapter") == "merged"
    with pytest.raises(ConfigError, match="adapter: vLLM's LoRA cannot take MLA.*use --rollout_weights merged"):
        engines.engine_weights(explicit, policy, None)


def lora_with_vllm(model_dir, **options) -> GRPOConfig:
    return GRPOConfig(model_name_or_path=model_dir, tuning_strategy="lora", rollout_engine="vllm", lora_rank=4,
                      lora_alpha=8, lora_dropout=0.0, **options)


def test_lora_takes_the_plans_in_place_or_merged(model_dir, monkeypatch, grpo_log):
    """lora with vLLM: auto takes the plan's in_place or merged; an explicit in_place at any plan."""
    from grpo.rollout import engines

    lora = lora_with_vllm(model_dir)
    lora_policy = trained_policy(model_dir, "lora")
    monkeypatch.setattr(engines, "has_triton", lambda: True)  # (a CUDA build of torch brings it)
    assert engines.engine_weights(lora, lora_policy, vision=None, planned="merged") == "merged"
    assert "vLLM takes merged weights (--rollout_weights auto; the memory plan says why)" in grpo_log[-1]
    assert engines.engine_weights(lora, lora_policy, vision=None, planned="in_place") == "in_place"
    assert "vLLM holds the base once, shared with the trainer" in grpo_log[-1]
    explicit_in_place = lora_with_vllm(model_dir, rollout_weights="in_place")
    assert engines.engine_weights(explicit_in_place, lora_policy, vision=None, planned="merged") == "in_place"
    # MLA attention (DeepSeek-V2/V3): vLLM decodes through W_UK_T / W_UV, views of kv_b_proj's bf16 weight, so the
    # merge reaches them (tests/gpu/test_vllm_sync.py)
    monkeypatch.setattr(lora_policy.config, "kv_lora_rank", 512, raising=False)
    assert engines.engine_weights(lora, lora_policy, vision=None, planned="in_place") == "in_place"
    assert engines.engine_weights(explicit_in_place, lora_policy, vision=None) == "in_place"
    monkeypatch.setattr(engines, "has_triton", lambda: False)  # in_place cannot: auto falls back as for qlora, ...
    assert engines.engine_weights(lora, lora_policy, vision=None, planned="in_place") == "merged"
    assert "vLLM takes merged weights: its LoRA cannot take MLA attention" in grpo_log[-1]  # ... nor the adapter
    assert any("vLLM cannot merge in place into the shared base (a merge without Triton" in line
               for line in grpo_log[-3:])


def test_in_place_refuses_what_its_merge_cannot_take(model_dir, monkeypatch):
    """What in_place cannot take: auto falls back as qlora's rule does, an explicit in_place is an error that
    names the reason."""
    from grpo.rollout import engines
    from grpo.sync import merge_record

    lora = lora_with_vllm(model_dir)
    explicit_in_place = lora_with_vllm(model_dir, rollout_weights="in_place")
    lora_policy = trained_policy(model_dir, "lora")
    monkeypatch.setattr(engines, "has_triton", lambda: True)
    # a vision-language model: no in_place, and vLLM's LoRA does not know the tiny text model as one
    assert engines.engine_weights(lora, lora_policy, vision=object(), planned="in_place") == "merged"
    with pytest.raises(ConfigError, match="in_place merges one plain LoRA adapter.*vision-language"):
        engines.engine_weights(explicit_in_place, lora_policy, vision=object())
    with pytest.raises(ConfigError, match="in_place.*--tuning_strategy lora"):
        GRPOConfig(model_name_or_path=model_dir, tuning_strategy="qlora", rollout_engine="vllm",
                   rollout_weights="in_place")
    monkeypatch.setattr(merge_record, "KERNEL_MAX_RANK", 2)  # the policy's rank 4 is above it
    with pytest.raises(ConfigError, match="in_place.*cannot take a LoRA rank above 2"):
        engines.engine_weights(explicit_in_place, lora_policy, vision=None)
    assert engines.engine_weights(lora, lora_policy, vision=None, planned="in_place") == "adapter"
    monkeypatch.setattr(merge_record, "KERNEL_MAX_RANK", 64)
    monkeypatch.setattr(engines, "has_triton", lambda: False)
    with pytest.raises(ConfigError, match="in_place.*cannot take a merge without Triton"):
        engines.engine_weights(explicit_in_place, lora_policy, vision=None)
    monkeypatch.setattr(engines, "has_triton", lambda: True)
    next(lora_policy.parameters()).ds_id = 0  # a ZeRO-3 partition: auto takes the adapter, as for qlora
    assert engines.engine_weights(lora, lora_policy, vision=None, planned="in_place") == "adapter"
    with pytest.raises(ConfigError, match="in_place.*ZeRO-3"):
        engines.engine_weights(explicit_in_place, lora_policy, vision=None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="rollout_weights.*--vllm_tp 1"):
        GRPOConfig(model_name_or_path=model_dir, tuning_strategy="qlora", rollout_engine="vllm", vllm_tp=2,
                   rollout_weights="adapter")


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_a_mixture_of_experts_model_takes_merged_weights(tmp_path, monkeypatch, strategy):
    """transformers fuses a mixture-of-experts checkpoint's experts on load; vLLM holds them per the checkpoint, so
    they cannot be shared and in_place / adapter would hold the base twice: the planner offers merged alone. The
    loaded policy refuses in_place, and for qlora adapter too (its experts stay 16-bit, so vLLM cannot load the
    trainer's 4-bit base); lora may take the adapter when asked (the engine loads its own 16-bit base)."""
    from grpo.memory import planner
    from grpo.rollout import engines

    from .tiny_models import make_tiny_moe_model_dir

    folder = make_tiny_moe_model_dir(str(tmp_path / "moe"))
    options = dict(lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="k_proj,o_proj,q_proj,v_proj")
    policy = trained_policy(folder, strategy, targets=options["lora_target_modules"])
    monkeypatch.setattr(engines, "has_triton", lambda: True)
    auto = GRPOConfig(model_name_or_path=folder, tuning_strategy=strategy, rollout_engine="vllm", **options)
    plan, run, size = planner.plan_parts(auto, folder, gpu=planner.named_card(24))[:3]
    assert size.fused_experts and run.capable == ("merged",) and plan.rollout_weights == "merged"
    for planned in ("in_place", "adapter", "merged"):
        assert engines.engine_weights(auto, policy, vision=None, planned=planned) == \
            ("adapter" if strategy == "lora" and planned != "merged" else "merged")
    if strategy == "lora":
        adapter = GRPOConfig(**{**auto.__dict__, "rollout_weights": "adapter"})
        assert engines.engine_weights(adapter, policy, vision=None) == "adapter"
    for explicit in (["in_place"] if strategy == "lora" else ["adapter"]):
        config = GRPOConfig(**{**auto.__dict__, "rollout_weights": explicit})
        with pytest.raises(ConfigError, match=rf"--rollout_weights {explicit}.*cannot take tensors that transformers "
                                              r"fused or moved on load \(6, e\.g\. model\.layers\.0\.mlp\.experts\.down_proj\)"):
            engines.engine_weights(config, policy, vision=None)
    # server mode: the rollout ranks load their own 16-bit base, so lora's adapter is planned for them (qlora's
    # experts stay 16-bit: merged), and the loaded policy keeps that choice
    monkeypatch.setenv("WORLD_SIZE", "2")
    server = GRPOConfig(**{**auto.__dict__, "rollout_mode": "server", "rollout_gpus": 1})
    plan, run = planner.plan_parts(server, folder, gpu=planner.named_card(24))[:2]
    expected = "adapter" if strategy == "lora" else "merged"
    assert run.capable == (expected, "merged")[:1 if expected == "merged" else 2] and plan.rollout_weights == expected
    assert engines.engine_weights(server, policy, vision=None, planned=plan.rollout_weights) == expected


def test_the_planner_offers_the_modes_the_options_can_take(model_dir, monkeypatch):
    """capable_weights, before any weight loads: in_place for plain lora on one colocated GPU, adapter where vLLM's
    LoRA takes the model and options, merged always (a checkpoint saved in 4 bits: the adapter only)."""
    from grpo.memory import planner

    def capable(**options):
        cfg = GRPOConfig(**{"model_name_or_path": model_dir, "rollout_engine": "vllm", "lora_rank": 4,
                            "lora_alpha": 8, **options})
        hf_config = planner.load_model_config(model_dir, False)
        from grpo.memory.model_size import model_size

        return planner.capable_weights(cfg, hf_config, model_size(hf_config, cfg), model_dir)

    assert capable(tuning_strategy="lora") == ("in_place", "adapter", "merged")
    assert capable(tuning_strategy="qlora") == ("adapter", "merged")
    assert capable(tuning_strategy="full") == ("merged",)
    assert capable(tuning_strategy="qlora", qlora_init="loftq") == ("merged",)
    assert capable(tuning_strategy="qlora", qlora_skip_modules="v_proj") == ("merged",)  # part of vLLM's qkv_proj
    assert capable(tuning_strategy="lora", lora_rank=1024, lora_alpha=8) == ("merged",)  # past vLLM's and the kernels'
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert capable(tuning_strategy="lora", vllm_tp=2) == ("merged",)


def test_a_checkpoint_saved_in_4bit_trains_with_qlora_as_it_is(model_dir, tmp_path, monkeypatch):
    """A bitsandbytes 4-bit folder (as hub *-bnb-4bit models ship) loads for qlora with its own 4-bit weights, never
    a 16-bit copy; the engine then takes the adapter (a merged engine would start from 16-bit weights that are not
    there); lora, merged engines, loftq and a merged final model are refused before any model loads."""
    from grpo.model.base_weights import check_checkpoint_weights
    from grpo.model.quantized_checkpoint import write_4bit_checkpoint
    from grpo.rollout import engines

    trained = trained_policy(model_dir, "qlora", **STOCK_4BIT)
    folder = str(tmp_path / "bnb-4bit")
    write_4bit_checkpoint(trained, folder, dtype=torch.float32)
    for name in os.listdir(model_dir):  # the tokenizer, as a hub folder has it
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(model_dir, name), folder)
    cfg = GRPOConfig(model_name_or_path=folder, tuning_strategy="qlora", rollout_engine="vllm", lora_rank=4,
                     lora_alpha=8, lora_dropout=0.0)
    check_checkpoint_weights(cfg, folder)  # default block options: no 16-bit weights needed, none read
    policy = load_policy(cfg, folder, torch.float32, CPU)
    loaded = policy.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    saved = trained.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert loaded.__class__.__name__ == "Params4bit" and torch.equal(loaded.data.flatten(), saved.data.flatten())
    assert loaded.quant_state.blocksize == saved.quant_state.blocksize == 64
    with torch.no_grad(), policy.disable_adapter(), trained.disable_adapter():
        torch.testing.assert_close(policy.eval()(IDS).logits, trained.eval()(IDS).logits)
    # a plan for a 16-bit model of this size would take merged: there are no 16-bit weights to start it from
    assert engines.engine_weights(cfg, policy, None, folder, planned="merged") == "adapter"
    from grpo.memory import planner

    plan, run = planner.plan_parts(cfg, folder, gpu=planner.named_card(80))[:2]
    assert run.capable == ("adapter",) and plan.rollout_weights == "adapter"
    for options, message in ((dict(rollout_weights="merged"), "saved in 4 bits: use --rollout_weights adapter"),):
        with pytest.raises(ConfigError, match=message):
            engines.engine_weights(GRPOConfig(**{**cfg.__dict__, **options}), policy, None, folder)
    # what vLLM's LoRA cannot take, with no 16-bit weights for a merged engine either: a way out that exists
    monkeypatch.setattr(policy.config, "kv_lora_rank", 512, raising=False)
    with pytest.raises(ConfigError, match="in 4 bits.*cannot take MLA.*16-bit checkpoint, or use --rollout_engine hf"):
        engines.engine_weights(cfg, policy, None, folder, planned=plan.rollout_weights)
    for options, message in ((dict(tuning_strategy="lora"), "train it with --tuning_strategy qlora"),
                             (dict(save_merged_model=True), "drop --save_merged_model"),
                             (dict(qlora_init="loftq"), "run without --qlora_init loftq")):
        with pytest.raises(ConfigError, match=message):
            check_checkpoint_weights(GRPOConfig(**{"model_name_or_path": folder, "tuning_strategy": "qlora",
                                                   **options}), folder)


def test_server_mode_takes_the_adapter_from_a_4bit_base_written_beside_the_run(model_dir, tmp_path, monkeypatch):
    """--rollout_mode server with vLLM: the rollout ranks may hold the base once and take adapters too (auto picks
    it by the same rule as colocated engines); their qlora base is training rank 0's own 4-bit base, written into
    --output_dir where they read it, and gone once they have loaded it. The HF engine takes merged weights only."""
    from grpo.model.base_weights import saved_4bit
    from grpo.model.quantized_checkpoint import write_4bit_checkpoint
    from grpo.rollout import engines

    monkeypatch.setenv("WORLD_SIZE", "2")
    server = dict(model_name_or_path=model_dir, rollout_mode="server", rollout_gpus=1, rollout_engine="vllm",
                  lora_rank=4, lora_alpha=8, lora_dropout=0.0)
    from grpo.memory import planner

    def planned(**options):
        return planner.plan_parts(GRPOConfig(**{**server, **options}), model_dir, gpu=planner.named_card(24))[0]

    assert planned(tuning_strategy="qlora").rollout_weights == "adapter"  # a tiny model: colocated, merged
    assert planned(tuning_strategy="lora").rollout_weights == "adapter"   # (no in_place on another GPU)
    assert planned(tuning_strategy="lora", rollout_weights="merged").rollout_weights == "merged"
    assert planned(tuning_strategy="qlora", qlora_init="loftq").rollout_weights == "merged"
    assert planned(tuning_strategy="full").rollout_weights == "merged"
    assert planner.plan_parts(GRPOConfig(**server, tuning_strategy="lora"), model_dir,
                              on_gpu=False)[0].rollout_weights == "adapter"  # planned on a CPU: the same
    assert planned(tuning_strategy="lora", rollout_engine="hf").rollout_weights is None  # HF: merged, no choice
    with pytest.raises(ConfigError, match="rollout_weights.*needs --rollout_engine vllm"):
        GRPOConfig(tuning_strategy="lora", rollout_weights="adapter", **{**server, "rollout_engine": "hf"})
    cfg = GRPOConfig(tuning_strategy="qlora", **server)
    policy = trained_policy(model_dir, "qlora")
    out = tmp_path / "run"
    with engines._engine_base(cfg, policy, model_dir, str(out)) as folder:
        assert os.path.dirname(folder) == str(out) and saved_4bit(folder)
        kept = folder
    assert not os.path.exists(kept) and os.listdir(out) == []
    # a vision-language engine reads its processor files from the folder at the first image prompt: kept to the end
    with engines._engine_base(cfg, policy, model_dir, str(out), keep=True) as folder:
        kept = folder
    assert saved_4bit(kept)
    engines.remove_kept_bases()  # (registered to run when the process exits)
    assert not os.path.exists(kept) and os.listdir(out) == []
    with engines._engine_base(cfg, policy, None, str(out)) as nothing:  # ranks other than 0 write nothing
        assert nothing is None
    saved = str(tmp_path / "saved-4bit")
    write_4bit_checkpoint(policy, saved, dtype=torch.float32)
    with engines._engine_base(cfg, policy, saved, str(out)) as folder:  # a checkpoint saved in 4 bits, as it is
        assert folder == saved
    assert saved_4bit(saved) and os.listdir(out) == []
