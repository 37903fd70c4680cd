"""Tuning strategies (full / lora / qlora), the reference policy, tokenizer loading and final model saving."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import warnings
from typing import Optional

import torch

from grpo.config.options import GRPOConfig
from grpo.errors import ConfigError
from grpo.model.base_weights import saved_4bit
from grpo.model.expert_targets import expert_lora_targets
from grpo.model.qlora_base_record import warn_if_another_base
from grpo.model.qlora_rounding import requantize_4bit_base
from grpo.model.quantized_experts import experts_quantized_as_loaded, quantize_fused_experts

logger = logging.getLogger("grpo")
CHECKPOINTING_FROM_PARAMETERS = 1_000_000_000  # --gradient_checkpointing auto: on from here
# ... and always on CPU: its micro-batch is 16384 tokens (no GPU memory to size it by), so the CPU demo (0.13B model,
# 32 rows in one micro-batch) kept every layer's activations: checkpointing took its update's peak RSS from 10.4 to
# 7.4 GiB (benchmarks/RESULTS.md, 2026-11-28), with the same losses, for one more forward per layer (+16% update time)
CHECKPOINTING_ON_CPU = True


def load_tokenizer(model_path: str, trust_remote_code: bool = False):
    """Tokenizer with a pad token (EOS when it has none) and left padding (for batched generation)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_base_model(model_path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool,
                    quantization_config=None, device_map=None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from grpo.model import attention
    from grpo.model.vision import is_vision_language

    kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    implementation = attention.attention_implementation(hf_config)
    if implementation is not None:  # soft-capped attention logits (Gemma 2): not SDPA, which drops the cap
        kwargs.update(attn_implementation=implementation)
        logger.info(attention.why(hf_config))
    if quantization_config is not None:
        device_map = {"": device}
        kwargs.update(quantization_config=quantization_config)
    if device_map is not None:  # quantized layers are placed as they load
        kwargs.update(device_map=device_map)
    auto = AutoModelForImageTextToText if is_vision_language(model_path, trust_remote_code) else AutoModelForCausalLM
    model = auto.from_pretrained(model_path, **kwargs)
    return model if device_map is not None else model.to(device)


def lora_target_modules(value: str):
    """--lora_target_modules as peft wants it: "all-linear" or a list of module names."""
    return "all-linear" if value.strip() == "all-linear" else [m.strip() for m in value.split(",") if m.strip()]


def attention_without_shape_plans(device: torch.device) -> None:
    """Leave PyTorch's cuDNN backend out of scaled-dot-product attention, process-wide, when training on CUDA.

    Training micro-batches change shape all the time (token budgets over sampled lengths), and cuDNN attention
    builds an execution plan for every new shape; flash and memory-efficient attention need none.
    """
    if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        logger.info("attention: flash / memory-efficient SDPA kernels (cuDNN attention left out: it builds a plan "
                    "for every new batch shape)")


def load_policy(config: GRPOConfig, model_path: str, dtype: torch.dtype, device: torch.device,
                checkpointing: Optional[bool] = None) -> torch.nn.Module:
    """The trainable policy: the full model, or the base with a (new or continued) LoRA adapter. `checkpointing`:
    the memory plan's choice of gradient checkpointing (None: --gradient_checkpointing, auto decided here)."""
    from grpo.model import vision

    attention_without_shape_plans(device)
    is_vl = vision.is_vision_language(model_path, config.trust_remote_code)
    quantization = None
    stored_4bit = saved_4bit(model_path)
    if stored_4bit:  # its own quantization_config loads it; nothing is quantized again
        logger.info(f"{model_path} is saved in 4 bits ({stored_4bit.get('bnb_4bit_quant_type', 'nf4')}): its base "
                    "trains as it is (--qlora_block_size / --qlora_block_scale apply to 16-bit checkpoints)")
    elif config.strategy.four_bit_base:
        from transformers import BitsAndBytesConfig

        # a vision-language model keeps its vision tower (and output layer) unquantized; a list replaces
        # transformers' default skips, so it names the output layer again
        skip = vision.quantization_skip_modules(model_path) if is_vl else None
        if config.qlora_skip_list:
            skip = (skip or ["lm_head"]) + config.qlora_skip_list
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=config.qlora_quant_type,
                                          bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype,
                                          llm_int8_skip_modules=skip)
    # qlora: the fused experts too, each as it loads (bitsandbytes quantizes nn.Linear layers only)
    experts_4bit = (config.qlora_quant_type, config.qlora_block_size, config.qlora_block_scale)
    with experts_quantized_as_loaded(*experts_4bit) if config.strategy.four_bit_base else contextlib.nullcontext():
        model = load_base_model(model_path, dtype, device, config.trust_remote_code, quantization,
                                device_map={"": device} if stored_4bit else None)
    if config.strategy.four_bit_base:
        quantize_fused_experts(model, *experts_4bit)
    if quantization is not None and config.qlora_requantizing_options:
        requantize_4bit_base(model, model_path, config.qlora_block_size, config.qlora_block_scale,
                             " and ".join(config.qlora_requantizing_options))
    if config.qlora_skip_list:
        _check_module_names_exist(model, config.qlora_skip_list, "--qlora_skip_modules",
                                  "give a name or its last parts")
    if is_vl and config.freeze_vision_tower:
        vision.freeze_vision_tower(model)
    checkpointing = wants_checkpointing(config.gradient_checkpointing if checkpointing is None else checkpointing,
                                        model)
    if config.strategy.four_bit_base:
        prepare_4bit_base(model, dtype)
    if checkpointing:
        _enable_checkpointing(model)
    if is_vl and config.freeze_vision_tower:
        vision.freeze_vision_tower(model)  # prepare_model_for_kbit_training may have unfrozen it
    if config.uses_lora:
        model = _attach_lora(model, config, vision.language_linear_names(model) if is_vl else None)
        if config.qlora_init == "loftq":
            from grpo.model.loftq import add_rounding_correction

            add_rounding_correction(model, model_path)
        if checkpointing:
            model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(f"{config.tuning_strategy}: {trainable:,} trainable of {total:,} parameters "
                f"({100 * trainable / max(total, 1):.2f}%)")
    return model


