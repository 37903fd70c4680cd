"""A dense model upcycled into a Mixtral-style mixture of experts (grpo.model.upcycle): every expert a copy of the
layer's MLP, top-k weights renormalised, so its outputs equal the dense model's at the start, whatever the router
picks; saved in the published Mixtral layout, which transformers fuses on load."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from grpo.errors import ConfigError
from grpo.model.upcycle import mixtral_config, upcycle


@pytest.mark.parametrize("experts, top_k", [(4, 2), (8, 2), (4, 1)])
def test_the_upcycled_model_computes_the_dense_models_outputs(tiny_model, tmp_path, experts, top_k):
    out = upcycle(tiny_model, str(tmp_path / "moe"), experts=experts, top_k=top_k, seed=1)
    dense = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    moe = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert (moe.config.num_local_experts, moe.config.num_experts_per_tok) == (experts, top_k)
    ids = torch.randint(0, dense.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = dense(ids).logits, moe(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the router is not trivial: different tokens go to different experts, and it is what training will move
    block = moe.model.layers[0].mlp
    hidden = torch.randn(64, moe.config.hidden_size, generator=torch.Generator().manual_seed(2))
    _, _, chosen = block.gate(hidden)
    assert len(set(chosen[:, 0].tolist())) > 1
    # every expert holds the dense MLP: w1 = gate_proj, w3 = up_proj (fused as gate_up), w2 = down_proj
    mlp = dense.model.layers[0].mlp
    for e in range(experts):
        torch.testing.assert_close(block.experts.gate_up_proj[e], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        torch.testing.assert_close(block.experts.down_proj[e], mlp.down_proj.weight)


def test_it_is_saved_as_published_mixtral_checkpoints_are(tiny_model, tmp_path):
    out = upcycle(tiny_model, str(tmp_path / "moe"), experts=4, top_k=2)
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.block_sparse_moe.gate.weight").shape == (4, 64)
        assert f.get_tensor("model.layers.1.block_sparse_moe.experts.3.w2.weight").shape == (64, 128)
    assert not any(".mlp." in name for name in names)
    assert {f"model.layers.0.block_sparse_moe.experts.{e}.w{i}.weight" for e in range(4) for i in (1, 2, 3)} <= names
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))


def test_what_cannot_be_upcycled_is_said(tiny_model):
    from transformers import AutoConfig, Qwen2Config

    with pytest.raises(ConfigError, match="upcycling takes a llama model"):
        mixtral_config(Qwen2Config(), 4, 2)
    with pytest.raises(ConfigError, match=r"--top_k 5: give 1 to --experts \(4\)"):
        mixtral_config(AutoConfig.from_pretrained(tiny_model), 4, 5)
