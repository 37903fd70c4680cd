"""LoRA on a mixture of experts' fused expert tensors (Mixtral, Qwen3-MoE, the upcycled SmolLM2 form): peft's fused
factors, what they compute per expert (by hand), the merged weights the sync sends, the per-expert adapter vLLM
loads (grpo.sync.expert_adapters), gradients, and a short GRPO run with lora and qlora."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpo.errors import ConfigError
from grpo.sync.expert_adapters import (RowBlock, expert_delta, expert_factors, expert_wrappers, merged_experts,
                                       per_expert_lora, row_blocks_from_numbers)
from grpo.sync.weight_sync import iter_adapter_tensors, iter_policy_weights

from .sync_setup import IDS, module_holding, trained_policy
from .tiny_models import make_tiny_moe_model_dir, make_tiny_tokenizer
from .trainer_setup import even_tokens, tiny_config, train_rows

PREFIX = "base_model.model."


# ------------------------------------------------------------------------------------------------ the models
def tiny_qwen3_moe_dir(path: str) -> str:
    """A tiny random Qwen3-MoE (4 experts of width 32, 2 per token) with the tiny tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = make_tiny_tokenizer()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    Qwen3MoeForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def upcycled_dir(tiny_model: str, path: str) -> str:
    from grpo.model.upcycle import upcycle

    return upcycle(tiny_model, path, experts=4, top_k=2, seed=1)


@pytest.fixture(params=["mixtral", "qwen3_moe", "upcycled"])
def moe(request, tmp_path, tiny_model):
    folder = str(tmp_path / request.param)
    if request.param == "mixtral":
        return make_tiny_moe_model_dir(folder)
    if request.param == "qwen3_moe":
        return tiny_qwen3_moe_dir(folder)
    return upcycled_dir(tiny_model, folder)


# per family: the checkpoint's names of an expert's gate, up and down projections
CHECKPOINT_PARTS = {"mixtral": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                                "block_sparse_moe.experts.{e}.w2"),
                    "qwen3_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")}


def experts_of(policy, layer: int = 0):
    """(the outermost ParamWrapper of a layer's experts, its wrappers by parameter name)."""
    outer = policy.base_model.model.model.layers[layer].mlp.experts
    return outer, {w.parameter_name: w for w in expert_wrappers(outer)}


# ----------------------------------------------------------------------------------------- the layout, by hand
def test_peft_fused_factors_are_read_per_expert_as_worked_by_hand():
    """Two experts, rank 1, in 2, out 3. peft keeps A expert-major ([E*r, in]) and B rank-major ([out, E*r],
    column j*E + e is column j of expert e), so expert e's update is s * B[:, e] A[e]."""
    lora_a = torch.tensor([[1., 2.],     # A_0
                           [3., 4.]])    # A_1
    lora_b = torch.tensor([[1., 10.],    # column 0: B_0, column 1: B_1 (r = 1: j*E + e = e)
                           [2., 20.],
                           [3., 30.]])
    experts_a, experts_b = expert_factors(lora_a, lora_b, num_experts=2)
    assert experts_a.tolist() == [[[1., 2.]], [[3., 4.]]]
    assert experts_b.tolist() == [[[1.], [2.], [3.]], [[10.], [20.], [30.]]]
    delta = expert_delta(experts_a, experts_b, scale=0.5)
    assert delta.tolist() == [[[0.5, 1.], [1., 2.], [1.5, 3.]],             # 0.5 * [1, 2, 3]^T [1, 2]
                              [[15., 20.], [30., 40.], [45., 60.]]]         # 0.5 * [10, 20, 30]^T [3, 4]
    weight = torch.ones(2, 3, 2)
    assert torch.equal(merged_experts(weight, experts_a, experts_b, 0.5), 1 + delta)
    assert torch.equal(merged_experts(weight.transpose(1, 2), experts_a, experts_b, 0.5, transposed=True),
                       (1 + delta).transpose(1, 2))
    # the rank-2 case: B's columns interleave the experts (j*E + e)
    lora_b2 = torch.arange(12.).view(3, 4)  # columns: (j=0,e=0) (j=0,e=1) (j=1,e=0) (j=1,e=1)
    _, experts_b2 = expert_factors(torch.zeros(4, 2), lora_b2, num_experts=2)
    assert torch.equal(experts_b2[1], lora_b2[:, [1, 3]])
    # the per-expert adapter vLLM loads: rows start..stop of expert e's B, scaled, beside A_e
    blocks = [RowBlock("m.experts.0.w1.weight", 0, 0, 2), RowBlock("m.experts.1.w3.weight", 1, 2, 3)]
    lora = per_expert_lora(blocks, experts_a, experts_b, scale=0.5)
    assert lora[PREFIX + "m.experts.0.w1.lora_A.weight"].tolist() == [[1., 2.]]
    assert lora[PREFIX + "m.experts.0.w1.lora_B.weight"].tolist() == [[0.5], [1.]]
    assert lora[PREFIX + "m.experts.1.w3.lora_B.weight"].tolist() == [[15.]]