def parameter_count(model) -> int:
    """Parameters of the model as trained, a 4-bit weight counted by its values (bitsandbytes packs two per byte)."""
    return sum(p.numel() * (2 if p.__class__.__name__ == "Params4bit" else 1) for p in model.parameters())


def checkpointing_by_size(parameters: int, on_cpu: bool) -> bool:
    """--gradient_checkpointing auto's one rule, which the memory plan applies before loading
    (grpo.memory.plan.auto_checkpointing) and a policy loaded without a plan's choice here: on from
    CHECKPOINTING_FROM_PARAMETERS parameters, and on a CPU where CHECKPOINTING_ON_CPU."""
    return parameters >= CHECKPOINTING_FROM_PARAMETERS or (CHECKPOINTING_ON_CPU and on_cpu)


def wants_checkpointing(option: Optional[bool], model) -> bool:
    """--gradient_checkpointing as given (or as the memory plan chose it: the trainer passes the plan's), else auto's
    rule (checkpointing_by_size: at 7B, 16k tokens of activations without it take more memory than an 80 GB GPU has;
    at 0.5B they fit beside the weights)."""
    if option is not None:
        return option
    count = parameter_count(model)
    on = checkpointing_by_size(count, on_cpu=next(model.parameters()).device.type == "cpu")
    logger.info(f"gradient checkpointing {'on' if on else 'off'} ({count / 1e9:.2f}B parameters; auto turns it on "
                f"from {CHECKPOINTING_FROM_PARAMETERS / 1e9:.0f}B and on CPU; --gradient_checkpointing true/false "
                f"to choose)")
    return on


def prepare_4bit_base(model, dtype: torch.dtype) -> None:
    """Freeze the 4-bit base for LoRA training (checkpointing is enabled by the caller).

    peft's prepare_model_for_kbit_training also casts every unquantized weight (embeddings, output layer, norms) to
    fp32, which only helps fp16 (whose range those weights can overflow). In bf16 DeepSpeed's engine casts them back
    to bf16 anyway, so the upcast only costs a transient copy at load (at Qwen2.5-7B's shape 2 x 545M parameters,
    4 GiB in fp32) and makes the model as loaded differ from the model as trained; the base stays in bf16 instead."""
    if dtype == torch.float16:
        from peft import prepare_model_for_kbit_training

        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model.requires_grad_(False)
    keep_4bit_forward_exact(model)


