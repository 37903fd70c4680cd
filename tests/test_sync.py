"""Weight sync on CPU: the streamed tensors are the trained policy, under its checkpoint names."""
import copy

import pytest
import torch

from grpo.config import GRPOConfig
from grpo.models import load_policy
from grpo.sync import checkpoint_name, iter_policy_weights, sync_weights

from .tiny_models import make_tiny_model_dir

CPU = torch.device("cpu")
IDS = torch.tensor([[5, 7, 8, 28, 9, 29, 12]])


class RecordingEngine:
    """Stands in for vLLM's load_weights: records every call."""

    def __init__(self):
        self.calls = []

    def load_weights(self, named):
        self.calls.append(list(named))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


def trained_policy(model_dir, strategy):
    cfg = GRPOConfig(model_name_or_path=model_dir, tuning_strategy=strategy, lora_rank=4, lora_alpha=8,
                     lora_dropout=0.0)
    policy = load_policy(cfg, model_dir, torch.float32, CPU)
    torch.manual_seed(0)
    for name, p in policy.named_parameters():
        if p.requires_grad:  # as if trained: lora_B non-zero, full weights moved
            p.data += 0.05 * torch.randn_like(p)
    return policy


def load_into_fresh_base(model_dir, named):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    missing = set(dict(named)) - set(base.state_dict())
    assert not missing, f"names unknown to the checkpoint: {missing}"
    base.load_state_dict({k: v.float() for k, v in named}, strict=False)
    return base


def test_checkpoint_names():
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj") == "model.layers.0.self_attn.q_proj"
    assert checkpoint_name("model.layers.1.mlp.down_proj.base_layer") == "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize("strategy", ["full", "lora"])
def test_synced_weights_reproduce_the_policy(strategy, model_dir):
    policy = trained_policy(model_dir, strategy)
    named = list(iter_policy_weights(policy, strategy, dtype=torch.float32))
    if strategy == "lora":
        # only the targeted linears, merged exactly like peft's merge_and_unload
        assert all(n.endswith("_proj.weight") for n, _ in named) and len(named) == 2 * 7
        merged = copy.deepcopy(policy).merge_and_unload().state_dict()
        for name, tensor in named:
            torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=1e-6)
    else:
        assert {n for n, _ in named} == set(dict(policy.named_parameters()))
    fresh = load_into_fresh_base(model_dir, named)
    with torch.no_grad():
        torch.testing.assert_close(fresh(IDS).logits, policy(IDS).logits, atol=1e-5, rtol=1e-5)


def test_qlora_sync_is_the_dequantized_policy(model_dir):
    import bitsandbytes.functional as bnbf

    policy = trained_policy(model_dir, "qlora")
    pairs = list(iter_policy_weights(policy, "qlora", dtype=torch.float32, first_sync=True))
    named = dict(pairs)
    assert len(pairs) == len(named)  # every weight once
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    w = layer.base_layer.weight
    expected = bnbf.dequantize_4bit(w.data, w.quant_state).float() + \
        (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
    torch.testing.assert_close(named["model.layers.0.self_attn.q_proj.weight"], expected)
    fresh = load_into_fresh_base(model_dir, list(named.items()))
    with torch.no_grad():
        torch.testing.assert_close(fresh(IDS).logits, policy(IDS).logits, atol=1e-4, rtol=1e-4)


def test_sync_weights_streams_in_chunks(model_dir):
    policy = trained_policy(model_dir, "full")
    engine = RecordingEngine()
    stats = sync_weights(engine, policy, "full", dtype=torch.float32, chunk_bytes=64 * 1024)
    total = sum(p.numel() * 4 for p in policy.parameters())
    assert stats.bytes == total and stats.tensors == len(list(policy.parameters()))
    assert len(engine.calls) > 1
    assert all(sum(t.numel() * 4 for _, t in call[:-1]) < 64 * 1024 for call in engine.calls)


def test_zero3_gathers_the_same_tensors(model_dir):
    import deepspeed

    from grpo import distributed as dist_utils

    dist_utils.init_distributed()
    policy = trained_policy(model_dir, "full")
    expected = {n: p.detach().clone() for n, p in policy.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
              "stage3_param_persistence_threshold": 0}, "bf16": {"enabled": False}}
    engine, *_ = deepspeed.initialize(model=policy, optimizer=torch.optim.AdamW(policy.parameters(), lr=1e-3),
                                      config=config)
    assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned away
    named = dict(iter_policy_weights(engine.module, "full", dtype=torch.float32, zero3=True))
    assert named.keys() == expected.keys()
    for name, tensor in named.items():
        torch.testing.assert_close(tensor, expected[name])
