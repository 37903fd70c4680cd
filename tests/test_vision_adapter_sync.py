"""Vision-language models with --rollout_weights adapter: the adapter as vLLM's LoRA takes it, the trainer's 4-bit
base as vLLM's bitsandbytes loader reads it, the trainer's base shared with the engine under vLLM's names, and which
weights the engine takes (auto, explicit, refusals). On CPU with the tiny Qwen2.5-VL / Qwen2-VL of
tests/tiny_vl_models.py; vLLM's side is written down below as data read from its source (docs/vision.md)."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from grpo.config.options import GRPOConfig
from grpo.errors import ConfigError
from grpo.model.quantized_checkpoint import write_4bit_checkpoint
from grpo.sync.weight_sync import iter_adapter_tensors

from .sync_setup import trained_policy
from .tiny_vl_models import make_tiny_vl_model_dir

ARCHS = ["qwen2_5_vl", "qwen2_vl"]
# the tiny language model (tests/tiny_vl_models.py): hidden 64, intermediate 128, 4 heads of 16, 2 KV heads, 2 layers
HIDDEN, INTERMEDIATE, KV, LAYERS, RANK = 64, 128, 2 * 16, 2, 4
LINEAR_SHAPES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN),
                 "self_attn.v_proj": (KV, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
                 "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
                 "mlp.down_proj": (HIDDEN, INTERMEDIATE)}  # [out, in]

# ---- vLLM v0.26.0, as read from its source ----
# vllm/model_executor/models/qwen2_5_vl.py (Qwen2_5_VLForConditionalGeneration) and qwen2_vl.py
# (Qwen2VLForConditionalGeneration): hf_to_vllm_mapper.orig_to_new_prefix, applied by WeightsMapper._map_name
# (vllm/model_executor/models/utils.py) to every matching prefix in this order
VLLM_PREFIXES = {"model.language_model.": "language_model.model.", "model.visual.": "visual.",
                 "lm_head.": "language_model.lm_head.", "model.": "language_model.model."}
# packed_modules_mapping (Qwen2.5-VL's own; Qwen2-VL's comes from its Qwen2ForCausalLM language model,
# vllm/model_executor/utils.py get_packed_modules_mapping)
VLLM_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
# get_mm_mapping(): LoRA layers under language_model only, unless enable_tower_connector_lora
# (vllm/lora/model_manager.py _maybe_init_mm / _get_punica_wrapper: other layers "will be ignored")
VLLM_LORA_PREFIX = "language_model."


def vllm_map(name: str) -> str:
    for prefix, new in VLLM_PREFIXES.items():
        if name.startswith(prefix):
            name = new + name[len(prefix):]
    return name


def vllm_lora_module(tensor_name: str) -> tuple[str, bool]:
    """vllm/lora/utils.py parse_fine_tuned_lora_name with the model's mapper: (module, is lora_A)."""
    assert tensor_name.startswith("base_model.model.") and tensor_name.endswith((".lora_A.weight", ".lora_B.weight"))
    name = vllm_map(tensor_name[len("base_model.model."):])
    return name.rsplit(".", 2)[0], name.endswith(".lora_A.weight")


def vllm_lora_layers() -> dict[str, list[str]]:
    """vLLM's LoRA layers of the tiny model (fused) -> the adapter modules each takes, in order."""
    layers = {}
    for i in range(LAYERS):
        base = f"language_model.model.layers.{i}"
        for fused, parts in [("self_attn.qkv_proj", ["q_proj", "k_proj", "v_proj"]), ("self_attn.o_proj", None),
                             ("mlp.gate_up_proj", ["gate_proj", "up_proj"]), ("mlp.down_proj", None)]:
            parent = fused.rpartition(".")[0]
            layers[f"{base}.{fused}"] = [f"{base}.{parent}.{p}" for p in parts] if parts else [f"{base}.{fused}"]
    return layers


def is_layer_skipped_bnb(prefix: str, skip: list[str]) -> bool:
    """vllm/model_executor/layers/quantization/bitsandbytes.py: a skip entry equal to a component of the layer's
    prefix, or to one of its leading dotted paths, keeps the layer unquantized."""
    parts = prefix.split(".")
    return any(s in parts for s in skip) or bool(set(skip) & {".".join(parts[:i + 1]) for i in range(len(parts))})


