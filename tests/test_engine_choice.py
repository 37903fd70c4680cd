"""Which weights the vLLM engine takes (--rollout_weights: merged, adapter, in_place) and at which level it
sleeps, from the strategy, the model, its checkpoint and the GPU; on CPU, with the GPU's size stood in for."""
import os
import shutil

import pytest
import torch

from grpo.config.options import GRPOConfig
from grpo.errors import ConfigError
from grpo.model.loading import load_policy

from .sync_setup import CPU, IDS, STOCK_4BIT, trained_policy


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model


def test_a_merged_lora_engine_keeps_its_weights_through_training_where_they_are_small_next_to_the_gpu(
        model_dir, monkeypatch):
    """--vllm_sleep_level by default: 0 (the KV cache alone, so a sync writes only the adapted layers) for lora /
    qlora with merged weights on one GPU while their 16-bit copy takes at most KEEP_WEIGHTS_UP_TO_SHARE of it; 2
    beyond, for full fine-tuning, under tensor parallelism and for an adapter engine (which keeps its base anyway);
    an explicit level always wins."""
    from grpo.model.loading import parameter_count
    from grpo.rollout import engines

    policy = trained_policy(model_dir, "qlora")
    copy_bytes = 2 * parameter_count(policy)
    roomy = int(copy_bytes / engines.KEEP_WEIGHTS_UP_TO_SHARE) + 1
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: roomy)

    def level(adapter=False, **options):
        cfg = GRPOConfig(**{"model_name_or_path": model_dir, "tuning_strategy": "qlora", "rollout_engine": "vllm",
                            **options})
        return engines.engine_sleep_level(cfg, policy, adapter)

    assert level() == 0 and level(tuning_strategy="lora") == 0
    assert level(tuning_strategy="full") == 2 and level(adapter=True) == 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert level(vllm_tp=2) == 2
    monkeypatch.delenv("WORLD_SIZE")
    assert level(vllm_sleep_level=2) == 2 and level(adapter=True, vllm_sleep_level=0) == 0
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: roomy - 2)
    assert level() == 2
    with pytest.raises(ConfigError, match="vllm_sleep_level"):
        GRPOConfig(model_name_or_path=model_dir, vllm_sleep_level=3)


def test_rollout_weights_auto_picks_adapter_only_where_the_16bit_copy_crowds_the_gpu(model_dir, monkeypatch):
    """qlora with vLLM: merged while a 16-bit copy of the model takes at most ADAPTER_FROM_SHARE of the GPU (it
    generates faster), adapter beyond; an explicit adapter where vLLM's LoRA cannot take the model is an error."""
    from grpo.model.loading import parameter_count
    from grpo.rollout import engines

    cfg = GRPOConfig(model_name_or_path=model_dir, tuning_strategy="qlora", rollout_engine="vllm", lora_rank=4,
                     lora_alpha=8, lora_dropout=0.0)
    assert cfg.engine_weights == "adapter"  # a candidate, before the model and the GPU are known
    policy = trained_policy(model_dir, "qlora")
    copy_bytes = 2 * parameter_count(policy)
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: int(copy_bytes / engines.ADAPTER_FROM_SHARE) + 1)
    assert engines.engine_weights(cfg, policy, vision=None) == "merged"
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: int(copy_bytes / engines.ADAPTER_FROM_SHARE) - 1)
    assert engines.engine_weights(cfg, policy, vision=None) == "adapter"
    assert engines.engine_weights(cfg, policy, vision=object()) == "merged"  # a vision-language model
    explicit = GRPOConfig(model_name_or_path=model_dir, tuning_strategy="qlora", rollout_engine="vllm",
                          rollout_weights="adapter")
    with pytest.raises(ConfigError, match="vision-language"):
        engines.engine_weights(explicit, policy, vision=object())
    # a 16-bit part of a layer vLLM fuses (its skip list names the fused layer): the engine could not load the base
    skips_v = GRPOConfig(**{**cfg.__dict__, "qlora_skip_modules": "model.layers.0.self_attn.v_proj,down_proj"})
    assert engines.engine_weights(skips_v, policy, vision=None) == "merged"
    with pytest.raises(ConfigError, match=r"cannot take --qlora_skip_modules v_proj \(vLLM quantizes qkv_proj as "
                                          r"one layer.*use --rollout_weights merged"):
        engines.engine_weights(GRPOConfig(**{**skips_v.__dict__, "rollout_weights": "adapter"}), policy, None)
    skips_down = GRPOConfig(**{**cfg.__dict__, "qlora_skip_modules": "down_proj"})  # not fused: still adapter
    assert engines.engine_weights(skips_down, policy, vision=None) == "adapter"
    # MLA attention (DeepSeek-V2/V3): vLLM's LoRA scored it 0.4-0.8 nats off the policy (tests/gpu/test_vllm_sync.py)
    monkeypatch.setattr(policy.config, "kv_lora_rank", 512, raising=False)
    assert engines.engine_weights(cfg, policy, vision=None) == "merged"
    with pytest.raises(ConfigError, match="adapter: vLLM's LoRA cannot take MLA.*use --rollout_weights merged"):
        engines.engine_weights(explicit, policy, None)


