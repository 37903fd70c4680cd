"""The 16-bit weights of a model's checkpoint, read one tensor at a time from its safetensors (or PyTorch .bin) files.

QLoRA loads the base in 4 bits; what that rounding loses is only in the checkpoint. `--qlora_block_size` and
`--qlora_block_scale` (by default blocks of 32 with searched scales) quantize again from it, `--qlora_init loftq`
corrects towards it.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from grpo.config.options import STOCK_4BIT_OPTIONS
from grpo.errors import ConfigError


def saved_4bit(model_path: str) -> Optional[dict]:
    """The quantization_config of a checkpoint saved in 4 bits by bitsandbytes (e.g. a *-bnb-4bit repository, or a
    qlora base written by grpo.model.quantized_checkpoint), else None."""
    folder = local_snapshot(model_path)
    config_file = os.path.join(folder, "config.json") if folder else ""
    if not os.path.isfile(config_file):
        return None
    try:
        with open(config_file) as fh:
            quantization = json.load(fh).get("quantization_config")
    except (OSError, ValueError):
        return None  # transformers says what is wrong with it when it loads the model
    if isinstance(quantization, dict) and quantization.get("quant_method") == "bitsandbytes" \
            and quantization.get("load_in_4bit"):
        return quantization
    return None


def check_checkpoint_weights(config, model_path: str) -> None:
    """Fail before any model loads when an option that reads the checkpoint's 16-bit weights will find none in a
    local folder (a hub id is checked once transformers has fetched it). A checkpoint saved in 4 bits trains with
    qlora only, on its 4-bit base as it is (nothing to quantize again: the 16-bit weights are not there)."""
    if saved_4bit(model_path):
        if not config.strategy.four_bit_base:
            raise ConfigError(f"{model_path} is saved in 4 bits (bitsandbytes): train it with --tuning_strategy "
                              f"qlora, or use the 16-bit model it was made from for {config.tuning_strategy}")
        if config.save_merged_model:
            raise ConfigError(f"--save_merged_model merges the adapter into the 16-bit base, and {model_path} is "
                              "saved in 4 bits: drop --save_merged_model (lora_adapter/ on this base is the policy)")
        if config.qlora_init == "loftq":
            raise ConfigError(f"--qlora_init loftq corrects the 4-bit rounding towards the 16-bit weights, which "
                              f"{model_path} (saved in 4 bits) does not have: run without --qlora_init loftq")
        return
    readers = list(config.qlora_requantizing_options)
    if config.qlora_init == "loftq":
        readers.append("--qlora_init loftq")
    if readers and os.path.isdir(model_path):
        checkpoint_tensors(model_path, " and ".join(readers))


def how_to_skip_reading(option: str) -> str:
    """What to pass so that nothing reads the checkpoint, for an error about `option` (one option or several,
    joined by " and ")."""
    steps = []
    if "--qlora_block" in option:
        steps.append(f"pass {STOCK_4BIT_OPTIONS} for bitsandbytes' stock 4-bit base")
    if "--qlora_init loftq" in option:
        steps.append("run without --qlora_init loftq")
    return " and ".join(steps) or f"run without {option}"


def local_snapshot(model_path: str) -> Optional[str]:
    """A folder as it is; a hub id as its snapshot folder in the local Hugging Face cache (transformers put it there
    when it loaded the model; nothing is downloaded here); None when there is none."""
    if os.path.isdir(model_path):
        return model_path
    try:
        from huggingface_hub import hf_hub_download

        # one file, not snapshot_download: that refuses a snapshot with any listed file never fetched
        return os.path.dirname(hf_hub_download(model_path, "config.json", local_files_only=True))
    except Exception:  # noqa: BLE001 -- not cached, or not a hub id at all
        return None


def local_checkpoint_folder(model_path: str, option: str) -> str:
    folder = local_snapshot(model_path)
    if folder is None:
        raise ConfigError(f"{option} reads the 16-bit weights from the checkpoint's files; found no local copy of "
                          f"{model_path!r} in the Hugging Face cache. Pass the model's folder as "
                          f"--model_name_or_path, or {how_to_skip_reading(option)}")
    return folder


# what transformers loads a checkpoint from, in its order of preference: an index of shards, or one file
CHECKPOINT_FILES = (("model.safetensors.index.json", "model.safetensors"),
                    ("pytorch_model.bin.index.json", "pytorch_model.bin"))


def checkpoint_tensors(model_path: str, option: str) -> dict[str, str]:
    """Checkpoint weight name -> the file that holds it: the safetensors files, else the PyTorch .bin ones."""
    folder = local_checkpoint_folder(model_path, option)
    _refuse_quantized(folder, option)
    for index_name, single in CHECKPOINT_FILES:
        index = os.path.join(folder, index_name)
        if os.path.isfile(index):
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
            return {name: os.path.join(folder, file) for name, file in weight_map.items()}
        if os.path.isfile(os.path.join(folder, single)):
            file = os.path.join(folder, single)
            return {name: file for name in _tensor_names(file)}
    raise ConfigError(f"{option} reads the 16-bit weights from the checkpoint's model.safetensors (or "
                      f"pytorch_model.bin) files; {folder} has none: save the model with save_pretrained, or "
                      f"{how_to_skip_reading(option)}")


def _refuse_quantized(folder: str, option: str) -> None:
    """A checkpoint saved already quantized (e.g. a *-bnb-4bit repository) holds no 16-bit weights to read."""
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        return
    try:
        with open(config_file) as fh:
            quantization = json.load(fh).get("quantization_config")
    except (OSError, ValueError):
        return  # transformers says what is wrong with it when it loads the model
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ConfigError(f"{option} reads the checkpoint's 16-bit weights, but {folder} is saved already quantized "
                          f"({method}); use the 16-bit model it was made from, or {how_to_skip_reading(option)}")


def _tensor_names(file: str) -> list[str]:
    return list(_open(file).keys())


def _open(file: str):
    """The open safetensors file, or the .bin state dict: either has keys(); a tensor is read from it only when used."""
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        return safe_open(file, framework="pt")
    return _load_bin(file)


def _load_bin(file: str) -> dict[str, torch.Tensor]:
    try:  # memory-mapped: a tensor is read from disk only when used
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as mapped_error:  # noqa: BLE001 -- torch raises several kinds for an unreadable file
        try:  # torch's legacy (pre-zip) format cannot be mapped: read whole
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001
            raise ConfigError(f"cannot read the checkpoint file {file}: {mapped_error}") from mapped_error


class CheckpointWeights:
    """`with CheckpointWeights(path, "--option") as weights: weights.read(name, layer_name, layer)`: each file is
    opened once."""

    def __init__(self, model_path: str, option: str):
        self.model_path, self.option = model_path, option
        self.files = checkpoint_tensors(model_path, option)
        self.handles = {}

    def read(self, name: str, layer_name: str, layer) -> torch.Tensor:
        """The checkpoint's weight for a linear (or 4-bit) `layer`, as [out, in] like the layer's own weight."""
        if name not in self.files:
            raise ConfigError(f"{self.option}: the checkpoint in {self.model_path} has no weight {name!r} for layer "
                              f"{layer_name}; {how_to_skip_reading(self.option)}")
        weight = self._tensor(name)
        from transformers.pytorch_utils import Conv1D

        if issubclass(getattr(layer, "source_cls", torch.nn.Linear), Conv1D):
            weight = weight.t()  # GPT-2-style checkpoints store [in, out]; transformers transposed it on loading
        state = getattr(layer.weight, "quant_state", None)
        expected = tuple(state.shape) if state is not None else tuple(layer.weight.shape)
        if tuple(weight.shape) != expected:
            raise ConfigError(f"{self.option}: the checkpoint's {name!r} has shape {tuple(weight.shape)}, layer "
                              f"{layer_name} {expected}; {how_to_skip_reading(self.option)}")
        return weight

    def _tensor(self, name: str) -> torch.Tensor:
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = _open(file)
        handle = self.handles[file]
        return handle[name] if isinstance(handle, dict) else handle.get_tensor(name)

    def __enter__(self) -> "CheckpointWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.handles.clear()
