"""--qlora_init loftq: a frozen adapter adds back the best rank-r approximation of the 4-bit rounding error."""
import os

import pytest
import torch

from grpo.config.options import GRPOConfig
from grpo.errors import ConfigError
from grpo.model.loftq import CORRECTION_ADAPTER, low_rank_factors
from grpo.checkpoint.final_model import save_final_model
from grpo.model.loading import keep_4bit_forward_exact, load_policy, load_tokenizer, reference_mode
from grpo.sync.weight_sync import iter_policy_weights

from .tiny_models import make_tiny_model_dir

CPU = torch.device("cpu")
IDS = torch.tensor([[5, 7, 8, 28, 9, 29]])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


STOCK_4BIT = {"qlora_block_size": 64, "qlora_block_scale": "absmax"}  # bitsandbytes' own base, as transformers loads it


def config(model_dir, **kw):
    return GRPOConfig(**{"model_name_or_path": model_dir, "tuning_strategy": "qlora", "lora_rank": 4,
                         "lora_alpha": 8, "lora_dropout": 0.0, **kw})


def logits_of(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def on_fresh_nf4_base(model_dir, adapter):
    """The saved adapter with plain peft on the base quantized as training quantizes it (nf4, double quant)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    quantized = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=nf4, device_map={"": "cpu"})
    keep_4bit_forward_exact(quantized)
    return PeftModel.from_pretrained(quantized, adapter)


def trained_a_little(policy):
    for name, p in policy.named_parameters():
        if "lora_B.default" in name:
            p.data.add_(torch.randn_like(p) * 0.1)
    return policy


def test_low_rank_factors_by_hand():
    # R = diag(3, 1): its best rank-1 approximation is diag(3, 0); A = sqrt(3) e1^T, B = sqrt(3) e1 / s with s = 2
    a, b = low_rank_factors(torch.tensor([[3.0, 0.0], [0.0, 1.0]]), rank=1, scale=2.0)
    assert a.shape == (1, 2) and b.shape == (2, 1)
    torch.testing.assert_close(2.0 * b @ a, torch.tensor([[3.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(a.abs(), torch.tensor([[3 ** 0.5, 0.0]]))
    torch.testing.assert_close(b.abs(), torch.tensor([[3 ** 0.5 / 2], [0.0]]))


def test_the_correction_cancels_the_best_rank_r_part_of_the_rounding_error(model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    checkpoint = load_file(f"{model_dir}/model.safetensors")
    zero = dict(iter_policy_weights(load_policy(config(model_dir), model_dir, torch.float32, CPU), "qlora",
                                    dtype=torch.float32))
    policy = load_policy(config(model_dir, qlora_init="loftq"), model_dir, torch.float32, CPU)
    loftq = dict(iter_policy_weights(policy, "qlora", dtype=torch.float32))
    assert set(loftq) == set(zero) and any(name.endswith("q_proj.weight") for name in loftq)
    for name, rounded in zero.items():
        residual = checkpoint[name].float() - rounded                     # W - dequantize(Q)
        singular = torch.linalg.svdvals(residual)
        left = (checkpoint[name].float() - loftq[name]).norm()
        # what is left is exactly the part of the residual beyond rank 4 (Eckart-Young)
        torch.testing.assert_close(left, singular[4:].square().sum().sqrt(), atol=1e-5, rtol=1e-4)
        assert left < residual.norm()
    # the policy computes that way: its logits are nearer the 16-bit model's than the plain 4-bit start's
    full = logits_of(AutoModelForCausalLM.from_pretrained(model_dir))
    plain = logits_of(load_policy(config(model_dir), model_dir, torch.float32, CPU))
    assert (logits_of(policy) - full).norm() < (plain - full).norm()
    # only the usual adapter trains, from B = 0 as in plain qlora; the correction is frozen and gets no gradient
    assert all(p.abs().sum() == 0 for n, p in policy.named_parameters() if "lora_B.default" in n)
    policy.train()
    policy(input_ids=IDS, labels=IDS).loss.backward()
    for name, p in policy.named_parameters():
        assert p.requires_grad == (".default." in name), name
        assert (p.grad is not None) == (".default." in name), name


def test_kl_reference_is_the_corrected_start(model_dir):
    policy = load_policy(config(model_dir, qlora_init="loftq", kl_beta=0.04), model_dir, torch.float32, CPU)
    start = logits_of(policy)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    trained_a_little(policy)
    assert not torch.allclose(logits_of(policy), start, atol=1e-3)
    with reference_mode(policy):
        torch.testing.assert_close(logits_of(policy), start)  # the corrected start, not the plain 4-bit base
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    assert not torch.allclose(logits_of(policy), start, atol=1e-3)  # trained adapter and correction back on


@pytest.mark.parametrize("rounding", [STOCK_4BIT, {}])  # {}: the default base, blocks of 32 with searched scales
def test_saved_adapter_is_one_plain_lora_that_reproduces_the_policy(model_dir, tmp_path, rounding):
    import json

    from transformers import AutoModelForCausalLM

    cfg = config(model_dir, qlora_init="loftq", save_merged_model=True, **rounding)
    policy = trained_a_little(load_policy(cfg, model_dir, torch.float32, CPU))
    expected = logits_of(policy)
    saved = save_final_model(policy, load_tokenizer(model_dir), str(tmp_path), cfg, model_dir, torch.float32)
    adapter_cfg = json.load(open(os.path.join(saved["lora_adapter"], "adapter_config.json")))
    assert (adapter_cfg["r"], adapter_cfg["lora_alpha"]) == (8, 16)  # rank 2r, same scale alpha / r
    assert not os.path.exists(os.path.join(saved["lora_adapter"], CORRECTION_ADAPTER))
    if rounding == STOCK_4BIT:  # on a base any transformers quantizes, with plain peft
        torch.testing.assert_close(logits_of(on_fresh_nf4_base(model_dir, saved["lora_adapter"])), expected,
                                   atol=1e-4, rtol=1e-4)
    # merged into the 16-bit base rounded as in training (whatever the block size and scale): the policy as trained
    merged = AutoModelForCausalLM.from_pretrained(saved["merged_model"])
    torch.testing.assert_close(logits_of(merged), expected, atol=1e-4, rtol=1e-4)


def test_zero_init_qlora_saves_the_policy_as_adapter_and_merges_into_the_unrounded_base(model_dir, tmp_path):
    """What --save_merged_model's help says: without loftq the merged model is the adapter on the original-precision
    base (not the trained 4-bit policy), while lora_adapter/ on a base quantized as in training is that policy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = config(model_dir, save_merged_model=True, **STOCK_4BIT)  # so that plain transformers rebuilds its base
    policy = trained_a_little(load_policy(cfg, model_dir, torch.float32, CPU))
    expected = logits_of(policy)
    saved = save_final_model(policy, load_tokenizer(model_dir), str(tmp_path), cfg, model_dir, torch.float32)
    torch.testing.assert_close(logits_of(on_fresh_nf4_base(model_dir, saved["lora_adapter"])), expected,
                               atol=1e-4, rtol=1e-4)
    merged = logits_of(AutoModelForCausalLM.from_pretrained(saved["merged_model"]))
    unrounded = logits_of(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir),
                                                    saved["lora_adapter"]).merge_and_unload())
    torch.testing.assert_close(merged, unrounded, atol=1e-4, rtol=1e-4)
    assert (merged - expected).abs().max() > 1e-3  # the rounding of the base apart


def test_loftq_config_errors(model_dir):
    for bad, fragment in [(dict(tuning_strategy="lora"), "loftq needs --tuning_strategy qlora"),
                          (dict(lora_adapter_path="some/adapter"), "keeps its own weights"),
                          (dict(qlora_init="pissa"), "choose one of zero, loftq")]:
        with pytest.raises(ConfigError, match=fragment):
            config(model_dir, **{"qlora_init": "loftq", **bad})
