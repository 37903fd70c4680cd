"""Weight sync on CPU: the streamed tensors are the trained policy, under the base checkpoint's names."""
import copy
import importlib.util
import json
import os

import pytest
import torch

from grpo.errors import ConfigError
from grpo.model.layer_weights import checkpoint_name, dense_weight
from grpo.model.loading import keep_4bit_forward_exact
from grpo.rollout.engine import RolloutEngine
from grpo.sync.weight_sync import iter_policy_weights, sync_weights

from .sync_setup import IDS, STOCK_4BIT, as_if_trained, module_holding, trained_policy
from .tiny_models import make_tiny_model_dir


class RecordingEngine(RolloutEngine):
    """Stands in for the rollout engine's load_weights: records every call."""

    def __init__(self):
        self.calls, self.complete = [], []

    def generate(self, prompt_token_ids, sampling, images=None):
        raise AssertionError("only syncs are recorded")

    def load_weights(self, named, complete=True):
        self.calls.append(list(named))
        self.complete.append(complete)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


def assert_reproduces(policy, base_factory, named, atol=1e-5):
    """Loading the yielded tensors into a fresh base model gives the policy's logits."""
    base = base_factory().eval()  # no dropout (GPT-2's config has some)
    policy.eval()
    unknown = set(dict(named)) - set(base.state_dict())
    assert not unknown, f"names unknown to the checkpoint: {unknown}"
    with torch.no_grad():
        expected, untouched = policy(IDS).logits, base(IDS).logits
        assert (expected - untouched).abs().max() > 100 * atol  # training moved the policy away from the base
        base.load_state_dict({k: v.float() for k, v in named}, strict=False)
        torch.testing.assert_close(base(IDS).logits, expected, atol=atol, rtol=atol)


def assert_equals_peft_merge(policy, named):
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    for name, tensor in named:
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=1e-6)


def test_checkpoint_names():
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj") == "model.layers.0.self_attn.q_proj"
    assert checkpoint_name("model.layers.1.mlp.down_proj.base_layer") == "model.layers.1.mlp.down_proj"


def test_full_yields_every_parameter(model_dir):
    from transformers import AutoModelForCausalLM

    policy = trained_policy(model_dir, "full")
    named = list(iter_policy_weights(policy, "full", dtype=torch.float32))
    assert [n for n, _ in named] == [n for n, _ in policy.named_parameters()]
    for (_, tensor), param in zip(named, policy.parameters()):
        assert torch.equal(tensor, param)
    assert_reproduces(policy, lambda: AutoModelForCausalLM.from_pretrained(model_dir), named)
    # bf16 by default: what vLLM runs
    assert {t.dtype for _, t in iter_policy_weights(policy, "full")} == {torch.bfloat16}


def test_lora_yields_only_the_merged_targets(model_dir):
    from transformers import AutoModelForCausalLM

    policy = trained_policy(model_dir, "lora")
    before = {n: p.clone() for n, p in policy.named_parameters()}
    named = list(iter_policy_weights(policy, "lora", dtype=torch.float32))
    # 2 layers x 7 targeted linears (q k v o gate up down), nothing else
    assert len(named) == 2 * 7 and all(n.endswith("_proj.weight") for n, _ in named)
    assert_equals_peft_merge(policy, named)
    assert_reproduces(policy, lambda: AutoModelForCausalLM.from_pretrained(model_dir), named)
    # the training model was not merged in place
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())