def test_peft_computes_what_the_hand_layout_says(tmp_path):
    """The reading above is peft's own: its ParamWrapper's delta equals expert_delta of the same factors."""
    policy = trained_policy(make_tiny_moe_model_dir(str(tmp_path / "moe")), "lora")
    _, wrappers = experts_of(policy)
    for name, wrapper in wrappers.items():
        experts_a, experts_b = expert_factors(wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight,
                                              wrapper.num_experts)
        assert experts_a.shape == (4, 4, wrapper.in_features) and experts_b.shape == (4, wrapper.out_features, 4)
        with torch.no_grad():
            torch.testing.assert_close(expert_delta(experts_a, experts_b, wrapper.scaling["default"]),
                                       wrapper.get_delta_weight("default"))


def test_row_blocks_refuse_a_layout_that_is_not_rows_of_one_expert():
    rows = 4  # experts of 4 rows: numbers e * 4 + row, in both of the probe's two columns
    good = {"a.weight": torch.tensor([[4, 4], [5, 5]]), "b.weight": torch.tensor([[0, 0], [1, 1], [2, 2], [3, 3]])}
    assert row_blocks_from_numbers(good, rows) == [RowBlock("b.weight", 0, 0, 4), RowBlock("a.weight", 1, 0, 2)]
    with pytest.raises(ConfigError, match="interleaved"):
        row_blocks_from_numbers({"c.weight": torch.tensor([[0, 0], [2, 2]])}, rows)
    with pytest.raises(ConfigError, match="transposed"):  # a block stored [in, out]
        row_blocks_from_numbers({"d.weight": torch.tensor([[0, 1], [0, 1]])}, rows)
    with pytest.raises(ConfigError, match="transposed"):  # squeezed to 1-D: its layout cannot be told
        row_blocks_from_numbers({"e.weight": torch.tensor([0, 1])}, rows)


# ------------------------------------------------------------------------------------------- on the three models
def test_lora_adapts_the_experts_of_every_family(moe):
    """all-linear adapts attention and both fused expert parameters at rank r; the router stays frozen; at the start
    (B = 0) the policy is the base model."""
    policy = trained_policy(moe, "lora")
    lora = policy.peft_config["default"]
    assert sorted(lora.target_parameters) == ["experts.down_proj", "experts.gate_up_proj"]
    outer, wrappers = experts_of(policy, layer=1)
    assert sorted(wrappers) == ["down_proj", "gate_up_proj"] and all(w.r["default"] == 4 for w in wrappers.values())
    assert not any(p.requires_grad for n, p in policy.named_parameters() if ".gate." in n or n.endswith("gate.weight"))


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_gradients_reach_the_expert_adapters(tmp_path, strategy):
    policy = trained_policy(make_tiny_moe_model_dir(str(tmp_path / "moe")), strategy)
    policy.train()
    policy(IDS, labels=IDS).loss.backward()
    for layer in (0, 1):
        _, wrappers = experts_of(policy, layer)
        for name, wrapper in wrappers.items():
            for factor in (wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight):
                assert factor.grad is not None and factor.grad.abs().sum() > 0, f"layer {layer} {name}"
    if strategy == "qlora":  # bitsandbytes' 4-bit linears, grpo's 4-bit experts (grpo.model.quantized_experts)
        from grpo.model.quantized_experts import Experts4bit

        layer = policy.base_model.model.model.layers[0]
        assert layer.self_attn.q_proj.base_layer.weight.__class__.__name__ == "Params4bit"
        experts = experts_of(policy)[1]["gate_up_proj"].get_param()
        assert isinstance(experts, Experts4bit) and experts.dtype == torch.float32 and not experts.requires_grad


