"""A dense Llama-family model upcycled into a Mixtral-style mixture of experts that speaks from the start: every
expert a copy of the layer's MLP, a small random router, the top-k of its softmax renormalised (Mixtral's routing):

    y = sum_{e in top-k(x)} w_e(x) MLP_e(x),   w_e = p_e / sum_{top-k} p,   MLP_e = MLP   =>   y = MLP(x)

so the upcycled model computes the dense model's outputs exactly (up to rounding) until training moves the experts
apart. Saved as Mixtral checkpoints are published (block_sparse_moe.experts.<e>.w1 / w2 / w3, block_sparse_moe.gate),
which transformers fuses on load and vLLM reads as they are: a small mixture of experts for tests and learning runs.

    python scripts/upcycle_moe.py --out /tmp/smollm2-moe --experts 4 --top_k 2      # the embedded SmolLM2-135M
"""
from __future__ import annotations

import os
import shutil

import torch

from grpo.errors import ConfigError

ROUTER_STD = 0.02  # the router starts small and random: its choice does not change the outputs, only which copy runs
UPCYCLED_FROM = ("llama",)  # RMSNorm, rotary attention without biases, a SwiGLU MLP: Mixtral's blocks


def mixtral_config(dense_config, experts: int, top_k: int):
    """The MixtralConfig of the dense model's shape, with `experts` experts of its MLP's width, top-`top_k` routing."""
    from transformers import MixtralConfig

    if dense_config.model_type not in UPCYCLED_FROM:
        raise ConfigError(f"upcycling takes a {' or '.join(UPCYCLED_FROM)} model (Mixtral's blocks); this one is "
                          f"{dense_config.model_type!r}")
    if getattr(dense_config, "mlp_bias", False) or getattr(dense_config, "attention_bias", False):
        raise ConfigError("upcycling takes a model without attention or MLP biases (Mixtral has none)")
    if not 1 <= top_k <= experts:
        raise ConfigError(f"--top_k {top_k}: give 1 to --experts ({experts})")
    d = dense_config
    return MixtralConfig(
        vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_hidden_layers, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=getattr(d, "head_dim", None) or d.hidden_size //
        d.num_attention_heads, hidden_act=d.hidden_act, max_position_embeddings=d.max_position_embeddings,
        rms_norm_eps=d.rms_norm_eps, rope_parameters=getattr(d, "rope_parameters", None),
        tie_word_embeddings=d.tie_word_embeddings, bos_token_id=d.bos_token_id, eos_token_id=d.eos_token_id,
        pad_token_id=getattr(d, "pad_token_id", None), num_local_experts=experts, num_experts_per_tok=top_k,
        router_jitter_noise=0.0, sliding_window=None, output_router_logits=False)


def upcycled_tensors(dense_state: dict, config, seed: int = 0):
    """(name, tensor) of the Mixtral checkpoint: the dense model's tensors, each layer's MLP copied into every expert
    (gate_proj -> w1, down_proj -> w2, up_proj -> w3) and a random router per layer."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in dense_state.items():
        if ".mlp." not in name:
            yield name, tensor
            continue
        prefix, part = name.split(".mlp.")
        if part != "gate_proj.weight":  # each layer's three projections are written together, at its gate_proj
            continue
        moe = prefix + ".block_sparse_moe"
        gate, up, down = (dense_state[f"{prefix}.mlp.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
        router = torch.randn(config.num_local_experts, config.hidden_size, generator=generator) * ROUTER_STD
        yield f"{moe}.gate.weight", router.to(gate.dtype)
        for expert in range(config.num_local_experts):
            yield f"{moe}.experts.{expert}.w1.weight", gate.clone()
            yield f"{moe}.experts.{expert}.w2.weight", down.clone()
            yield f"{moe}.experts.{expert}.w3.weight", up.clone()


def upcycle(dense_path: str, out: str, experts: int = 4, top_k: int = 2, seed: int = 0) -> str:
    """Write the upcycled Mixtral model of the dense model in `dense_path` (a folder) to `out`, with its tokenizer
    and generation config; returns `out`."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dense_config = AutoConfig.from_pretrained(dense_path)
    config = mixtral_config(dense_config, experts, top_k)
    dense = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32)
    state = {name: tensor.detach().contiguous() for name, tensor in dense.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tmp = out.rstrip("/") + ".tmp"  # renamed when complete
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    dtype = getattr(dense_config, "dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in upcycled_tensors(state, config, seed)}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    config.dtype = dtype
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(dense_path).save_pretrained(tmp)
    try:
        GenerationConfig.from_pretrained(dense_path).save_pretrained(tmp)
    except OSError:
        pass
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
