"""DeepSpeed config files: read the shipped or the user's JSON and fill its "auto" values from GRPOConfig."""
from __future__ import annotations

from typing import Any

from grpo.config.options import GRPOConfig
from grpo.errors import ConfigError
from grpo.config.json_files import read_json_object
from grpo.config.shipped import resolve_shipped_file



def resolve_deepspeed_path(name_or_path: str) -> str:
    """'zero2' / 'zero3' name the shipped files; anything else is a path (a relative configs/ path missing from
    the current folder is the shipped file of that name)."""
    return resolve_shipped_file(name_or_path, "deepspeed")


def load_deepspeed_config(config: GRPOConfig, use_bf16: bool) -> dict[str, Any]:
    """The DeepSpeed config dict with every "auto" value replaced.

    One DeepSpeed micro-batch is per_device_train_batch_size prompts x k_samples completions.
    """
    path = resolve_deepspeed_path(config.deepspeed)
    ds = read_json_object(path, ConfigError, "--deepspeed")
    auto = {
        "train_micro_batch_size_per_gpu": config.per_device_train_batch_size * config.k_samples,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "gradient_clipping": config.max_grad_norm,
        "bf16.enabled": use_bf16,
        "fp16.enabled": False,
        "optimizer.params.lr": config.learning_rate,
        "optimizer.params.weight_decay": config.weight_decay,
    }
    _fill_auto(ds, auto)
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world size
    unresolved = _find_auto(ds)
    if unresolved:
        raise ConfigError(f"--deepspeed: {path} has \"auto\" values grpo cannot fill: {', '.join(unresolved)}")
    return ds


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def zero3_partitioned(module) -> bool:
    """Whether ZeRO-3 holds `module`'s parameters as partitions (DeepSpeed tags each with a ds_id)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _fill_auto(node: dict, auto: dict, prefix: str = "") -> None:
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            _fill_auto(value, auto, dotted + ".")
        elif value == "auto" and dotted in auto:
            node[key] = auto[dotted]


def _find_auto(node: dict, prefix: str = "") -> list[str]:
    found = []
    for key, value in node.items():
        if isinstance(value, dict):
            found += _find_auto(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(prefix + key)
    return found


def default_dtype():
    """bf16 on GPU, fp32 on CPU (bf16 matmuls are far slower than fp32 on most CPUs)."""
    import torch

    return torch.bfloat16 if torch.cuda.is_available() else torch.float32