def family(folder: str) -> str:
    return json.load(open(os.path.join(folder, "config.json")))["model_type"]


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_merged_weights_are_the_base_plus_each_experts_update(moe, strategy):
    """The merged sync sends each expert's checkpoint tensors: W_e + s * B_e @ A_e, split as the checkpoint holds
    them (gate rows, then up rows), computed here expert by expert from peft's factors; loaded into an engine of
    the checkpoint's model they give the policy's logits."""
    from grpo.rollout.hf import HFRolloutEngine

    policy = trained_policy(moe, strategy)
    sent = dict(iter_policy_weights(policy, strategy, dtype=torch.float32))
    gate_name, up_name, down_name = CHECKPOINT_PARTS[family(moe)]
    with safe_open(os.path.join(moe, "model.safetensors"), "pt") as saved:
        for layer in (0, 1):
            _, wrappers = experts_of(policy, layer)
            gate_up, down = wrappers["gate_up_proj"], wrappers["down_proj"]
            width = gate_up.out_features // 2
            for e in range(4):
                expected = {}
                for wrapper, parts in ((gate_up, (gate_name, up_name)), (down, (down_name,))):
                    a = wrapper.lora_A["default"].weight.detach()                   # [E*r, in]
                    b = wrapper.lora_B["default"].weight.detach()                   # [out, E*r]
                    a_e = a[e * 4:(e + 1) * 4]                                      # rows of expert e
                    b_e = b[:, [j * 4 + e for j in range(4)]]                       # columns j*E + e
                    update = wrapper.scaling["default"] * b_e @ a_e                 # [out, in]
                    # qlora: W_e is the 4-bit expert dequantized, within rounding of the checkpoint's
                    held = wrapper.get_param()[e].float()
                    for i, part in enumerate(parts):
                        rows = slice(i * width, (i + 1) * width) if len(parts) == 2 else slice(None)
                        name = f"model.layers.{layer}.{part.format(e=e)}.weight"
                        checkpoint = saved.get_tensor(name).float()
                        if strategy == "qlora":
                            assert not torch.equal(held[rows], checkpoint)
                            assert (held[rows] - checkpoint).norm() < 0.15 * checkpoint.norm()
                        else:
                            assert torch.equal(held[rows], checkpoint)
                        expected[name] = held[rows] + update[rows]
                for name, tensor in expected.items():
                    torch.testing.assert_close(sent[name], tensor, atol=1e-6, rtol=1e-6)
    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(moe), make_tiny_tokenizer(), owns_model=True)
    engine.load_weights(list(sent.items()))
    policy.eval()
    with torch.no_grad():
        atol = 1e-4 if strategy == "qlora" else 1e-5
        torch.testing.assert_close(engine.model.eval()(IDS).logits, policy(IDS).logits, atol=atol, rtol=atol)


def test_the_adapter_for_vllm_is_the_fused_adapters_slices_per_expert(moe):
    """iter_adapter_tensors sends, per expert and checkpoint tensor, A_e and s * B_e's rows of it, under the
    checkpoint's names (vLLM's FusedMoEWithLoRA packs experts.<e>.w1 / w2 / w3, or gate_proj / down_proj /
    up_proj); applied to the checkpoint's per-expert weights (what vLLM's fused-MoE LoRA computes) it gives the
    policy."""
    from grpo.rollout.hf import HFRolloutEngine

    policy = trained_policy(moe, "lora")
    tensors = dict(iter_adapter_tensors(policy, dtype=torch.float32))
    gate_name, up_name, down_name = CHECKPOINT_PARTS[family(moe)]
    for layer in (0, 1):
        _, wrappers = experts_of(policy, layer)
        gate_up, down = wrappers["gate_up_proj"], wrappers["down_proj"]
        width = gate_up.out_features // 2
        for e in range(4):
            for wrapper, part, rows in ((gate_up, gate_name, slice(0, width)), (gate_up, up_name, slice(width, None)),
                                        (down, down_name, slice(None))):
                module = f"{PREFIX}model.layers.{layer}.{part.format(e=e)}"
                a = wrapper.lora_A["default"].weight.detach()
                b = wrapper.lora_B["default"].weight.detach()
                torch.testing.assert_close(tensors[f"{module}.lora_A.weight"], a[e * 4:(e + 1) * 4])
                torch.testing.assert_close(tensors[f"{module}.lora_B.weight"],
                                           wrapper.scaling["default"] * b[:, e::4][rows])
    experts = [n for n in tensors if ".experts." in n]
    assert len(experts) == 2 * 4 * 3 * 2  # layers x experts x (gate, up, down) x (A, B)
    # what an engine holding the checkpoint computes with it: W + B @ A per tensor (B scaled: vLLM's scale is 1)
    checkpoint = load_file(os.path.join(moe, "model.safetensors"))
    merged = []
    for name in tensors:
        if name.endswith(".lora_A.weight"):
            module = name[len(PREFIX):].removesuffix(".lora_A.weight")
            update = tensors[f"{PREFIX}{module}.lora_B.weight"] @ tensors[name]
            merged.append((f"{module}.weight", checkpoint[f"{module}.weight"].float() + update))
    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(moe), make_tiny_tokenizer(), owns_model=True)
    engine.load_weights(merged)
    policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(engine.model.eval()(IDS).logits, policy(IDS).logits, atol=1e-5, rtol=1e-5)