def keep_4bit_forward_exact(model) -> int:
    """Make every 4-bit linear compute `x @ dequantize_4bit(W).T` in the compute dtype, in every mode.

    On CPUs with avx512_bf16, bitsandbytes (>= 0.48) repacks a Linear4bit's weight the first time it runs in eval
    mode without grad (HF generate, log-prob scoring) and from then on multiplies in bf16 with bf16 block scales,
    in training too. The policy would then change under the trainer (max |logit diff| 0.026 on the tiny test model)
    and the repacked weight no longer dequantizes to the trained one. Returns the number of layers switched.
    """
    switched = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            switched += 1
    return switched


def _enable_checkpointing(model) -> None:
    """Recompute activations in backward; non-reentrant, so frozen inputs (peft) still get gradients through."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _attach_lora(model, config: GRPOConfig, language_linears: Optional[list[str]] = None):
    """A new or continued adapter. For a vision-language model, "all-linear" with a frozen vision tower means the
    language model's linear layers (`language_linears`); named modules are matched as peft does, anywhere."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if config.lora_adapter_path:
        adapter_config = os.path.join(config.lora_adapter_path, "adapter_config.json")
        if not os.path.isfile(adapter_config):
            raise ConfigError(f"--lora_adapter_path: no adapter_config.json in {config.lora_adapter_path}")
        with open(adapter_config) as fh:
            saved = json.load(fh)
        logger.info(f"continuing the adapter in {config.lora_adapter_path} (r={saved.get('r')}, "
                    f"alpha={saved.get('lora_alpha')})")
        warn_if_another_base(config.lora_adapter_path, config)
        with peft_asks_old_checkpointing_name():
            policy = PeftModel.from_pretrained(model, config.lora_adapter_path, is_trainable=True)
        _refuse_fused_expert_adapters(policy, f"--lora_adapter_path {config.lora_adapter_path}",
                                      "train a new adapter with")
        return policy
    targets = lora_target_modules(config.lora_target_modules)
    if targets == "all-linear" and language_linears is not None and config.freeze_vision_tower:
        targets = language_linears
    exclude = config.lora_exclude
    if exclude is not None:
        _check_module_names_exist(model, exclude, f"--lora_exclude_modules {config.lora_exclude_modules}",
                                  "a regex must match a whole name")
    flags = f"--lora_target_modules {config.lora_target_modules}" + \
        (f" with --lora_exclude_modules {config.lora_exclude_modules}" if exclude is not None else "")
    targets, expert_parameters = expert_lora_targets(model, targets, _linear_names(model, "all-linear"))
    dropout = config.lora_dropout
    if expert_parameters and dropout > 0:
        # LoRA on a fused parameter adds B A to the weight itself, so no dropout can sit before A (peft refuses it)
        logger.warning(f"--lora_dropout {dropout}: LoRA on the fused experts ({', '.join(expert_parameters)}) "
                       "takes no dropout; this run trains without it")
        dropout = 0.0
    if expert_parameters:
        logger.info(f"LoRA on the experts: {', '.join(expert_parameters)} (rank {config.lora_rank} per expert), "
                    f"beside {', '.join(targets) if targets else 'no linear layer'}")
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=dropout,
                      target_modules=targets, target_parameters=expert_parameters, exclude_modules=exclude,
                      task_type="CAUSAL_LM")
    try:
        with peft_asks_old_checkpointing_name():
            policy = get_peft_model(model, lora)
    except ValueError as exc:  # e.g. target modules not found, or every one of them excluded
        raise ConfigError(f"{flags}: {exc}") from exc
    _refuse_fused_expert_adapters(policy, flags, "train with")
    return policy