def lora_with_vllm(model_dir, **options) -> GRPOConfig:
    return GRPOConfig(model_name_or_path=model_dir, tuning_strategy="lora", rollout_engine="vllm", lora_rank=4,
                      lora_alpha=8, lora_dropout=0.0, **options)


def test_rollout_weights_auto_merges_lora_in_place_from_8_gib_or_a_quarter_of_the_gpu(model_dir, monkeypatch):
    """lora with vLLM: merged while its 16-bit copy takes at most KEEP_WEIGHTS_UP_TO_SHARE of the GPU and less than
    IN_PLACE_FROM_BYTES, in_place beyond either; an explicit in_place at any size."""
    import grpo.model.loading
    from grpo.model.loading import parameter_count
    from grpo.rollout import engines

    lora = lora_with_vllm(model_dir)
    assert lora.engine_weights == "in_place"  # lora: a candidate, the base shared and the adapter merged into it
    lora_policy = trained_policy(model_dir, "lora")
    monkeypatch.setattr(engines, "has_triton", lambda: True)  # (a CUDA build of torch brings it)
    lora_copy = 2 * parameter_count(lora_policy)
    keep_share = engines.KEEP_WEIGHTS_UP_TO_SHARE
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: int(lora_copy / keep_share) + 1)
    assert engines.engine_weights(lora, lora_policy, vision=None) == "merged"  # a quarter of the GPU: merged is faster
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: int(lora_copy / keep_share) - 1)
    assert engines.engine_weights(lora, lora_policy, vision=None) == "in_place"  # beyond it: one base
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: 10**15)
    assert engines.engine_weights(lora, lora_policy, vision=None) == "merged"  # a small model on a large GPU
    explicit_in_place = lora_with_vllm(model_dir, rollout_weights="in_place")
    assert engines.engine_weights(explicit_in_place, lora_policy, vision=None) == "in_place"  # as asked, at any size
    with monkeypatch.context() as bar:  # a model as large as the bar: one base, on any GPU
        bar.setattr(engines, "IN_PLACE_FROM_BYTES", lora_copy)
        assert engines.engine_weights(lora, lora_policy, vision=None) == "in_place"
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: 80 * 2**30)
    for parameters, expected in ((7.62e9, "in_place"), (4.0e9, "merged"), (0.68e9, "merged")):  # Qwen2.5-7B, ...
        monkeypatch.setattr(grpo.model.loading, "parameter_count", lambda model, n=int(parameters): n)
        assert engines.engine_weights(lora, lora_policy, vision=None) == expected, parameters
    # MLA attention (DeepSeek-V2/V3): vLLM decodes through W_UK_T / W_UV, views of kv_b_proj's bf16 weight, so the
    # merge reaches them (tests/gpu/test_vllm_sync.py)
    monkeypatch.setattr(grpo.model.loading, "parameter_count", lambda model: int(7.62e9))
    monkeypatch.setattr(lora_policy.config, "kv_lora_rank", 512, raising=False)
    assert engines.engine_weights(lora, lora_policy, vision=None) == "in_place"
    assert engines.engine_weights(explicit_in_place, lora_policy, vision=None) == "in_place"
    monkeypatch.setattr(engines, "has_triton", lambda: False)  # in_place cannot: auto falls back as for qlora, ...
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: 30 * 2**30)  # (15 GB of 30: adapter by size)
    assert engines.engine_weights(lora, lora_policy, vision=None) == "merged"  # ... and vLLM's LoRA cannot take MLA