def test_an_expert_projection_left_unadapted_gets_a_zero_adapter(tmp_path):
    """vLLM packs w1, w2 and w3 of every expert together and needs all three: adapting gate_up_proj alone (named by
    its checkpoint part, gate_proj / w1) sends w2 as a zero LoRA of rank 1."""
    folder = make_tiny_moe_model_dir(str(tmp_path / "moe"))
    policy = trained_policy(folder, "lora", targets="q_proj,w1")
    assert sorted(policy.peft_config["default"].target_parameters) == ["experts.gate_up_proj"]
    tensors = dict(iter_adapter_tensors(policy, dtype=torch.float32))
    down = f"{PREFIX}model.layers.1.block_sparse_moe.experts.3.w2"
    assert tensors[f"{down}.lora_A.weight"].shape == (1, 128) and tensors[f"{down}.lora_B.weight"].shape == (64, 1)
    assert not tensors[f"{down}.lora_A.weight"].any() and not tensors[f"{down}.lora_B.weight"].any()
    assert tensors[f"{PREFIX}model.layers.1.block_sparse_moe.experts.3.w3.lora_B.weight"].any()


def test_the_upcycled_model_with_expert_lora_starts_as_the_dense_model(tiny_model, tmp_path):
    """LoRA starts at B = 0: the upcycled SmolLM2 form with adapters on its experts still computes the dense
    model's outputs."""
    from grpo import GRPOConfig
    from grpo.model.loading import load_policy

    folder = upcycled_dir(tiny_model, str(tmp_path / "moe"))
    policy = load_policy(GRPOConfig(model_name_or_path=folder, tuning_strategy="lora", lora_rank=4), folder,
                         torch.float32, torch.device("cpu")).eval()
    assert experts_of(policy)[1]
    dense = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(policy(IDS).logits, dense(IDS).logits, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- a GRPO run
@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_a_grpo_run_trains_the_experts_and_saves_both_adapter_forms(tmp_path, registry, strategy):
    """Two GRPO steps with the HF engine on a tiny Mixtral: the experts' adapters move, the engine's log-probs match
    the trainer's (the merged sync is exact), and the final adapter is saved as peft writes it (a run continues it)
    and as vLLM loads it (lora_adapter/vllm: the in-memory sync's tensors)."""
    from peft import PeftModel

    from grpo.train.trainer import GRPOTrainer

    folder = make_tiny_moe_model_dir(str(tmp_path / "moe"))
    config = tiny_config(folder, registry, str(tmp_path / "out"), tuning_strategy=strategy, rollout_engine="hf",
                         lora_dropout=0.05)
    trainer = GRPOTrainer(config, reward_funcs=[even_tokens])
    before = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters() if ".experts." in n
              and p.requires_grad}
    assert len(before) == 2 * 2 * 2  # layers x (gate_up, down) x (A, B)
    saved = trainer.train()
    moved = [n for n, p in trainer.engine.module.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert moved, "no expert adapter moved"
    rows = train_rows(tmp_path / "out")
    assert len(rows) == 2
    gap = [r[k] for r in rows for k in r if "logprob" in k and ("gap" in k or "mismatch" in k or "diff" in k)]
    assert gap and max(abs(g) for g in gap) < 1e-3, rows[-1]
    adapter = saved["lora_adapter"] if isinstance(saved, dict) and "lora_adapter" in saved else \
        str(tmp_path / "out" / "lora_adapter")
    vllm_form = load_file(os.path.join(adapter, "vllm", "adapter_model.safetensors"))
    expected = dict(iter_adapter_tensors(trainer.engine.module, dtype=torch.float32))
    assert vllm_form.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(vllm_form[name].float(), tensor)
    vllm_config = json.load(open(os.path.join(adapter, "vllm", "adapter_config.json")))
    assert vllm_config["r"] == vllm_config["lora_alpha"] == 4 and {"w1", "w2", "w3", "q_proj"} <= \
        set(vllm_config["target_modules"])
    if strategy == "lora":  # peft's own form reloads onto the base as the policy, and a run continues it
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), adapter).eval()
        policy = trainer.engine.module.eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(IDS).logits, policy(IDS).logits, atol=1e-5, rtol=1e-5)
        continued = trained_policy(folder, "lora", lora_adapter_path=adapter)
        assert sorted(experts_of(continued)[1]) == ["down_proj", "gate_up_proj"]