# ---- fixtures ----
@pytest.fixture(scope="module")
def vl_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_vl_adapter")
    return {arch: make_tiny_vl_model_dir(str(root / arch), arch=arch) for arch in ARCHS}


def saved_names(model_dir) -> set[str]:
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as fh:
        return set(fh.keys())


# ---- the adapter as sent ----
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_adapter_tensors_land_on_vllms_language_model_layers(vl_models, arch, strategy):
    policy = trained_policy(vl_models[arch], strategy)
    tensors = dict(iter_adapter_tensors(policy, dtype=torch.float32))
    assert len(tensors) == 2 * 7 * LAYERS
    layers = vllm_lora_layers()
    adapter_modules = {module for parts in layers.values() for module in parts}
    landed = {}
    for name, tensor in tensors.items():
        assert name.startswith("base_model.model.model.layers."), name  # the checkpoint's names, as merged sync
        module, is_a = vllm_lora_module(name)
        assert module.startswith(VLLM_LORA_PREFIX) and module in adapter_modules, (name, module)
        out, inp = LINEAR_SHAPES[module.split(".", 4)[4]]
        assert tuple(tensor.shape) == ((RANK, inp) if is_a else (out, RANK)), (name, tensor.shape)
        landed.setdefault(module, set()).add("A" if is_a else "B")
    assert set(landed) == adapter_modules and all(v == {"A", "B"} for v in landed.values())
    # lora_B goes scaled by alpha / r (= 2): vLLM's helper then scales by 1
    live = dict(policy.named_modules())["base_model.model.model.language_model.layers.1.mlp.down_proj"]
    torch.testing.assert_close(tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"],
                               live.lora_B["default"].weight * 2.0)


# ---- the 4-bit base as written ----
@pytest.mark.parametrize("arch", ARCHS)
def test_4bit_base_has_the_checkpoints_names_a_16bit_tower_and_the_processor(vl_models, arch, tmp_path):
    from grpo.model.base_weights import saved_4bit
    from grpo.model.vision import VisionProcessor
    from grpo.model.loading import load_tokenizer

    model_dir = vl_models[arch]
    policy = trained_policy(model_dir, "qlora")
    out = str(tmp_path / "base4")
    write_4bit_checkpoint(policy, out, dtype=torch.float32, source=model_dir)
    with open(os.path.join(out, "model.safetensors.index.json")) as fh:
        written = set(json.load(fh)["weight_map"])
    quant_keys = ["absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4"]
    quantized = {f"model.layers.{i}.{m}.weight" for i in range(LAYERS) for m in LINEAR_SHAPES}
    expected = saved_names(model_dir) | {f"{w}.{k}" for w in quantized for k in quant_keys}
    assert written == expected, (written ^ expected)
    # every tensor lands on a vLLM name of the language model or the tower
    assert all(vllm_map(n).startswith(("language_model.model.", "language_model.lm_head.", "visual."))
               for n in written)
    skip = saved_4bit(out)["llm_int8_skip_modules"]
    assert skip == ["lm_head", "model.visual", "visual"]
    # vLLM (vllm_map'd prefixes): the tower's layers stay 16-bit, no language-model layer does
    with safe_open(os.path.join(out, "model-00001.safetensors"), "pt") as fh:
        tower = [n for n in fh.keys() if n.startswith("visual.") and n.endswith(".weight")]
        assert tower and all(fh.get_tensor(n).dtype == torch.float32 for n in tower)
        assert all(fh.get_tensor(w).dtype == torch.uint8 for w in quantized)
    assert all(is_layer_skipped_bnb(vllm_map(n).removesuffix(".weight"), skip) for n in tower)
    assert not any(is_layer_skipped_bnb(vllm_map(w).removesuffix(".weight"), skip) for w in quantized)
    for fused in vllm_lora_layers():  # the fused layers vLLM builds quantize as one: none skipped
        assert not is_layer_skipped_bnb(fused, skip)
    # vLLM builds the model's processor from the folder it loads: the tokenizer and image processor are there
    tokenizer = load_tokenizer(out)
    assert VisionProcessor.from_pretrained(out, tokenizer).image_token_id == tokenizer.convert_tokens_to_ids(
        "<|image_pad|>")


