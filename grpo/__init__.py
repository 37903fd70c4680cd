"""grpo: GRPO fine-tuning of causal LMs with verifiable rewards.

Heavy parts (torch, DeepSpeed, transformers) load on first use, so `import grpo` and the CLI's
error paths stay fast.
"""
from grpo.runtime.cpu_threads import wait_passively

wait_passively()  # before torch loads: a CPU shared with other work slows a run in proportion, not a hundredfold

from grpo.config import GRPOConfig, parse_args  # noqa: E402
from grpo.errors import ConfigError, DatasetError, GRPOError, RewardError, TrainingError  # noqa: E402

__all__ = [
    "GRPOConfig", "GRPOTrainer", "parse_args", "register_reward", "register_tool", "load_dataset_registry",
    "serve_rollouts", "GRPOError", "ConfigError", "DatasetError", "RewardError", "TrainingError",
]
__version__ = "0.1.0"

_LAZY = {
    "GRPOTrainer": ("grpo.train.trainer", "GRPOTrainer"),
    "register_reward": ("grpo.rewards", "register_reward"),
    "register_tool": ("grpo.tools", "register_tool"),
    "load_dataset_registry": ("grpo.data", "load_dataset_registry"),
    "serve_rollouts": ("grpo.entry.serve", "serve_rollouts"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