def test_targets_name_the_experts_by_their_checkpoint_names(tmp_path):
    """A list names the experts as the checkpoints do (or `experts`); the linear layers keep their names."""
    from grpo.model.expert_targets import expert_lora_targets

    with torch.device("meta"):
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                 num_local_experts=2))
    linear = ["k_proj", "o_proj", "q_proj", "v_proj"]
    both = ["experts.down_proj", "experts.gate_up_proj"]
    assert expert_lora_targets(model, "all-linear", linear) == (linear, both)
    assert expert_lora_targets(model, ["q_proj", "experts"], linear) == (["q_proj"], both)
    assert expert_lora_targets(model, ["q_proj", "w2"], linear) == (["q_proj"], ["experts.down_proj"])
    assert expert_lora_targets(model, ["gate_proj", "up_proj"], linear) == (None, ["experts.gate_up_proj"])
    assert expert_lora_targets(model, ["q_proj", "v_proj"], linear) == (["q_proj", "v_proj"], None)
    with pytest.raises(ConfigError, match="router"):
        expert_lora_targets(model, ["q_proj", "gate"], linear)




def test_the_frozen_experts_become_views_of_the_engines_fused_experts(moe):
    """Adapter mode: vLLM's FusedMoE holds experts.w13_weight [E, 2I, H] (each expert's gate rows, then its up rows)
    and experts.w2_weight [E, H, I], the layout of transformers' fused tensors; the trainer's frozen experts become
    views of them where every element is equal, and keep their own copy where not (here: gate and up swapped)."""
    from grpo.sync.shared_base import share_base_weights

    policy = trained_policy(moe, "lora")
    gate_name, up_name, down_name = CHECKPOINT_PARTS[family(moe)]
    moe_path = gate_name.split(".experts.")[0]
    checkpoint = load_file(os.path.join(moe, "model.safetensors"))
    engine = {}
    for layer in (0, 1):
        def part(name, e):
            return checkpoint[f"model.layers.{layer}.{name.format(e=e)}.weight"].float()

        gate_up = [torch.cat([part(gate_name, e), part(up_name, e)]) for e in range(4)]
        if layer == 1:  # a layout the trainer does not hold: up rows first
            gate_up = [torch.cat([part(up_name, e), part(gate_name, e)]) for e in range(4)]
        engine[f"model.layers.{layer}.{moe_path}.experts.w13_weight"] = torch.stack(gate_up)
        engine[f"model.layers.{layer}.{moe_path}.experts.w2_weight"] = torch.stack([part(down_name, e)
                                                                                   for e in range(4)])
    engine_model = module_holding(engine)
    policy.eval()
    with torch.no_grad():
        before = policy(IDS).logits
    result = share_base_weights(policy, engine_model)
    views = {name: p.data_ptr() for name, p in engine_model.named_parameters()}
    outer, wrappers = experts_of(policy, 0)
    assert wrappers["gate_up_proj"].get_param().data_ptr() == views[f"model.layers.0.{moe_path}.experts.w13_weight"]
    assert wrappers["down_proj"].get_param().data_ptr() == views[f"model.layers.0.{moe_path}.experts.w2_weight"]
    _, swapped = experts_of(policy, 1)
    assert swapped["gate_up_proj"].get_param().data_ptr() != views[f"model.layers.1.{moe_path}.experts.w13_weight"]
    assert result.shared == 3 and "model.layers.1.mlp.experts.gate_up_proj" in result.kept_names
    with torch.no_grad():
        torch.testing.assert_close(policy(IDS).logits, before, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------- qlora: 4-bit experts
@pytest.fixture(params=["mixtral", "qwen3_moe"])
def fused_moe(request, tmp_path):
    folder = str(tmp_path / request.param)
    return make_tiny_moe_model_dir(folder) if request.param == "mixtral" else tiny_qwen3_moe_dir(folder)


def expert_stacks(policy) -> list[tuple]:
    """(module, parameter name, tensor) of every fused expert weight of the policy's base."""
    from grpo.model.quantized_experts import fused_expert_slots

    return [(module, name, getattr(module, name)) for module, name in fused_expert_slots(policy)]


def with_dense_experts(policy):
    """The same policy with every 4-bit expert stack replaced by its dequantized values as a plain parameter."""
    for module, name, stack in expert_stacks(policy):
        setattr(module, name, torch.nn.Parameter(stack.dequantize(), requires_grad=False))
    return policy


def test_qlora_holds_the_experts_in_4_bits(fused_moe, caplog):
    """Under qlora every fused expert stack is an Experts4bit of the 16-bit shape and dtype holding bitsandbytes'
    packed codes (half a byte per value) and per-block scales (blocks of --qlora_block_size, double-quantized):
    4.25 bits per value instead of 32, plus the codebooks; peft's ParamWrapper adapts it unchanged, and no warning says the
    experts stay 16-bit."""
    from grpo.model.quantized_experts import Experts4bit, parameter_bytes

    with caplog.at_level("WARNING", logger="grpo"):
        policy = trained_policy(fused_moe, "qlora")
    assert not [r for r in caplog.records if "experts" in r.getMessage() and "stay" in r.getMessage()]
    stacks = expert_stacks(policy)
    assert len(stacks) == 2 * 2  # layers x (gate_up_proj, down_proj)
    for _, name, stack in stacks:
        assert isinstance(stack, Experts4bit) and isinstance(stack, torch.nn.Parameter) and not stack.requires_grad
        assert stack.dtype == torch.float32 and stack.dim() == 3 and name in ("gate_up_proj", "down_proj")
        assert stack.packed.dtype == torch.uint8 and stack.packed.numel() == stack.numel() // 2
        assert {s.blocksize for s in stack.states} == {32} and {s.quant_type for s in stack.states} == {"nf4"}
        scales = sum(s.absmax.numel() + 4 * s.state2.absmax.numel() for s in stack.states)  # uint8, fp32 nested
        assert 8 * (stack.packed.numel() + scales) / stack.numel() < 4.3  # 4 + 8 / 32 + 32 / (32 * 256), rounded up
        assert parameter_bytes(stack) < stack.numel() * stack.element_size() / 5  # (with the shared codebooks)
    _, wrappers = experts_of(policy)
    assert all(isinstance(w.get_param(), Experts4bit) for w in wrappers.values())
    held = sum(parameter_bytes(p) for p in policy.parameters())
    dense = sum(p.numel() * p.element_size() for _, _, p in stacks)
    assert held < dense  # the experts alone in fp32 outweigh the whole 4-bit policy


def test_qlora_experts_compute_as_their_dequantized_values(fused_moe):
    """The policy with 4-bit experts computes what it computes with those experts dequantized into plain fp32
    parameters: logits with the adapter and without (the reference), and the expert adapters' gradients."""
    policy = trained_policy(fused_moe, "qlora")
    factors = [n for n, p in policy.named_parameters() if p.requires_grad and ".experts." in n]

    def run():
        policy.eval()
        with torch.no_grad():
            logits = policy(IDS).logits
            with policy.disable_adapter():
                reference = policy(IDS).logits
        policy.train()
        policy.zero_grad()
        policy(IDS, labels=IDS).loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if n in factors}
        return logits, reference, grads

    logits, reference, grads = run()
    assert len(grads) == 2 * 2 * 2 and all(g.abs().sum() > 0 for g in grads.values())
    with_dense_experts(policy)
    assert expert_stacks(policy)[0][2].__class__.__name__ != "Experts4bit"
    dense_logits, dense_reference, dense_grads = run()
    torch.testing.assert_close(logits, dense_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reference, dense_reference, atol=1e-5, rtol=1e-5)
    for name in factors:
        torch.testing.assert_close(grads[name], dense_grads[name], atol=1e-5, rtol=1e-4)