# ---- the trainer's base shared with the engine ----
class VLLMNames(torch.nn.Module):
    """Stands in for vLLM's Qwen2.5-VL with LoRA enabled, holding what it loaded under its own names: fused
    qkv_proj / gate_up_proj, LoRA-wrapped layers' weights at `<layer>.base_layer.weight`, and its mapper."""

    class _Mapper:
        def get_unstacked_mapper(self):
            return self

        def _map_name(self, name):
            return vllm_map(name)

    hf_to_vllm_mapper = _Mapper()
    packed_modules_mapping = VLLM_PACKED

    def __init__(self, checkpoint: dict[str, torch.Tensor]):
        super().__init__()
        held = {}
        for name, tensor in checkpoint.items():
            held[vllm_map(name)] = tensor
        for name in [n for n in held if n.endswith((".q_proj.weight", ".q_proj.bias", ".gate_proj.weight",
                                                     ".gate_proj.bias"))]:
            # fused as vLLM's loader stacks them (the tower's gate_up_proj too: Qwen2.5-VL's vision MLP)
            module, leaf = name.rsplit(".", 1)
            parent, part = module.rsplit(".", 1)
            fused = next(f for f, parts in VLLM_PACKED.items() if part in parts)
            held[f"{parent}.{fused}.{leaf}"] = torch.cat([held.pop(f"{parent}.{p}.{leaf}")
                                                          for p in VLLM_PACKED[fused]])
        self.names = {}
        for name, tensor in held.items():
            wrapped = name.startswith("language_model.model.layers.") and name.endswith(".weight") \
                and "norm" not in name
            path = name.replace(".weight", ".base_layer.weight") if wrapped else name
            self.names[path] = torch.nn.Parameter(tensor.clone(), requires_grad=False)
            self.register_parameter(path.replace(".", "__"), self.names[path])

    def named_parameters(self, *args, **kwargs):
        return iter(self.names.items())


