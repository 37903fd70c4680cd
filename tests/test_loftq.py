"""--qlora_init loftq: the adapter starts as the best rank-r approximation of the 4-bit rounding error."""
import pytest
import torch

from grpo.config import GRPOConfig
from grpo.errors import ConfigError
from grpo.loftq import low_rank_factors
from grpo.models import load_policy, load_tokenizer, save_final_model
from grpo.sync import iter_policy_weights

from .tiny_models import make_tiny_model_dir

CPU = torch.device("cpu")
IDS = torch.tensor([[5, 7, 8, 28, 9, 29]])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


def config(model_dir, **kw):
    return GRPOConfig(**{"model_name_or_path": model_dir, "tuning_strategy": "qlora", "lora_rank": 4,
                         "lora_alpha": 8, "lora_dropout": 0.0, **kw})


def logits_of(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_low_rank_factors_by_hand():
    # R = diag(3, 1): its best rank-1 approximation is diag(3, 0); A = sqrt(3) e1^T, B = sqrt(3) e1 / s with s = 2
    a, b = low_rank_factors(torch.tensor([[3.0, 0.0], [0.0, 1.0]]), rank=1, scale=2.0)
    assert a.shape == (1, 2) and b.shape == (2, 1)
    torch.testing.assert_close(2.0 * b @ a, torch.tensor([[3.0, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(a.abs(), torch.tensor([[3 ** 0.5, 0.0]]))
    torch.testing.assert_close(b.abs(), torch.tensor([[3 ** 0.5 / 2], [0.0]]))


def test_loftq_adapter_cancels_the_best_rank_r_part_of_the_rounding_error(model_dir):
    from safetensors.torch import load_file

    checkpoint = load_file(f"{model_dir}/model.safetensors")
    zero = dict(iter_policy_weights(load_policy(config(model_dir), model_dir, torch.float32, CPU), "qlora",
                                    dtype=torch.float32))
    policy = load_policy(config(model_dir, qlora_init="loftq"), model_dir, torch.float32, CPU)
    loftq = dict(iter_policy_weights(policy, "qlora", dtype=torch.float32))
    assert set(loftq) == set(zero) and any(name.endswith("q_proj.weight") for name in loftq)
    for name, rounded in zero.items():
        residual = checkpoint[name].float() - rounded                     # W - dequantize(Q), B = 0 start
        singular = torch.linalg.svdvals(residual)
        left = (checkpoint[name].float() - loftq[name]).norm()
        # what is left is exactly the part of the residual beyond rank 4 (Eckart-Young)
        torch.testing.assert_close(left, singular[4:].square().sum().sqrt(), atol=1e-5, rtol=1e-4)
        assert left < residual.norm()
    # the policy computes that way: its logits are nearer the 16-bit model's than the plain 4-bit start's
    from transformers import AutoModelForCausalLM

    full = logits_of(AutoModelForCausalLM.from_pretrained(model_dir))
    plain = logits_of(load_policy(config(model_dir), model_dir, torch.float32, CPU))
    assert (logits_of(policy) - full).norm() < (plain - full).norm()
    # trainable as usual: only the adapter, and it gets gradients
    policy.train()
    policy(input_ids=IDS, labels=IDS).loss.backward()
    trainable = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and p.grad is not None for n, p in trainable)


def test_loftq_merged_model_is_the_policy_as_trained(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = config(model_dir, qlora_init="loftq", save_merged_model=True)
    policy = load_policy(cfg, model_dir, torch.float32, CPU)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.add_(torch.randn_like(p) * 0.1)  # as after some training
    expected = logits_of(policy)
    saved = save_final_model(policy, load_tokenizer(model_dir), str(tmp_path), cfg, model_dir, torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(saved["merged_model"])
    torch.testing.assert_close(logits_of(merged), expected, atol=1e-4, rtol=1e-4)


def test_loftq_config_errors(model_dir):
    for bad, fragment in [(dict(tuning_strategy="lora"), "loftq needs --tuning_strategy qlora"),
                          (dict(lora_adapter_path="some/adapter"), "keeps its own weights"),
                          (dict(qlora_init="pissa"), "choose one of zero, loftq")]:
        with pytest.raises(ConfigError, match=fragment):
            config(model_dir, **{"qlora_init": "loftq", **bad})


def test_loftq_kl_reference_is_the_starting_policy_and_stays_out_of_training_and_saving(model_dir, tmp_path):
    import os

    from grpo.models import reference_mode

    cfg = config(model_dir, qlora_init="loftq", use_kl_penalty=True)
    policy = load_policy(cfg, model_dir, torch.float32, CPU)
    start = logits_of(policy)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
    for name, p in policy.named_parameters():
        if "lora_B.default" in name:
            p.data.add_(torch.randn_like(p) * 0.1)  # as after some training
    assert not torch.allclose(logits_of(policy), start, atol=1e-3)
    with reference_mode(policy):
        torch.testing.assert_close(logits_of(policy), start)  # the policy training started from, not the 4-bit base
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    assert not torch.allclose(logits_of(policy), start, atol=1e-3)  # the trained adapter is back
    # weight sync and the saved adapter carry the trained adapter only
    synced = dict(iter_policy_weights(policy, "qlora", dtype=torch.float32))
    assert not any("reference" in name for name in synced)
    saved = save_final_model(policy, load_tokenizer(model_dir), str(tmp_path), cfg, model_dir, torch.float32)
    assert not os.path.exists(os.path.join(saved["lora_adapter"], "reference"))