def test_a_qlora_step_trains_the_expert_adapters_over_frozen_4bit_experts(fused_moe):
    """One optimizer step on the adapter (gradient checkpointing on, as on CPU by default): the loss changes, the
    experts' factors move, the 4-bit experts' codes do not."""
    policy = trained_policy(fused_moe, "qlora")
    codes = [stack.packed.clone() for _, _, stack in expert_stacks(policy)]
    factors = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad and ".experts." in n}
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    policy.train()
    loss = policy(IDS, labels=IDS).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = policy(IDS, labels=IDS).loss
    assert after < loss.detach()
    moved = [n for n, p in policy.named_parameters() if n in factors and not torch.equal(p, factors[n])]
    assert sorted(moved) == sorted(factors)
    assert all(torch.equal(c, stack.packed) for c, (_, _, stack) in zip(codes, expert_stacks(policy)))


def test_the_qlora_adapter_of_4bit_experts_round_trips(fused_moe, tmp_path):
    """The saved adapter (peft's fused factors) continued onto a freshly loaded qlora base gives the same policy:
    the experts are quantized again the same way. Its merged export merges into the 16-bit checkpoint (as qlora's
    linear layers are): W_e + s * B_e @ A_e from the checkpoint's experts."""
    from grpo import GRPOConfig
    from grpo.checkpoint.final_model import save_final_model
    from grpo.model.loading import load_policy

    policy = trained_policy(fused_moe, "qlora").eval()
    config = GRPOConfig(model_name_or_path=fused_moe, tuning_strategy="qlora", lora_rank=4, lora_alpha=8,
                        lora_dropout=0.0, save_merged_model=True)
    saved = save_final_model(policy, make_tiny_tokenizer(), str(tmp_path / "out"), config, fused_moe, torch.float32)
    adapter = saved["lora_adapter"]
    assert os.path.isfile(os.path.join(adapter, "vllm", "adapter_model.safetensors"))
    continued = GRPOConfig(model_name_or_path=fused_moe, tuning_strategy="qlora", lora_adapter_path=adapter)
    reloaded = load_policy(continued, fused_moe, torch.float32, torch.device("cpu")).eval()
    assert all(s.__class__.__name__ == "Experts4bit" for _, _, s in expert_stacks(reloaded))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, policy(IDS).logits, atol=1e-6, rtol=1e-6)
    merged = load_file(os.path.join(saved["merged_model"], "model.safetensors"))
    checkpoint = load_file(os.path.join(fused_moe, "model.safetensors"))
    _, wrappers = experts_of(policy, 1)
    down = wrappers["down_proj"]
    experts_a, experts_b = expert_factors(down.lora_A["default"].weight.detach(), down.lora_B["default"].weight.detach(),
                                          4)
    update = expert_delta(experts_a, experts_b, down.scaling["default"])
    name = "model.layers.1." + CHECKPOINT_PARTS[family(fused_moe)][2].format(e=2) + ".weight"
    torch.testing.assert_close(merged[name].float(), checkpoint[name].float() + update[2], atol=1e-5, rtol=1e-5)


