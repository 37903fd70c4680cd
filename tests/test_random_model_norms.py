"""benchmarks/random_model.py's 4-bit writer gives each norm the model's own neutral weight: ones for x w (Llama),
zeros for Gemma's x (1 + w). Ones made a random Gemma 2 double every normalized vector (near one-hot attention, bf16
rounding amplified into a 3.8-nat engine-vs-trainer gap, benchmarks/gemma2_gap.py)."""
import importlib.util
import os

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_model():
    spec = importlib.util.spec_from_file_location("random_model", os.path.join(ROOT, "benchmarks", "random_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NoTokenizer:
    def save_pretrained(self, folder):
        pass


def written_norms(config, tmp_path) -> dict:
    out = tmp_path / config.model_type
    random_model().write_random_4bit(config.model_type, str(out), NoTokenizer(), {}, config=config)
    tensors = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(out / name)))
    return {name: t for name, t in tensors.items() if name.endswith("norm.weight")}


def test_gemma2_norms_are_written_as_zeros_and_llama_norms_as_ones(tmp_path):
    from transformers import Gemma2Config, LlamaConfig

    gemma = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=128, query_pre_attn_scalar=32)
    norms = written_norms(gemma, tmp_path)
    assert len(norms) == 2 * 4 + 1  # four a block (two of them after attention and MLP) and the final one
    assert all(t.dtype == torch.bfloat16 and not t.any() for t in norms.values()), norms
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=128)
    norms = written_norms(llama, tmp_path)
    assert len(norms) == 2 * 2 + 1 and all(bool((t == 1).all()) for t in norms.values()), norms


def test_neutral_norm_weight_leaves_gemma2_norm_an_identity_scale():
    """x (1 + w) with the weight written is the plain RMS normalization, as for Llama's x w."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=32, vocab_size=128, query_pre_attn_scalar=32)
    with torch.device("meta"):
        skeleton = Gemma2ForCausalLM(config)
    norm = Gemma2ForCausalLM(config).model.norm
    with torch.no_grad():
        norm.weight.copy_(random_model().neutral_norm_weight(skeleton, "model.norm.weight").float())
    x = torch.randn(3, 64)
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))