def test_in_place_refuses_what_its_merge_cannot_take(model_dir, monkeypatch):
    """What in_place cannot take: auto falls back as qlora's rule does, an explicit in_place is an error that
    names the reason."""
    from grpo.model.loading import parameter_count
    from grpo.rollout import engines
    from grpo.sync import merge_record

    lora = lora_with_vllm(model_dir)
    explicit_in_place = lora_with_vllm(model_dir, rollout_weights="in_place")
    lora_policy = trained_policy(model_dir, "lora")
    monkeypatch.setattr(engines, "has_triton", lambda: True)
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: 10**15)
    assert engines.engine_weights(lora, lora_policy, vision=object()) == "merged"  # a vision-language model
    with pytest.raises(ConfigError, match="in_place merges one plain LoRA adapter.*vision-language"):
        engines.engine_weights(explicit_in_place, lora_policy, vision=object())
    with pytest.raises(ConfigError, match="in_place.*--tuning_strategy lora"):
        GRPOConfig(model_name_or_path=model_dir, tuning_strategy="qlora", rollout_engine="vllm",
                   rollout_weights="in_place")
    monkeypatch.setattr(merge_record, "KERNEL_MAX_RANK", 2)  # the policy's rank 4 is above it
    with pytest.raises(ConfigError, match="in_place.*cannot take a LoRA rank above 2"):
        engines.engine_weights(explicit_in_place, lora_policy, vision=None)
    monkeypatch.setattr(merge_record, "KERNEL_MAX_RANK", 64)
    monkeypatch.setattr(engines, "has_triton", lambda: False)
    with pytest.raises(ConfigError, match="in_place.*cannot take a merge without Triton"):
        engines.engine_weights(explicit_in_place, lora_policy, vision=None)
    monkeypatch.setattr(engines, "has_triton", lambda: True)
    next(lora_policy.parameters()).ds_id = 0  # a ZeRO-3 partition: auto takes what qlora's rule picks
    lora_copy = 2 * parameter_count(lora_policy)
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: int(lora_copy / engines.ADAPTER_FROM_SHARE) - 1)
    assert engines.engine_weights(lora, lora_policy, vision=None) == "adapter"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert GRPOConfig(**{**lora.__dict__, "vllm_tp": 2}).engine_weights == "merged"
    with pytest.raises(ConfigError, match="rollout_weights.*--vllm_tp 1"):
        GRPOConfig(model_name_or_path=model_dir, tuning_strategy="qlora", rollout_engine="vllm", vllm_tp=2,
                   rollout_weights="adapter")


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_a_mixture_of_experts_model_takes_merged_weights(tmp_path, monkeypatch, strategy):
    """transformers fuses a mixture-of-experts checkpoint's experts on load; vLLM holds them per the checkpoint, so
    they cannot be shared and in_place / adapter would hold the base twice: auto takes merged at any size, and an
    explicit choice is an error that says why."""
    from grpo.rollout import engines

    from .tiny_models import make_tiny_moe_model_dir

    folder = make_tiny_moe_model_dir(str(tmp_path / "moe"))
    options = dict(lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="k_proj,o_proj,q_proj,v_proj")
    policy = trained_policy(folder, strategy, targets=options["lora_target_modules"])
    monkeypatch.setattr(engines, "has_triton", lambda: True)
    monkeypatch.setattr(engines, "IN_PLACE_FROM_BYTES", 0)  # as large as in_place's and adapter's bars
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: 1)
    auto = GRPOConfig(model_name_or_path=folder, tuning_strategy=strategy, rollout_engine="vllm", **options)
    assert engines.engine_weights(auto, policy, vision=None) == "merged"
    for explicit in (["adapter", "in_place"] if strategy == "lora" else ["adapter"]):
        config = GRPOConfig(**{**auto.__dict__, "rollout_weights": explicit})
        with pytest.raises(ConfigError, match=rf"--rollout_weights {explicit}.*cannot take tensors that transformers "
                                              r"fused or moved on load \(6, e\.g\. model\.layers\.0\.mlp\.experts\.down_proj\)"):
            engines.engine_weights(config, policy, vision=None)


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
    # auto would pick merged for a 16-bit model
    monkeypatch.setattr(engines, "gpu_memory_bytes", lambda cap=None: 10**15)
    assert engines.engine_weights(cfg, policy, None, folder) == "adapter"
    for options, message in ((dict(rollout_weights="merged"), "saved in 4 bits: use --rollout_weights adapter"),):
        with pytest.raises(ConfigError, match=message):
            engines.engine_weights(GRPOConfig(**{**cfg.__dict__, **options}), policy, None, folder)
    # what vLLM's LoRA cannot take, with no 16-bit weights for a merged engine either: a way out that exists
    monkeypatch.setattr(policy.config, "kv_lora_rank", 512, raising=False)
    with pytest.raises(ConfigError, match="in 4 bits.*cannot take MLA.*16-bit checkpoint, or use --rollout_engine hf"):
        engines.engine_weights(cfg, policy, None, folder)
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
    assert GRPOConfig(tuning_strategy="qlora", **server).engine_weights == "adapter"
    assert GRPOConfig(tuning_strategy="lora", rollout_weights="merged", **server).engine_weights == "merged"
    assert GRPOConfig(tuning_strategy="qlora", qlora_init="loftq", **server).engine_weights == "merged"
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