def test_qlora_quantizes_each_expert_stack_as_it_loads(fused_moe, monkeypatch):
    """The load never holds more than one 16-bit expert stack: each is quantized as transformers sets it into the
    model (grpo.model.quantized_experts.experts_quantized_as_loaded), and the policy is the one a quantization after
    the load gives."""
    from transformers import core_model_loading

    from grpo.model.quantized_experts import Experts4bit, quantize_fused_experts

    alive = []
    set_param = core_model_loading.set_param_for_module

    def recording(model, *args, **kwargs):
        set_param(model, *args, **kwargs)
        alive.append(sum(1 for p in model.parameters() if p.dim() == 3 and p.device.type != "meta"
                         and not isinstance(p, Experts4bit)))

    monkeypatch.setattr(core_model_loading, "set_param_for_module", recording)
    policy = trained_policy(fused_moe, "qlora").eval()
    assert alive and max(alive) == 1
    monkeypatch.setattr(core_model_loading, "set_param_for_module", set_param)
    dense = AutoModelForCausalLM.from_pretrained(fused_moe, dtype=torch.float32)
    assert quantize_fused_experts(dense, "nf4", 32, "mse") == 4
    for (_, name, loaded), (_, _, after) in zip(expert_stacks(policy), expert_stacks(dense)):
        assert torch.equal(loaded.packed, after.packed), name


@pytest.mark.parametrize("shape", [(4, 256, 64), (3, 64, 32)])
def test_a_4bit_expert_stack_reads_the_same_per_expert_and_whole(shape):
    """Experts4bit: W[e] dequantizes expert e alone, any other read the stack; both give the same values, within
    4-bit rounding of the weights; writes are refused. (4, 256, 64): blocks of scales align with the experts, the
    stack is quantized in one piece (one call reads it whole); (3, 64, 32): expert by expert."""
    from grpo.model.quantized_experts import Experts4bit, quantize_experts

    torch.manual_seed(0)
    weight = torch.randn(*shape)
    stack = torch.nn.Parameter(quantize_experts(weight, "nf4", 32, "mse"), requires_grad=False)
    assert isinstance(stack, Experts4bit) and (stack.whole is not None) == (shape[0] == 4)
    whole = stack.dequantize()
    assert all(torch.equal(stack[e], whole[e]) for e in range(shape[0]))
    assert torch.equal(stack * 1, whole) and torch.equal(stack.data + 0, whole)
    assert (whole - weight).norm() < 0.15 * weight.norm()
    with pytest.raises(ConfigError, match="frozen"):
        stack.data.add_(1)



