"""The 16-bit weights of a model's checkpoint, read one tensor at a time from its safetensors files.

QLoRA loads the base in 4 bits; what that rounding loses is only in the checkpoint. `--qlora_block_size` quantizes
again from it, `--qlora_init loftq` corrects towards it.
"""
from __future__ import annotations

import glob
import json
import os

import torch

from .errors import ConfigError


def check_checkpoint_weights(config, model_path: str) -> None:
    """Fail before any model loads when an option that reads the checkpoint's 16-bit weights will find none in a
    local folder (a hub id is checked once transformers has fetched it)."""
    readers = [option for option, on in ((f"--qlora_block_size {config.qlora_block_size}",
                                          config.tuning_strategy == "qlora" and config.qlora_block_size != 64),
                                         ("--qlora_init loftq", config.qlora_init == "loftq")) if on]
    if readers and os.path.isdir(model_path):
        checkpoint_tensors(model_path, " and ".join(readers))


def local_checkpoint_folder(model_path: str, option: str) -> str:
    """The folder holding the checkpoint's files: `model_path` itself, or a hub id's copy in the local hub cache
    (transformers put it there when it loaded the model; nothing is downloaded here)."""
    if os.path.isdir(model_path):
        return model_path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_path, local_files_only=True, allow_patterns=["*.safetensors", "*.json"])
    except Exception as error:  # not cached, or not a hub id at all
        raise ConfigError(f"{option} reads the 16-bit weights from the checkpoint's .safetensors files; found no "
                          f"local copy of {model_path!r} ({type(error).__name__}). Pass the model's folder as "
                          f"--model_name_or_path") from error


def checkpoint_tensors(model_path: str, option: str) -> dict[str, str]:
    """Checkpoint weight name -> the safetensors file that holds it."""
    folder = local_checkpoint_folder(model_path, option)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ConfigError(f"{option} reads the 16-bit weights from the checkpoint's .safetensors files; {folder} has "
                          f"none (convert the checkpoint with save_pretrained(safe_serialization=True))")
    from safetensors import safe_open

    found = {}
    for file in files:
        with safe_open(file, framework="pt") as fh:
            found.update({name: file for name in fh.keys()})
    return found


class CheckpointWeights:
    """`with CheckpointWeights(path, "--option") as weights: weights.read(name)`: each file opened once."""

    def __init__(self, model_path: str, option: str):
        self.model_path, self.option = model_path, option
        self.files = checkpoint_tensors(model_path, option)
        self.handles = {}

    def read(self, name: str, for_layer: str) -> torch.Tensor:
        if name not in self.files:
            raise ConfigError(f"{self.option}: the checkpoint in {self.model_path} has no weight {name!r} for layer "
                              f"{for_layer}")
        file = self.files[name]
        if file not in self.handles:
            from safetensors import safe_open

            self.handles[file] = safe_open(file, framework="pt")
        return self.handles[file].get_tensor(name)

    def __enter__(self) -> "CheckpointWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.handles.clear()
