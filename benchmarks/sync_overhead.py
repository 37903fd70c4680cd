"""The Python side of a lora sync written in place (grpo.sync.weight_sync.sync_weights with an engine's views), on the
CPU: Qwen2.5-7B's layout (28 layers, 7 wrapped linears each, q/k/v and gate/up fused by the engine) at a tiny width,
so the tensor work is negligible and what is timed is the walk over the model (the engine's views found at the
first sync and kept, as the vLLM engine does). Mean of 5 syncs after 2.

    python benchmarks/sync_overhead.py
"""
import os
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.rollout.engine import RolloutEngine  # noqa: E402
from grpo.sync.engine_layout import writable_blocks  # noqa: E402
from grpo.sync.weight_sync import checkpoint_shapes, sync_weights  # noqa: E402

LAYERS = 28
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def engine_model(config) -> "FlatModel":
    """The checkpoint's tensors as vLLM holds them: q/k/v and gate/up fused by rows, in bf16."""
    state = Qwen2ForCausalLM(config).state_dict()
    tensors = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for fused, parts in FUSED.items():
            block = "self_attn." if fused == "qkv_proj" else "mlp."
            leaves = ("weight", "bias") if fused == "qkv_proj" else ("weight",)
            for leaf in leaves:
                tensors[f"{p}{block}{fused}.{leaf}"] = torch.cat([state[f"{p}{block}{part}.{leaf}"] for part in parts])
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight"):
            tensors[p + name] = state[p + name]
    return FlatModel({name: t.to(torch.bfloat16) for name, t in tensors.items()})


class FlatModel:
    """What writable_blocks reads of an engine's model: its named parameters."""

    def __init__(self, tensors: dict):
        self.tensors = {name: torch.nn.Parameter(t, requires_grad=False) for name, t in tensors.items()}

    def named_parameters(self):
        return iter(self.tensors.items())


class InProcessEngine(RolloutEngine):
    """Views found at the first sync and kept, as grpo.rollout.vllm.VLLMRolloutEngine keeps them."""

    def __init__(self, model):
        self.model = model
        self.views = None

    def generate(self, prompt_token_ids, sampling, images=None):
        raise NotImplementedError

    def load_weights(self, named_tensors, complete=True):
        list(named_tensors)

    def weight_views(self, policy):
        if self.views is None:
            self.views = writable_blocks(self.model, FUSED, checkpoint_shapes(policy))
        return self.views


def main() -> None:
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2)
    policy = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                 lora_dropout=0.0))
    engine = InProcessEngine(engine_model(config))
    for _ in range(2):
        sync_weights(engine, policy, "lora")
    start = time.perf_counter()
    for _ in range(5):
        stats = sync_weights(engine, policy, "lora")
    sync_ms = (time.perf_counter() - start) / 5 * 1000
    start = time.perf_counter()
    shapes = checkpoint_shapes(policy)
    shapes_ms = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    views = writable_blocks(engine.model, FUSED, shapes)
    views_ms = (time.perf_counter() - start) * 1000
    print(f"sync of {stats.tensors} tensors: {sync_ms:.1f} ms; found once per run: the policy's shapes "
          f"{shapes_ms:.1f} ms, the engine's {len(views)} views {views_ms:.1f} ms")


if __name__ == "__main__":
    main()