def qwen2_base(seed: int, tie_word_embeddings: bool):
    """A factory of one tiny random Qwen2 (biases on q/k/v), the same weights each call."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    base_state = Qwen2ForCausalLM(config).state_dict()

    def fresh_base():
        model = Qwen2ForCausalLM(config)
        model.load_state_dict(base_state)
        return model
    return fresh_base


def test_lora_bias_modules_to_save_and_per_module_alpha():
    from peft import LoraConfig, get_peft_model

    fresh_base = qwen2_base(seed=1, tie_word_embeddings=False)
    # q/v have biases in Qwen2; v_proj gets its own alpha, so the two scalings differ (8/4 = 2 and 32/4 = 8)
    lora = LoraConfig(r=4, lora_alpha=8, alpha_pattern={"v_proj": 32}, target_modules=["q_proj", "v_proj"],
                      lora_bias=True, modules_to_save=["lm_head"], lora_dropout=0.0)
    policy = as_if_trained(get_peft_model(fresh_base(), lora))
    v_proj = policy.base_model.model.model.layers[0].self_attn.v_proj
    assert v_proj.scaling["default"] == 8.0
    named = list(iter_policy_weights(policy, "lora", dtype=torch.float32))
    names = {n for n, _ in named}
    assert names == {f"model.layers.{i}.self_attn.{m}.{t}" for i in range(2) for m in ("q_proj", "v_proj")
                     for t in ("weight", "bias")} | {"lm_head.weight"}
    assert_equals_peft_merge(policy, named)
    assert_reproduces(policy, fresh_base, named)


def test_fan_in_fan_out_layers_are_merged_transposed():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(2)
    base_state = GPT2LMHeadModel(config).state_dict()

    def fresh_base():
        model = GPT2LMHeadModel(config)
        model.load_state_dict(base_state)
        return model

    # GPT-2's Conv1D stores weights [in, out]: the delta B @ A [out, in] must be transposed
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    policy = as_if_trained(get_peft_model(fresh_base(), lora))
    named = list(iter_policy_weights(policy, "lora", dtype=torch.float32))
    assert [n for n, _ in named] == [f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)]
    assert named[0][1].shape == (32, 96)  # [in, out], as in the checkpoint
    assert_equals_peft_merge(policy, named)
    assert_reproduces(policy, fresh_base, named)


def test_qlora_sync_is_the_dequantized_policy(model_dir):
    import bitsandbytes.functional as bnbf
    from transformers import AutoModelForCausalLM

    policy = trained_policy(model_dir, "qlora", targets="q_proj,v_proj")
    first = list(iter_policy_weights(policy, "qlora", dtype=torch.float32, first_sync=True))
    named = dict(first)
    # first sync: every 4-bit linear (2 layers x 7), adapted or not, each once
    assert len(first) == len(named) == 2 * 7 and all(n.endswith("_proj.weight") for n in named)
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    w = layer.base_layer.weight
    # dequantized nf4 base + (alpha / r) * B @ A, alpha / r = 8 / 4 = 2
    assert layer.scaling["default"] == 2.0
    expected = bnbf.dequantize_4bit(w.data, w.quant_state).float() + \
        (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * 2.0
    torch.testing.assert_close(named["model.layers.0.self_attn.q_proj.weight"], expected)
    assert_reproduces(policy, lambda: AutoModelForCausalLM.from_pretrained(model_dir), first, atol=1e-4)
    # later syncs send only the adapted weights; the frozen 4-bit ones were sent the first time
    later = dict(iter_policy_weights(policy, "qlora", dtype=torch.float32, first_sync=False))
    assert sorted(later) == [f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "v_proj")]
    for name, tensor in later.items():
        torch.testing.assert_close(tensor, named[name])


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_excluded_modules_stay_base_layers_in_the_sync(model_dir, strategy):
    import bitsandbytes.functional as bnbf
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    policy = trained_policy(model_dir, strategy, exclude="mlp.down_proj")
    layers = policy.base_model.model.model.layers
    assert not any(isinstance(layer.mlp.down_proj, LoraLayer) for layer in layers)
    down = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)]
    adapted = [f"model.layers.{i}.{m}.weight" for i in range(2) for m in
               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj")]
    first = list(iter_policy_weights(policy, strategy, dtype=torch.float32, first_sync=True))
    named = dict(first)
    if strategy == "lora":  # excluded layers are the checkpoint's own weights: nothing to send
        assert sorted(named) == sorted(adapted)
    else:  # the engine loads the unquantized checkpoint: an excluded 4-bit layer must still be dequantized once
        assert sorted(named) == sorted(adapted + down)
        for i, name in enumerate(down):
            w = layers[i].mlp.down_proj.weight
            torch.testing.assert_close(named[name], bnbf.dequantize_4bit(w.data, w.quant_state).float())
        later = dict(iter_policy_weights(policy, strategy, dtype=torch.float32, first_sync=False))
        assert sorted(later) == sorted(adapted)
    assert_reproduces(policy, lambda: AutoModelForCausalLM.from_pretrained(model_dir), first,
                      atol=1e-5 if strategy == "lora" else 1e-4)


def test_lora_on_a_mixture_of_experts_adapts_the_experts_and_refuses_the_router(tmp_path):
    """A mixture-of-experts model: "all-linear" adapts attention and the fused experts (peft's target_parameters, at
    the rank asked for), with the default dropout too (taken as 0: a fused parameter's LoRA has none); the router
    has no sync to vLLM's names, so naming it, or continuing an adapter that holds it, is refused before training.
    (tests/test_expert_lora.py checks what the experts' adapters compute and how they are sent.)"""
    from grpo import GRPOConfig
    from grpo.model.loading import load_policy
    from .tiny_models import make_tiny_moe_model_dir

    folder = make_tiny_moe_model_dir(str(tmp_path / "moe"))
    policy = load_policy(GRPOConfig(model_name_or_path=folder, tuning_strategy="lora", lora_rank=4), folder,
                         torch.float32, torch.device("cpu"))
    lora = policy.peft_config["default"]
    assert lora.lora_dropout == 0.0 and sorted(lora.target_parameters) == ["experts.down_proj", "experts.gate_up_proj"]
    assert sorted(lora.target_modules) == ["k_proj", "o_proj", "q_proj", "v_proj"] and not lora.rank_pattern
    with pytest.raises(ConfigError, match="router"):
        trained_policy(folder, "lora", targets="q_proj,gate")
    # an adapter that peft built with the router adapted (its own mapping of "all-linear") is refused when continued
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with_router = get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                                 LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"))
    with_router.save_pretrained(str(tmp_path / "adapter"))
    with pytest.raises(ConfigError, match=r"--lora_adapter_path .*adapter: on this mixture-of-experts model .*not the "
                                          r"router.*train a new adapter with --lora_target_modules "
                                          r"k_proj,o_proj,q_proj,v_proj,experts$"):
        trained_policy(folder, "lora", lora_adapter_path=str(tmp_path / "adapter"))


def tiny_qwen3_moe_dir(path: str) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("strategy", ["full", "lora", "qlora"])
def test_fused_experts_are_sent_as_the_checkpoint_holds_them(tmp_path, arch, strategy):
    """transformers fuses a mixture-of-experts checkpoint's per-expert linears as it loads them (and moves Mixtral's
    block_sparse_moe to mlp); the engine loaded the checkpoint, so the sync sends the checkpoint's own tensors, and
    those reproduce the trained policy."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from grpo.rollout.hf import HFRolloutEngine
    from .tiny_models import make_tiny_moe_model_dir, make_tiny_tokenizer

    folder = make_tiny_moe_model_dir(str(tmp_path / arch)) if arch == "mixtral" else tiny_qwen3_moe_dir(
        str(tmp_path / arch))
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as saved:
        checkpoint = {name: saved.get_slice(name).get_shape() for name in saved.keys()}
    policy = trained_policy(folder, strategy, targets="k_proj,o_proj,q_proj,v_proj")
    if strategy == "full":
        with torch.no_grad():  # (as_if_trained moves the linears; the experts and router must move too)
            for name, param in policy.named_parameters():
                if ".mlp." in name:
                    param.add_(0.05 * torch.randn_like(param))
    named = list(iter_policy_weights(policy, strategy, dtype=torch.float32, everything=True))
    assert {name: list(t.shape) for name, t in named} == checkpoint  # every tensor once, named as saved
    experts = [name for name in checkpoint if ".experts." in name]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(folder), make_tiny_tokenizer(), owns_model=True)
    scrambled(engine.model)
    engine.load_weights(named)  # the engine's model is fused again: each expert lands in its block of rows
    policy.eval()
    with torch.no_grad():
        atol = 1e-4 if strategy == "qlora" else 1e-5
        torch.testing.assert_close(engine.model.eval()(IDS).logits, policy(IDS).logits, atol=atol, rtol=atol)
    # later syncs send the adapted linears alone, under the same names as before
    if strategy != "full":
        later = dict(iter_policy_weights(policy, strategy, dtype=torch.float32, first_sync=False))
        assert sorted({name.split(".")[-2] for name in later}) == ["k_proj", "o_proj", "q_proj", "v_proj"]



def test_a_checkpoint_saved_in_4_bits_syncs_under_its_names_without_a_warning(tmp_path, grpo_log):
    """Loading a checkpoint saved in 4 bits, transformers' bitsandbytes quantizer records a conversion: each weight's
    quantization state (weight.absmax, weight.quant_map, ...) gathered into the live 4-bit weight, under the weight's
    own name. It has no reverse (reverting the model's conversions raised NotImplementedError: a Gemma-2-9B run warned
    that the engine would get transformers' names), and needs none: the sync sends each weight dequantized under the
    name a 16-bit checkpoint gives it, so no warning. A conversion that changes the layout and cannot be reverted
    still warns."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import ConversionOps, WeightConverter

    from grpo.model.quantized_checkpoint import write_4bit_checkpoint
    from grpo.sync.checkpoint_layout import converted_names
    from .tiny_models import make_tiny_gemma2_model_dir

    folder = make_tiny_gemma2_model_dir(str(tmp_path / "gemma2"))
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as saved:
        checkpoint = {name: saved.get_slice(name).get_shape() for name in saved.keys()}
    write_4bit_checkpoint(trained_policy(folder, "qlora"), str(tmp_path / "gemma2-4bit"), dtype=torch.float32)
    grpo_log.clear()
    policy = trained_policy(str(tmp_path / "gemma2-4bit"), "qlora")
    assert policy.get_base_model()._weight_conversions  # the quantizer's, kept by transformers
    named = list(iter_policy_weights(policy, "qlora", dtype=torch.float32, everything=True))
    assert grpo_log and not any("could not map" in line for line in grpo_log), grpo_log  # (the load's lines came)
    assert {name: list(tensor.shape) for name, tensor in named} == checkpoint  # (the tied head once, as saved)

    class Fuse(ConversionOps):  # an operation without a reverse
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            return input_dict

    model = AutoModelForCausalLM.from_pretrained(folder)
    model._weight_conversions = [WeightConverter(["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                                                 "mlp.gate_up_proj.weight", operations=[Fuse()])]
    grpo_log.clear()
    assert converted_names(model, lambda: {n: p.shape for n, p in model.named_parameters()}) == frozenset()
    assert any("could not map this model's weights back to its checkpoint's names (NotImplementedError" in line
               for line in grpo_log), grpo_log

def scrambled(model):
    """`model` with every parameter overwritten by noise: what an engine holds after dropping its weights."""
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


class DroppingEngine(RecordingEngine):
    """An engine whose sleep drops its weights (vLLM's level 2): every sync must send the whole policy."""
    needs_every_weight = True


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_an_engine_that_drops_its_weights_gets_the_whole_policy(model_dir, strategy):
    from transformers import AutoModelForCausalLM

    policy = trained_policy(model_dir, strategy, targets="q_proj,v_proj")  # five linears per layer without adapter
    engine = DroppingEngine()
    stats = sync_weights(engine, policy, strategy, dtype=torch.float32, chunk_bytes=16 * 1024)  # a later sync
    # in chunks, and only the last one says the load is whole (an interrupted sync leaves the engine unwakeable)
    assert len(engine.calls) > 1 and engine.complete == [False] * (len(engine.calls) - 1) + [True]
    named = [item for call in engine.calls for item in call]
    checkpoint = AutoModelForCausalLM.from_pretrained(model_dir)
    # every tensor of the checkpoint once: embeddings, norms, head, adapted and frozen (for qlora dequantized) linears
    assert sorted(n for n, _ in named) == sorted(n for n, _ in checkpoint.named_parameters())
    assert stats.tensors == len(named)
    adapted = [(n, t) for n, t in named if n.endswith(("q_proj.weight", "v_proj.weight"))]
    if strategy == "lora":  # (peft merges 4-bit layers back into 4 bits, so for qlora the logits are the check)
        assert_equals_peft_merge(policy, named)
    assert_reproduces(policy, lambda: scrambled(AutoModelForCausalLM.from_pretrained(model_dir)), named,
                      atol=1e-5 if strategy == "lora" else 1e-4)
    # an engine that keeps its weights still gets only what changed
    keeping = RecordingEngine()
    sync_weights(keeping, policy, strategy, dtype=torch.float32)
    assert sorted(n for call in keeping.calls for n, _ in call) == sorted(n for n, _ in adapted)


def test_the_whole_policy_sends_tied_weights_once_and_frozen_biases():
    from peft import LoraConfig, get_peft_model

    fresh_base = qwen2_base(seed=4, tie_word_embeddings=True)
    # q/k/v have biases in Qwen2: q_proj's sits under an adapter (no lora_bias), k/v's in frozen layers
    policy = as_if_trained(get_peft_model(fresh_base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                                    lora_dropout=0.0)))
    named = list(iter_policy_weights(policy, "lora", dtype=torch.float32, everything=True))
    names = [n for n, _ in named]
    assert len(names) == len(set(names))
    assert sorted(names) == sorted(n for n, _ in fresh_base().named_parameters())  # lm_head is embed_tokens
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert {f"model.layers.{i}.self_attn.{m}.bias" for i in range(2) for m in ("q_proj", "k_proj", "v_proj")} \
        <= set(names)
    assert_equals_peft_merge(policy, named)
    assert_reproduces(policy, lambda: scrambled(fresh_base()), named)


def test_sync_weights_streams_in_chunks(model_dir):
    policy = trained_policy(model_dir, "full")
    engine = RecordingEngine()
    limit = 64 * 1024
    stats = sync_weights(engine, policy, "full", dtype=torch.float32, chunk_bytes=limit)
    sizes = [p.numel() * 4 for p in policy.parameters()]
    assert stats.bytes == sum(sizes) and stats.tensors == len(sizes) and stats.seconds > 0
    assert len(engine.calls) > 1
    # a chunk exceeds the limit only when it is one tensor larger than the limit
    assert all(len(call) == 1 or sum(t.numel() * 4 for _, t in call) <= limit for call in engine.calls)
    assert [n for call in engine.calls for n, _ in call] == [n for n, _ in policy.named_parameters()]


def test_bad_input_is_a_clear_error(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    policy = trained_policy(model_dir, "full")
    with pytest.raises(ConfigError, match="qlora, lora, full"):
        next(iter_policy_weights(policy, "dora"))
    dora = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                          LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ConfigError, match="DoRA"):
        list(iter_policy_weights(dora, "lora"))
    embedding = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                               LoraConfig(r=4, target_modules=["embed_tokens"]))
    with pytest.raises(ConfigError, match="linear layers only"):
        list(iter_policy_weights(embedding, "lora"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_says_how_to_install():
    from grpo.rollout.vllm import VLLMRolloutEngine

    with pytest.raises(ConfigError, match=r"pip install \.\[vllm\]"):
        VLLMRolloutEngine("some/model", max_model_len=256, seed=0)


@pytest.mark.parametrize("strategy", ["full", "lora"])
def test_zero3_gathers_the_same_tensors(model_dir, strategy):
    import deepspeed

    from grpo.runtime import distributed as dist_utils

    dist_utils.init_distributed()
    policy = trained_policy(model_dir, strategy)
    expected = dict(iter_policy_weights(policy, strategy, dtype=torch.float32))  # unpartitioned reference
    trainable = [p for p in policy.parameters() if p.requires_grad]
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
              "stage3_param_persistence_threshold": 0}, "bf16": {"enabled": False}}
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=trainable,
                                      optimizer=torch.optim.AdamW(trainable, lr=1e-3), config=config)
    assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned away
    named = dict(iter_policy_weights(engine.module, strategy, dtype=torch.float32, zero3=True))
    assert named.keys() == expected.keys()
    for name, tensor in named.items():
        torch.testing.assert_close(tensor, expected[name])
    assert all(p.numel() == 0 for p in engine.module.parameters())  # released again after each module


def test_qlora_forward_is_the_same_in_eval_and_train_mode(model_dir):
    """bitsandbytes' bf16 CPU path (avx512_bf16 CPUs) must not take over in eval mode: sampling and scoring run the
    policy in eval mode, training in train mode, and both must be the one policy the sync sends."""
    policy = trained_policy(model_dir, "qlora", targets="q_proj,v_proj")
    import bitsandbytes as bnb

    layers = [m for m in policy.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2 * 7 and not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in layers)
    with torch.no_grad():
        train_logits = policy.train()(IDS).logits
        eval_logits = policy.eval()(IDS).logits
        again = policy.train()(IDS).logits
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    torch.testing.assert_close(eval_logits, train_logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(again, train_logits, atol=1e-6, rtol=1e-6)


def test_repacked_4bit_weight_is_a_clear_error(model_dir):
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    policy = trained_policy(model_dir, "qlora", targets="q_proj")
    layer = policy.base_model.model.model.layers[0].mlp.up_proj  # 128 x 64: the packed layout needs N % 32 == 0
    layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu(layer.weight.data,
                                                                                 layer.weight.quant_state)
    with pytest.raises(ConfigError, match="repacked"):
        list(iter_policy_weights(policy, "qlora", first_sync=True))


def test_qlora_sync_with_layers_kept_in_full_precision(model_dir):
    from transformers import AutoModelForCausalLM

    policy = trained_policy(model_dir, "qlora", qlora_skip_modules="v_proj,down_proj")
    first = list(iter_policy_weights(policy, "qlora", dtype=torch.float32, first_sync=True))
    assert len(first) == 2 * 7  # the kept layers carry adapters too, so they are merged and sent like the others
    assert_reproduces(policy, lambda: AutoModelForCausalLM.from_pretrained(model_dir), first, atol=1e-4)


class AdapterEngine(RolloutEngine):
    """Stands in for an engine that holds the base and takes the adapter (vLLM's LoRA): records what it gets."""
    takes_adapter = True

    def __init__(self):
        self.adapters = []

    def generate(self, prompt_token_ids, sampling, images=None):
        raise AssertionError("only syncs are recorded")

    def load_adapter(self, tensors):
        self.adapters.append(tensors)


def apply_adapter(weights: dict, adapter: dict) -> dict:
    """What an engine holding the base computes: W + B' @ A per adapted layer (B' carries the scale)."""
    out = dict(weights)
    for name, lora_a in adapter.items():
        if name.endswith(".lora_A.weight"):
            module = name[len("base_model.model."):-len(".lora_A.weight")]
            lora_b = adapter[name.replace(".lora_A.", ".lora_B.")]
            out[f"{module}.weight"] = weights[f"{module}.weight"] + lora_b.float() @ lora_a.float()
    return out


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_adapter_sync_equals_the_merged_sync(model_dir, strategy):
    """The adapter an engine takes, applied to the base it holds, is the merged policy the merged sync sends; a sync
    sends the adapter alone (2 tensors per adapted layer), with the layer's alpha / r folded into lora_B."""
    policy = trained_policy(model_dir, strategy, targets="q_proj,v_proj")
    engine = AdapterEngine()
    stats = sync_weights(engine, policy, strategy, dtype=torch.float32)
    adapter = engine.adapters[0]
    assert stats.tensors == len(adapter) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert stats.bytes == sum(t.numel() * t.element_size() for t in adapter.values())
    layer = policy.base_model.model.model.layers[1].self_attn.v_proj
    name = "base_model.model.model.layers.1.self_attn.v_proj"
    torch.testing.assert_close(adapter[f"{name}.lora_A.weight"], layer.lora_A["default"].weight)
    torch.testing.assert_close(adapter[f"{name}.lora_B.weight"], 2.0 * layer.lora_B["default"].weight)  # 8 / 4
    merged = dict(iter_policy_weights(policy, strategy, dtype=torch.float32, first_sync=True, everything=True))
    base = dict(merged)  # the engine's base: the adapted layers without their adapter (dequantized for qlora)
    for module_name, module in policy.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            base[checkpoint_name(module_name) + ".weight"] = dense_weight(module.get_base_layer())
    rebuilt = apply_adapter(base, adapter)
    for key, tensor in merged.items():
        torch.testing.assert_close(rebuilt[key], tensor, atol=1e-5, rtol=1e-5)
    assert any((rebuilt[k] - base[k]).abs().max() > 1e-3 for k in adapter_modules(adapter))


def adapter_modules(adapter):
    return {n[len("base_model.model."):-len(".lora_A.weight")] + ".weight" for n in adapter if ".lora_A." in n}


def test_the_4bit_base_written_for_the_engine_loads_as_the_trainers_base(model_dir, tmp_path):
    """The folder an adapter-taking engine loads holds the trainer's own 4-bit base (blocks of 32, not the stock 64):
    transformers loads it as a pre-quantized bitsandbytes model that computes the same logits as the policy with
    its adapter disabled, and whose 4-bit codes are the trainer's."""
    from transformers import AutoModelForCausalLM

    from grpo.model.quantized_checkpoint import write_4bit_checkpoint

    policy = trained_policy(model_dir, "qlora")
    written = write_4bit_checkpoint(policy, str(tmp_path / "base4"), dtype=torch.float32)
    config = json.load(open(tmp_path / "base4" / "config.json"))["quantization_config"]
    assert config["quant_method"] == "bitsandbytes" and config["load_in_4bit"] and "lm_head" in \
        config["llm_int8_skip_modules"]
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base4"), dtype=torch.float32, device_map="cpu")
    keep_4bit_forward_exact(loaded)
    q_proj = loaded.model.layers[0].self_attn.q_proj
    trained = policy.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert q_proj.weight.quant_state.blocksize == trained.quant_state.blocksize == 32
    assert torch.equal(q_proj.weight.data.flatten(), trained.data.flatten())
    policy.eval()
    with torch.no_grad(), policy.disable_adapter():
        torch.testing.assert_close(loaded(IDS).logits, policy(IDS).logits, atol=1e-5, rtol=1e-5)
    assert 0 < written < sum(p.numel() * 4 for p in loaded.parameters()) * 2


def vllm_layout(model_dir: str, vocab_rows: int) -> torch.nn.Module:
    """The checkpoint's weights as vLLM 0.26 holds a Llama with LoRA enabled: q/k/v and gate/up fused by rows
    (packed_modules_mapping), each wrapped layer's weight under `base_layer`, the vocabulary padded to `vocab_rows`.
    A 4-bit checkpoint's packed weights ([bytes, 1] uint8) fuse the same way; their quantization states, which vLLM
    keeps beside its parameters, are left out."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    weights = {name: tensor for f in files for name, tensor in load_file(os.path.join(model_dir, f)).items()
               if name.endswith((".weight", ".bias"))}
    engine = {}
    for name, tensor in weights.items():
        for fused, parts in VLLM_PACKED.items():
            if f".{parts[0]}." in name:
                engine[name.replace(parts[0], fused).replace(".weight", ".base_layer.weight")] = torch.cat(
                    [weights[name.replace(parts[0], p)] for p in parts])
        if any(f".{p}." in name for parts in VLLM_PACKED.values() for p in parts):
            continue
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensor = torch.cat([tensor, torch.zeros(vocab_rows - tensor.shape[0], tensor.shape[1])])
        engine[name.replace("proj.weight", "proj.base_layer.weight")] = tensor.clone()
    return module_holding(engine, wrap=lambda tensor: (PackedWeight if tensor.dtype == torch.uint8
                                                       else torch.nn.Parameter)(tensor, requires_grad=False))


class PackedWeight(torch.nn.Parameter):
    """Packed 4-bit bytes as vLLM 0.26's BitsAndBytesWeightParameter holds them: its `.dtype` reports the model's
    dtype, not uint8."""

    @property
    def dtype(self):
        return torch.get_default_dtype()


VLLM_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_qlora_shares_its_4bit_base_with_an_engine_that_loaded_it(model_dir, tmp_path):
    """qlora with an engine that takes the adapter: the engine loads the trainer's own 4-bit base, so each packed
    4-bit weight of the trainer is a block of bytes of the engine's fused one (q, k, v in turn), equal byte for byte,
    and becomes a view of it, like the unquantized embeddings, norms and output layer; the policy computes exactly
    as before. Only the quantization states (absmax, a few percent of the bytes) stay the trainer's own."""
    import bitsandbytes as bnb

    from grpo.model.quantized_checkpoint import write_4bit_checkpoint
    from grpo.sync.shared_base import share_base_weights

    policy = trained_policy(model_dir, "qlora", **STOCK_4BIT).eval()
    with torch.no_grad():
        before = policy(IDS).logits
    folder = str(tmp_path / "engine-4bit")
    write_4bit_checkpoint(policy, folder, dtype=torch.float32)
    engine = vllm_layout(folder, vocab_rows=64 * -(-policy.config.vocab_size // 64) + 64)
    fused = engine.get_parameter("model.layers.1.self_attn.qkv_proj.base_layer.weight")
    assert fused.data.dtype == torch.uint8 and fused.dtype == torch.float32 and fused.shape[1] == 1
    frozen = [(n, p) for n, p in policy.named_parameters() if not p.requires_grad]
    result = share_base_weights(policy, engine, VLLM_PACKED)
    assert (result.shared, result.kept) == (len(frozen), 0)
    k_proj = policy.base_model.model.model.layers[1].self_attn.k_proj.base_layer
    q_bytes = policy.base_model.model.model.layers[1].self_attn.q_proj.base_layer.weight.shape[0]
    assert isinstance(k_proj, bnb.nn.Linear4bit) and k_proj.weight.__class__.__name__ == "Params4bit"
    assert k_proj.weight.data_ptr() == fused.data_ptr() + q_bytes  # k's bytes follow q's in the fused weight
    with torch.no_grad():
        torch.testing.assert_close(policy(IDS).logits, before, atol=0, rtol=0)


def test_lora_shares_one_base_with_the_engine(model_dir):
    """lora with an engine that takes the adapter: every frozen base tensor of the trainer becomes a view of the
    engine's equal block (fused layers by their rows, padded vocabularies by their first rows), so the base is held
    once and the policy computes exactly as before; a block that differs keeps the trainer's own copy."""
    from grpo.sync.engine_layout import engine_blocks
    from grpo.sync.shared_base import share_base_weights

    policy = trained_policy(model_dir, "lora").eval()
    with torch.no_grad():
        before = policy(IDS).logits
    engine = vllm_layout(model_dir, vocab_rows=64 * -(-policy.config.vocab_size // 64) + 64)
    frozen = [(n, p) for n, p in policy.named_parameters() if not p.requires_grad]
    q = policy.base_model.model.model.layers[1].self_attn.k_proj.base_layer.weight
    blocks = engine_blocks(engine, VLLM_PACKED, {checkpoint_name(n): p.shape for n, p in frozen})
    fused, first = blocks["model.layers.1.self_attn.k_proj.weight"]
    # k's rows come after q's 64 rows
    assert fused is engine.get_parameter("model.layers.1.self_attn.qkv_proj.base_layer.weight") and first == 64
    with torch.no_grad():
        # not the checkpoint's any more
        engine.get_parameter("model.layers.0.mlp.down_proj.base_layer.weight")[0, 0] += 1.0
    result = share_base_weights(policy, engine, VLLM_PACKED)
    assert (result.shared, result.kept) == (len(frozen) - 1, 1)
    assert result.shared_bytes == sum(p.numel() * 4 for _, p in frozen) - 128 * 64 * 4
    storage = fused.untyped_storage().data_ptr()
    assert q.untyped_storage().data_ptr() == storage and q.data_ptr() == storage + 64 * 64 * 4
    assert policy.base_model.model.lm_head.weight.data_ptr() == engine.lm_head.weight.data_ptr()
    down = policy.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight
    assert down.data_ptr() != engine.get_parameter("model.layers.0.mlp.down_proj.base_layer.weight").data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(policy(IDS).logits, before, atol=0, rtol=0)
    # a GPU policy's base waits in CPU memory while the engine loads (tests/gpu/sync_check.py); on CPU nothing moves
    from grpo.sync.shared_base import park_frozen_base

    assert park_frozen_base(policy) == {}
    # under ZeRO-3 a rank holds an empty partition of each tensor: nothing to share, every copy stays
    partitioned = trained_policy(model_dir, "lora")
    for _, param in partitioned.named_parameters():
        param.data, param.ds_id = torch.empty(0), 0
    assert share_base_weights(partitioned, engine, VLLM_PACKED).shared == 0


class InPlaceEngine(RecordingEngine):
    """An engine in this process (vLLM on one GPU) whose tensors a sync writes in place where they hold exactly one
    checkpoint tensor's rows; the rest (the padded vocabulary) goes through load_weights."""

    def __init__(self, model: torch.nn.Module, drops_weights: bool):
        super().__init__()
        self.model, self.needs_every_weight = model, drops_weights

    def weight_views(self, policy):
        from grpo.sync.engine_layout import writable_blocks
        from grpo.sync.weight_sync import checkpoint_shapes

        return writable_blocks(self.model, VLLM_PACKED, checkpoint_shapes(policy))


def padded_vocab(policy) -> int:
    return 64 * -(-policy.config.vocab_size // 64) + 64


@pytest.mark.parametrize("strategy,targets,dtype", [("full", "all-linear", torch.float32),
                                                    ("lora", "all-linear", torch.float32),
                                                    ("lora", "q_proj,v_proj,down_proj", torch.bfloat16),
                                                    ("qlora", "q_proj,v_proj,down_proj", torch.float32)])
@pytest.mark.parametrize("drops_weights", [False, True])
def test_an_engine_written_in_place_holds_what_the_stream_would_load(model_dir, strategy, targets, dtype,
                                                                     drops_weights):
    """A sync into an engine on one GPU writes each tensor straight into the engine's own rows (q, k, v into the
    fused qkv block, ...): they hold what the streamed sync would load (the merge W + s * B @ A done by one GEMM in
    the engine's dtype), only the padded vocabulary goes through load_weights, and the stats count everything."""
    from grpo.sync.engine_layout import engine_blocks
    from grpo.sync.weight_sync import checkpoint_shapes

    policy = trained_policy(model_dir, strategy, targets=targets)
    layout = vllm_layout(model_dir, vocab_rows=padded_vocab(policy)).to(dtype)
    engine = InPlaceEngine(scrambled(layout) if drops_weights else layout, drops_weights)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    stats = sync_weights(engine, policy, strategy, first_sync=True, dtype=dtype)  # the engine's dtype
    expected = dict(iter_policy_weights(policy, strategy, dtype=torch.float32, first_sync=True,
                                        everything=drops_weights))
    loaded = {name: tensor for call in engine.calls for name, tensor in call}
    vocabulary = {"model.embed_tokens.weight", "lm_head.weight"} & set(expected)
    assert set(loaded) == vocabulary and engine.complete[-1]  # a last call, even with nothing left to load
    assert stats.tensors == len(expected)
    assert stats.bytes == sum(t.numel() * dtype.itemsize for t in expected.values())
    blocks = engine_blocks(engine.model, VLLM_PACKED, checkpoint_shapes(policy))
    # bf16: W rounded to bf16, plus B @ A over bf16 factors, rounded once: within a unit in the last place of the
    # fp32 merge rounded to bf16
    tolerance = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-3, rtol=8e-3)
    for name, tensor in expected.items():
        if name in vocabulary:
            continue
        fused, first = blocks[name]
        torch.testing.assert_close(fused.data[first:first + tensor.shape[0]].float(), tensor, **tolerance)
    written = {id(blocks[name][0]) for name in expected if name not in vocabulary}
    if not drops_weights:  # and the rest, layers without an adapter, as the engine had it
        kept = [(n, p) for n, p in engine.model.named_parameters() if id(p) not in written]
        assert all(torch.equal(p, before[n]) for n, p in kept)
        unsent = {"model.embed_tokens.weight", "lm_head.weight"}  # (the recording engine applies no load_weights)
        if strategy != "full":
            unsent |= {n for n in before if "norm" in n}
        if strategy == "lora" and targets != "all-linear":
            unsent |= {f"model.layers.{i}.{m}.base_layer.weight" for i in range(2)
                       for m in ("self_attn.o_proj", "mlp.gate_up_proj")}
        assert {n for n, _ in kept} == unsent


def test_only_blocks_that_tile_an_engine_tensor_are_written_in_place(model_dir):
    """writable_blocks leaves to the engine's loaders every tensor whose rows it cannot tell apart from others':
    a padded vocabulary, a fused layer split across ranks (tensor parallel: half its rows), packed 4-bit bytes."""
    from grpo.sync.engine_layout import writable_blocks

    policy = trained_policy(model_dir, "lora")
    engine = vllm_layout(model_dir, vocab_rows=padded_vocab(policy))
    shapes = {checkpoint_name(n): p.shape for n, p in policy.named_parameters() if "lora_" not in n}
    views = writable_blocks(engine, VLLM_PACKED, shapes)
    assert "model.embed_tokens.weight" not in views and "lm_head.weight" not in views
    fused = engine.get_parameter("model.layers.1.self_attn.qkv_proj.base_layer.weight")
    k_rows = shapes["model.layers.1.self_attn.k_proj.weight"][0]
    k_view = views["model.layers.1.self_attn.k_proj.weight"]
    assert k_view.data_ptr() == fused.data_ptr() + 64 * fused.shape[1] * 4 and k_view.shape[0] == k_rows
    assert "model.norm.weight" in views and "model.layers.0.mlp.down_proj.weight" in views
    gate_up = engine.get_submodule("model.layers.0.mlp.gate_up_proj.base_layer")
    gate_up.weight = torch.nn.Parameter(gate_up.weight.data[: gate_up.weight.shape[0] // 2].clone())  # a TP shard
    down = engine.get_submodule("model.layers.0.mlp.down_proj.base_layer")
    down.weight = PackedWeight(torch.zeros(down.weight.numel() // 2, 1, dtype=torch.uint8), requires_grad=False)
    views = writable_blocks(engine, VLLM_PACKED, shapes)
    assert not {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.down_proj.weight"} & set(views)
    assert "model.layers.1.mlp.gate_proj.weight" in views