def test_the_trainers_base_becomes_views_of_the_engines_under_vllms_names(vl_models):
    from grpo.sync.shared_base import frozen_base, share_base_weights

    model_dir = vl_models["qwen2_5_vl"]
    policy = trained_policy(model_dir, "lora")
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as fh:
        engine = VLLMNames({n: fh.get_tensor(n) for n in fh.keys()})
    frozen = frozen_base(policy)
    result = share_base_weights(policy, engine, engine.packed_modules_mapping)
    assert result.kept == 0 and result.shared == len(frozen)  # the tower, the embeddings, every layer: held once
    q = frozen["model.language_model.layers.1.self_attn.k_proj.weight"]
    qkv = engine.names["language_model.model.layers.1.self_attn.qkv_proj.base_layer.weight"]
    assert q.data_ptr() == qkv[HIDDEN:].data_ptr()  # k's rows of the fused layer, after q's
    up = frozen["model.visual.blocks.0.mlp.up_proj.weight"]  # the tower's, in its fused gate_up_proj
    gate_up = engine.names["visual.blocks.0.mlp.gate_up_proj.weight"]
    assert up.data_ptr() == gate_up[gate_up.shape[0] // 2:].data_ptr()
    assert frozen["lm_head.weight"].data_ptr() == engine.names["language_model.lm_head.weight"].data_ptr()


# ---- which weights the engine takes ----
def vl_config(model_dir, **options):
    return GRPOConfig(**{"model_name_or_path": model_dir, "tuning_strategy": "qlora", "rollout_engine": "vllm",
                         "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0, **options})


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_takes_the_plans_adapter_or_merged_for_a_vl_model(vl_models, arch, grpo_log):
    from grpo.rollout import engines

    model_dir = vl_models[arch]
    for strategy in ("qlora", "lora"):
        policy = trained_policy(model_dir, strategy)
        cfg = vl_config(model_dir, tuning_strategy=strategy)
        assert engines.engine_weights(cfg, policy, vision=object(), planned="merged") == "merged"
        assert engines.engine_weights(cfg, policy, vision=object(), planned="adapter") == "adapter"
        assert "vLLM holds the base once and takes the adapter" in grpo_log[-1]
        explicit = vl_config(model_dir, tuning_strategy=strategy, rollout_weights="adapter")
        assert engines.engine_weights(explicit, policy, vision=object(), planned="merged") == "adapter"  # as asked
    # lora's in_place cannot rename the tower: a plan's in_place (the planner offers none for a VL model) would
    # fall back to the adapter, and an explicit in_place is an error
    assert engines.engine_weights(vl_config(model_dir, tuning_strategy="lora"), policy, vision=object(),
                                  planned="in_place") == "adapter"
    with pytest.raises(ConfigError, match="in_place.*vision-language"):
        engines.engine_weights(vl_config(model_dir, tuning_strategy="lora", rollout_weights="in_place"), policy,
                               vision=object())


@pytest.mark.parametrize("arch", ARCHS)
def test_the_planner_offers_a_vl_model_the_adapter_and_merged(vl_models, arch):
    from grpo.memory import planner

    model_dir = vl_models[arch]
    for strategy in ("qlora", "lora"):
        cfg = vl_config(model_dir, tuning_strategy=strategy)
        plan, run = planner.plan_parts(cfg, model_dir, gpu=planner.named_card(24))[:2]
        assert run.capable == ("adapter", "merged")  # no in_place for a vision-language model
        # a tiny model next to any GPU: merged (the copy well within 0.4, and 0.25, of the budget)
        assert plan.rollout_weights == "merged" and plan.sleep_level == 0


def test_qwen25_vl_7b_takes_the_adapter_where_its_copy_crowds_the_gpu():
    """Qwen2.5-VL-7B's published config: 8,292,166,656 parameters (its tower's 676,550,144 included), a
    16,584,333,312-byte (15.45 GiB) 16-bit copy."""
    from grpo.memory import planner

    model_dir = os.path.join(os.path.dirname(__file__), "model_configs", "qwen2.5-vl-7b")

    def plan(strategy, cap_gib):
        cfg = vl_config(model_dir, tuning_strategy=strategy, lora_rank=16, lora_alpha=32)
        return planner.plan_parts(cfg, model_dir, gpu=planner.named_card(cap_gib))[0]

    # qlora: 15.45 GiB past 0.4 x 24 = 9.6 GiB, the adapter (level 1); within 0.4 x 80 = 32 GiB merged, and within
    # 0.25 x 80 = 20 GiB kept through training (level 0)
    assert (plan("qlora", 24).rollout_weights, plan("qlora", 24).sleep_level) == ("adapter", 1)
    assert (plan("qlora", 80).rollout_weights, plan("qlora", 80).sleep_level) == ("merged", 0)
    # lora: past 8 GiB, in_place would come first; a VL model cannot take it, so the adapter at any size
    assert plan("lora", 80).rollout_weights == "adapter"


def test_lora_on_the_vision_tower_keeps_the_merged_engine(vl_models, grpo_log):
    """vLLM 0.26 adapts the language model only: an adapter on the tower would go unapplied in the engine."""
    from grpo.rollout import engines

    model_dir = vl_models["qwen2_5_vl"]
    policy = trained_policy(model_dir, "qlora", targets="qkv,q_proj")  # qkv: the tower's attention
    # the plan takes the adapter (a merged copy would crowd the GPU); the loaded policy cannot take it
    assert engines.engine_weights(vl_config(model_dir, lora_target_modules="qkv,q_proj"), policy,
                                  vision=object(), planned="adapter") == "merged"
    assert "vLLM takes merged weights: its LoRA cannot take LoRA on the vision tower" in grpo_log[-1]
    with pytest.raises(ConfigError, match=r"vLLM's LoRA cannot take LoRA on the vision tower \(2 layers, e\.g\. "
                                          r"model\.visual\.blocks\.0\.attn\.qkv.*leave vision layers out of "
                                          r"--lora_target_modules; use --rollout_weights merged"):
        engines.engine_weights(vl_config(model_dir, lora_target_modules="qkv,q_proj", rollout_weights="adapter"),
                               policy, vision=object())
    language_only = trained_policy(model_dir, "qlora", targets="q_proj")
    assert engines.engine_weights(vl_config(model_dir, lora_target_modules="q_proj"), language_only,
                                  vision=object(), planned="adapter") == "adapter"


def test_a_vl_family_vllms_lora_is_not_known_for_keeps_the_merged_engine(vl_models, monkeypatch):
    from grpo.rollout import engines

    model_dir = vl_models["qwen2_5_vl"]
    policy = trained_policy(model_dir, "qlora")
    monkeypatch.setattr(policy.config, "model_type", "llava")
    assert engines.engine_weights(vl_config(model_dir), policy, vision=object(), planned="adapter") == "merged"
    with pytest.raises(ConfigError, match="'llava' .*Qwen2-VL and Qwen2.5-VL only"):
        engines.engine_weights(vl_config(model_dir, rollout_weights="adapter"), policy, vision=object())