def _refuse_fused_expert_adapters(policy, flags: str, way_out: str) -> None:
    """LoRA on fused 3-D expert tensors trains, syncs and merges (grpo.sync.expert_adapters); LoRA on another
    parameter (peft's ParamWrapper on a 2-D one: a mixture of experts' router, which peft adapts for an adapter that
    names `gate`) has no sync to vLLM's names: said here, before any training, with the targets that do work."""
    from peft.tuners.lora.layer import ParamWrapper

    others = sorted({name.rsplit(".", 1)[-1] for name, module in policy.named_modules()
                     if isinstance(module, ParamWrapper) and module.get_param().dim() != 3})
    if not others:
        return
    lora = policy.peft_config["default"]
    targets = lora.target_modules or []
    linear = sorted({name.rsplit(".", 1)[-1] for name in ([targets] if isinstance(targets, str) else targets)})
    raise ConfigError(_fused_experts_message(flags, sorted(getattr(lora, "target_parameters", None) or []), linear,
                                             way_out))


def _fused_experts_message(flags: str, fused: list[str], linear: list[str], way_out: str) -> str:
    fix = f"--lora_target_modules {','.join(linear + ['experts'])}" if linear else \
        "--lora_target_modules <attention layers>,experts"
    return (f"{flags}: on this mixture-of-experts model peft adapts parameters ({', '.join(fused)}) of which grpo "
            f"syncs and merges the fused experts only (not the router); {way_out} {fix}")


def _linear_names(model, targets) -> list[str]:
    """The short names of the model's linear layers that `targets` asks for ("all-linear": all but the output
    layer), as peft resolves them once it has built the adapter; peft may have wrapped some already (their
    `base_layer`), its own lora_A / lora_B left out."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    wanted = None if targets == "all-linear" else {t.rsplit(".", 1)[-1] for t in targets}
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not output and ".lora_" not in f".{name}":
            names.add(name.removesuffix(".base_layer").rsplit(".", 1)[-1])
    return sorted(names if wanted is None else names & wanted)


@contextlib.contextmanager
def peft_asks_old_checkpointing_name():
    """peft (0.21) reads `model.is_gradient_checkpointing`, which transformers >= 5.23 deprecates with a FutureWarning
    for `is_activation_checkpointing`: that one warning is peft's to fix, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _check_module_names_exist(model, names, flag: str, hint: str) -> None:
    """Names (or one regex, as a str) that match no module are typos: the flag would silently change nothing
    (peft only warns about an unmatched exclude; bitsandbytes quantizes an unmatched skip after all)."""
    modules = [n for n, _ in model.named_modules() if n]
    if isinstance(names, str):
        missing = [] if any(re.fullmatch(names, n) for n in modules) else [names]
    else:
        missing = [k for k in names if not any(n == k or n.endswith("." + k) for n in modules)]
    if missing:
        example = next((n for n in modules if n.endswith("proj")), modules[-1])
        raise ConfigError(f"{flag}: {', '.join(repr(m) for m in missing)} matches no module of the model (names "
                          f"look like '{example}'; {hint})")


def load_reference(config: GRPOConfig, model_path: str, dtype: torch.dtype,
                   device: torch.device) -> Optional[torch.nn.Module]:
    """A frozen copy of the base model for full fine-tuning with the KL term; otherwise None.

    LoRA / QLoRA need no copy: the reference is the policy with its adapter disabled (see reference_mode).
    """
    if not config.strategy.reference_is_copy or config.kl_beta <= 0:
        return None
    reference = load_base_model(model_path, dtype, device, config.trust_remote_code)
    reference.eval()
    reference.requires_grad_(False)
    return reference


@contextlib.contextmanager
def reference_mode(model):
    """Within the block, a peft model computes as its reference, the policy training started from: its adapter off
    (= the base model), or with --qlora_init loftq only the frozen correction on (see grpo/loftq.py); other models
    are unchanged."""
    from grpo.model.loftq import CORRECTION_ADAPTER, freeze_correction

    if CORRECTION_ADAPTER in getattr(model, "peft_config", {}):
        active = list(model.base_model.active_adapters)
        model.base_model.set_adapter(CORRECTION_ADAPTER)
        try:
            yield model
        finally:
            model.base_model.set_adapter(active)  # the trained adapter trainable again ...
            freeze_correction(model)              # ... and the correction not
    elif hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):
        with model.disable_adapter():
            yield model
    else:
        yield model