# ------------------------------------------------------------------------------------------------ under DeepSpeed
EVEN_TOKENS_MODULE = '''
from grpo import register_reward

@register_reward("even_tokens")
def even_tokens(completions, answers, completion_ids, **row):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


@pytest.mark.skipif(__import__("shutil").which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
def test_two_ranks_train_qlora_on_4bit_experts_under_zero2(tmp_path):
    """`deepspeed --num_gpus 2 train_grpo.py --tuning_strategy qlora --deepspeed zero2` on a tiny Mixtral (HF engine,
    2 CPU ranks): every rank holds the experts in 4 bits, the experts' adapters move, the engine scores as the
    trainer does after each update, and both adapter forms are saved."""
    from .spawn_ranks import free_port
    from .test_multiprocess import launch
    from .trainer_setup import write_prompt_registry

    model = make_tiny_moe_model_dir(str(tmp_path / "moe"))
    registry = write_prompt_registry(str(tmp_path / "data"), reward="even_tokens")
    (tmp_path / "rewards.py").write_text(EVEN_TOKENS_MODULE)
    out = tmp_path / "out"
    proc = launch(tmp_path, model, registry, out, free_port(), "--reward_module", str(tmp_path / "rewards.py"),
                  "--tuning_strategy", "qlora", "--deepspeed", "zero2", "--rollout_engine", "hf", "--max_steps", "2",
                  "--k_samples", "2", "--per_device_train_batch_size", "1", "--save_steps", "0",
                  "--logprob_check_steps", "1", "--no_eval_on_start", "--eval_max_prompts", "1")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 rank(s)" in log and "fused expert stacks held in 4 bits" in log
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # step 2's rollouts come from the policy after step 1's update
        assert row["rollout/logprob_diff_max"] < 1e-3 and row["grad_norm"] > 0, row
    adapter = load_file(str(out / "lora_adapter" / "adapter_model.safetensors"))
    expert_b = [name for name in adapter if ".experts." in name and "lora_B" in name]
    assert len(expert_b) == 2 * 2  # layers x (gate_up, down)
    assert all(adapter[name].abs().max() > 0 for name in expert_b), "an expert adapter did not move (B starts at 0)"
    assert os.path.isfile(out / "lora_adapter" / "vllm" / "adapter_model.safetensors")


def test_qlora_on_fused_experts_under_zero3_is_refused_before_any_weight_loads(tmp_path, registry, monkeypatch):
    """ZeRO-3 partitions every parameter through its dense values, so it would turn qlora's Experts4bit into 16-bit
    partitions: refused at the run's start with what to use instead; lora under ZeRO-3 and a dense qlora model under
    ZeRO-3 start."""
    import grpo.model.loading
    from grpo.config.sections.model import four_bit_experts_conflict
    from grpo.train.setup import prepare_run

    from .tiny_models import make_tiny_model_dir

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(grpo.model.loading, "load_base_model", no_weights)
    folder = make_tiny_moe_model_dir(str(tmp_path / "moe"))
    config = tiny_config(folder, registry, str(tmp_path / "out"), tuning_strategy="qlora", deepspeed="zero3")
    with pytest.raises(ConfigError) as refused:
        prepare_run(config)
    message = str(refused.value)
    assert "--tuning_strategy qlora with ZeRO-3" in message and "4 fused 3-D stacks" in message, message
    assert "Use --deepspeed zero2" in message and "--tuning_strategy lora under ZeRO-3" in message, message
    assert not os.path.exists(tmp_path / "out")  # a refused start leaves nothing behind
    prepare_run(tiny_config(folder, registry, str(tmp_path / "lora"), tuning_strategy="lora", deepspeed="zero3"))
    prepare_run(tiny_config(folder, registry, str(tmp_path / "zero2"), tuning_strategy="qlora", deepspeed="zero2"))
    dense = make_tiny_model_dir(str(tmp_path / "dense"))
    prepare_run(tiny_config(dense, registry, str(tmp_path / "dense_out"), tuning_strategy="qlora", deepspeed="zero3"))
    assert four_bit_experts_conflict(config, 2, 4) is None and four_bit_experts_conflict(config, 3, 0) is None


def test_plan_only_refuses_qlora_on_fused_experts_under_zero3(tmp_path, capsys):
    """--plan_only says what the run would say before loading: qlora on fused experts under ZeRO-3 is refused with
    the same message (exit code 1), and under ZeRO-2 the plan prints."""
    from grpo.entry.train import main

    folder = make_tiny_moe_model_dir(str(tmp_path / "moe"))
    flags = ["--model_name_or_path", folder, "--tuning_strategy", "qlora", "--dataset_names", "arith",
             "--rollout_engine", "hf", "--output_dir", str(tmp_path / "out"), "--plan_only", "--gpu_memory_gib", "24"]
    assert main(flags + ["--deepspeed", "zero3"]) == 1
    refused = capsys.readouterr().err
    assert "--tuning_strategy qlora with ZeRO-3" in refused and "Use --deepspeed zero2" in refused, refused
    assert main(flags + ["--deepspeed", "zero2"]) == 0
    assert "planned peak" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "out")
