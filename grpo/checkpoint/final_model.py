"""The final model, saved in Hugging Face format: the full model, or the LoRA adapter (plus the merged model on
request), each with the tokenizer and a vision-language model's processor files, loadable by transformers and
vLLM."""
from __future__ import annotations

import logging
import os
import shutil
from typing import Optional

import torch

from grpo.checkpoint.model_card import write_model_card
from grpo.checkpoint.vllm_adapter import has_expert_adapters, write_vllm_adapter
from grpo.config.options import GRPOConfig
from grpo.model.loading import load_base_model, peft_asks_old_checkpointing_name
from grpo.model.qlora_base_record import write_base_options

logger = logging.getLogger("grpo")


def save_final_model(model, tokenizer, output_dir: str, config: GRPOConfig, model_path: str, dtype: torch.dtype,
                     state_dict: Optional[dict] = None, steps: int = 0) -> dict[str, str]:
    """Save in HF format: output_dir/model (full) or output_dir/lora_adapter (+ merged_model on request), each with
    a README.md saying what it was trained from and how to load it (`steps`: the run's optimizer steps).

    `state_dict` supplies gathered parameters when DeepSpeed ZeRO-3 holds them partitioned.
    """
    saved = {}
    if not config.uses_lora:
        path = os.path.join(output_dir, "model")
        model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(path)
        _copy_processor_files(model_path, path)
        write_model_card(path, config, model_path, steps, "model")
        return {"model": path}
    path = os.path.join(output_dir, "lora_adapter")
    model.peft_config["default"].base_model_name_or_path = model_path
    from grpo.model.loftq import CORRECTION_ADAPTER, save_combined_adapter

    if CORRECTION_ADAPTER in model.peft_config:  # one plain adapter: trained + rounding correction
        save_combined_adapter(model, path, state_dict)
    else:
        model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        if has_expert_adapters(model):  # LoRA on fused experts: also the per-expert form vLLM loads
            if state_dict is None:
                write_vllm_adapter(model, path, model_path)
            else:  # (its partitioned factors are gathered into state_dict alone)
                logger.warning("with ZeRO-3 the adapter is saved as peft writes it only: the per-expert form vLLM "
                               "loads (lora_adapter/vllm) is written from unpartitioned weights")
    tokenizer.save_pretrained(path)
    _copy_processor_files(model_path, path)
    if config.strategy.four_bit_base:
        write_base_options(path, config)
    write_model_card(path, config, model_path, steps, "lora_adapter")
    saved["lora_adapter"] = path
    if config.save_merged_model:
        from peft import PeftModel

        # merge into the full-precision base (for qlora too): the training model itself is never merged
        base = load_base_model(model_path, dtype, torch.device("cpu"), config.trust_remote_code)
        if config.qlora_init == "loftq":  # its adapter holds the 4-bit rounding error: merge into the rounded base
            from grpo.model.loftq import round_like_training

            round_like_training(base, model)
        with peft_asks_old_checkpointing_name():
            merged = PeftModel.from_pretrained(base, path).merge_and_unload()
        merged_path = os.path.join(output_dir, "merged_model")
        merged.save_pretrained(merged_path, safe_serialization=True)
        tokenizer.save_pretrained(merged_path)
        _copy_processor_files(model_path, merged_path)
        write_model_card(merged_path, config, model_path, steps, "merged_model")
        saved["merged_model"] = merged_path
    return saved


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json", "chat_template.jinja",
                   "video_preprocessor_config.json")


def _copy_processor_files(model_path: str, out: str) -> None:
    """A vision-language model's processor files go with the saved weights (no-op for text models)."""
    for name in PROCESSOR_FILES:
        source = os.path.join(model_path, name)
        if os.path.isfile(source) and not os.path.exists(os.path.join(out, name)):
            shutil.copy(source, os.path.join(out, name))
