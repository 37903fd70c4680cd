"""The trainer's own 4-bit base, written as a pre-quantized bitsandbytes checkpoint folder.

A rollout engine that takes the adapter (--rollout_weights adapter) loads the base from this folder, so it samples
from the very 4-bit weights the trainer holds (blocks of --qlora_block_size, scales chosen by --qlora_block_scale)
instead of a 16-bit copy: about 0.56 bytes per weight instead of 2. The layout is the one transformers writes for a
bitsandbytes model and vLLM's bitsandbytes loader reads:

    <module>.weight                                  packed 4-bit codes, uint8
    <module>.weight.absmax / .quant_map / .nested_absmax / .nested_quant_map
    <module>.weight.quant_state.bitsandbytes__nf4    block size, shape and dtype, packed
    every other tensor (embeddings, norms, the output layer, a vision tower) in the engine's dtype
    config.json with a quantization_config naming the layers left unquantized
    the source folder's other files (tokenizer, image processor, chat template), which vLLM reads from the folder

Tensor names are the checkpoint's (a vision-language model's as save_pretrained writes them: model.layers.*, visual.*,
lm_head.*), which vLLM's model maps as it maps its released checkpoint's (its hf_to_vllm_mapper, which its
bitsandbytes loader applies to the 4-bit state's names too).
"""
from __future__ import annotations

import copy
import json
import logging
import os

import torch

from grpo.errors import ConfigError
from grpo.model.layer_weights import checkpoint_name, is_4bit

logger = logging.getLogger("grpo")
SHARD_BYTES = 2 * 2**30  # bounded CPU memory while writing (a 32B base is ~18 GB)


def iter_4bit_state(policy, dtype: torch.dtype):
    """(checkpoint name, CPU tensor) for every tensor of the base: 4-bit weights with their quantization state,
    the rest in `dtype`. LoRA's own parameters are not part of the base."""
    from grpo.model.vision import checkpoint_prefixes, rename

    prefixes = checkpoint_prefixes(policy)
    for name, param in policy.named_parameters():
        if "lora_" in name:
            continue
        name = rename(checkpoint_name(name), prefixes)
        if is_4bit(param):
            yield name, param.data.detach().cpu()
            for key, value in param.quant_state.as_dict(packed=True).items():
                yield f"{name}.{key}", value.detach().cpu()
        else:
            yield name, param.data.detach().to("cpu", dtype)


def unquantized_linears(policy) -> list[str]:
    """Names of the linear layers kept in 16 bits (the output layer, --qlora_skip_modules), as the checkpoint's
    llm_int8_skip_modules: a loader then does not expect 4-bit state for them. A vision-language model's tower is
    named as a whole (grpo.model.vision.vision_skip_modules): its layers' own names (gate_proj, ...) are the language
    model's too, which a loader would then leave unquantized as well."""
    from grpo.model.vision import vision_skip_modules, vision_tower_names

    towers = tuple(checkpoint_name(name) + "." for name in vision_tower_names(policy))
    names = set()
    for module_name, module in policy.named_modules():
        name = checkpoint_name(module_name)
        if (isinstance(module, torch.nn.Linear) and "lora_" not in module_name and not is_4bit(module.weight)
                and not (towers and (name + ".").startswith(towers))):
            names.add(name.split(".")[-1])
    return sorted(names) + vision_skip_modules(policy)


# what a model folder holds beside its weights and config.json that a rollout engine reads: the tokenizer, a
# vision-language model's processor and chat template, the generation config
WEIGHT_FILE_ENDINGS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt",
                       ".safetensors.index.json", ".bin.index.json")


def copy_model_files(source: str, out_dir: str) -> list[str]:
    """Copy the files of the model folder `source` (a hub id: its local snapshot) other than its weights and
    config.json into `out_dir`, so that an engine reading `out_dir` finds the tokenizer and processor it would find
    in `source` (vLLM builds a vision-language model's processor from the model folder). Returns the names copied."""
    import shutil

    from grpo.model.base_weights import local_snapshot

    folder = local_snapshot(source)
    if folder is None:
        return []
    copied = []
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if entry == "config.json" or entry.endswith(WEIGHT_FILE_ENDINGS) or not os.path.isfile(path):
            continue
        shutil.copyfile(path, os.path.join(out_dir, entry))
        copied.append(entry)
    return copied


def bitsandbytes_4bit_config(quant_type: str, nested: bool, dtype: torch.dtype, unquantized: list[str]) -> dict:
    """The quantization_config of a pre-quantized bitsandbytes 4-bit checkpoint (transformers' and vLLM's reading)."""
    return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": nested,
            "bnb_4bit_compute_dtype": str(dtype).removeprefix("torch."), "bnb_4bit_quant_storage": "uint8",
            "llm_int8_skip_modules": unquantized}


def write_safetensors_shards(named_tensors, out_dir: str) -> int:
    """Write (name, CPU tensor) pairs as model-0000N.safetensors files of about SHARD_BYTES plus their index, holding
    one shard in memory at a time; returns the bytes written."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    shard, shard_bytes, weight_map, total = {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, os.path.join(out_dir, file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        shard, shard_bytes = {}, 0

    for name, tensor in named_tensors:
        shard[name] = tensor.contiguous()
        size = tensor.numel() * tensor.element_size()
        shard_bytes += size
        total += size
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def write_4bit_checkpoint(policy, out_dir: str, dtype: torch.dtype = torch.bfloat16, source: str | None = None) -> int:
    """Write the policy's 4-bit base to `out_dir` (module docstring); returns the bytes written. `source`: the model
    folder (or hub id) the policy was loaded from, whose tokenizer and processor files go beside it."""
    quantized = [m for m in policy.modules() if is_4bit(getattr(m, "weight", None))]
    if not quantized:
        raise ConfigError("no 4-bit layer to write: the policy was not loaded with --tuning_strategy qlora")
    state = quantized[0].weight.quant_state
    total = write_safetensors_shards(iter_4bit_state(policy, dtype), out_dir)
    config = copy.deepcopy(policy.config)  # peft hands on the base model's
    config.quantization_config = bitsandbytes_4bit_config(state.quant_type, state.nested, dtype,
                                                          unquantized_linears(policy))
    config.dtype = dtype
    config.save_pretrained(out_dir)
    if source is not None:
        copy_model_files(source, out_dir)
    logger.info(f"4-bit base for the rollout engine: {total / 2**30:.2f} GiB in {out_dir} (blocks of "
                f"{state.blocksize}, {state.quant_type})")
    return total
