"""Shared set-up for the end-to-end trainer tests: a tiny model, a tiny prompt set, and a config for both."""
import json
import os
import shutil
import sys

import torch

from grpo.config.options import GRPOConfig
from grpo.train.reporting import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}

PROMPTS = [f"What is {a} + {b} ?" for a in range(1, 9) for b in range(1, 6)]  # 40 prompts


def child_env(**extra) -> dict:
    """This environment for a child process, without the launcher variables of a process group started earlier in
    the test session (the child, or its launcher, sets its own), with this checkout first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return {**env, "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""), **extra}


def deepspeed_launcher() -> list[str]:
    """The command that starts `deepspeed` jobs: the launcher on PATH, else its module."""
    return ["deepspeed"] if shutil.which("deepspeed") else [sys.executable, "-m", "deepspeed.launcher.runner"]


def gpu_flags(count: int) -> list[str]:
    """The DeepSpeed launcher's flags for `count` GPUs: the first `count` that CUDA_VISIBLE_DEVICES names when it is
    set (the launcher ignores that variable once given --num_gpus), else GPUs 0..count-1. Start the launcher with
    `launcher_env`, which hides the variable so that the launcher counts every GPU of the host."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) >= count:
        return ["--include", "localhost:" + ",".join(visible[:count])]
    return ["--num_gpus", str(count)]


def launcher_env(**extra) -> dict:
    """`child_env` for the DeepSpeed launcher given `gpu_flags`: it sets CUDA_VISIBLE_DEVICES for each rank."""
    env = child_env(**extra)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def train_rows(output_dir) -> list[dict]:
    """metrics.jsonl's rows of training steps (not eval rows)."""
    return [r for r in read_metrics(os.path.join(str(output_dir), "metrics.jsonl")) if "loss" in r]


def write_prompt_registry(folder: str, reward: str = "boxed_accuracy") -> str:
    """A registry with one dataset `toy` of 40 arithmetic prompts; returns the registry path."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "toy.jsonl"), "w") as fh:
        for text in PROMPTS:
            a, b = int(text.split()[2]), int(text.split()[4])
            fh.write(json.dumps({"question": text, "answer": str(a + b)}) + "\n")
    registry = os.path.join(folder, "registry.json")
    with open(registry, "w") as fh:
        json.dump({"toy": {"path": "toy.jsonl", "prompt_field": "question", "answer_field": "answer",
                           "rewards": {reward: 1.0}}}, fh)
    return registry


def add_dataset(registry: str, name: str, rows: list[tuple[str, str]], **entry) -> None:
    """Register one more dataset `name` of (question, answer) rows, written beside the registry; `entry` sets its
    rewards (default: boxed_accuracy) and other registry keys."""
    folder = os.path.dirname(registry)
    with open(os.path.join(folder, f"{name}.jsonl"), "w") as fh:
        for question, answer in rows:
            fh.write(json.dumps({"question": question, "answer": answer}) + "\n")
    with open(registry) as fh:
        entries = json.load(fh)
    entries[name] = {"path": f"{name}.jsonl", "prompt_field": "question", "answer_field": "answer",
                     "rewards": {"boxed_accuracy": 1.0}, **entry}
    with open(registry, "w") as fh:
        json.dump(entries, fh)


def tiny_config(model_dir: str, registry: str, output_dir: str, **overrides) -> GRPOConfig:
    values = dict(model_name_or_path=model_dir, dataset_config_path=registry, dataset_names=["toy"],
                  output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=1, k_samples=4,
                  rollout_max_new_tokens=8, max_prompt_length=32, max_seq_length=48, max_steps=2, save_steps=0,
                  eval_steps=0, eval_max_prompts=4, train_split_ratio=0.9, lora_rank=4, lora_alpha=8,
                  lora_dropout=0.0, seed=0, log_to_file=True)
    values.update(overrides)
    values.setdefault("learning_rate", 1e-3 if values.get("tuning_strategy", "lora") == "full" else 1e-2)
    return GRPOConfig(**values)


def deepspeed_adamw_config(path) -> str:
    """A DeepSpeed config (ZeRO-2) that brings its own AdamW optimizer and no scheduler; returns its path."""
    with open(path, "w") as fh:
        json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
                   "optimizer": {"type": "AdamW",
                                 "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}}, fh)
    return str(path)


def even_tokens(completions, answers, completion_ids, **row):
    """A reward that pays the share of even token ids: it differs between the samples of almost every group, so a
    tiny random model gets non-zero advantages and its weights move (a boxed-answer reward gives it none)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def trainable_weights(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters() if p.requires_grad}


def assert_same_weights(got: dict, expected: dict, atol: float = 1e-6) -> None:
    """The same tensor names, each within atol (a resumed run against one that ran straight through)."""
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol, msg=name)


def one_dataset_registry(path, data_file: str, rewards: dict) -> str:
    """A registry file at `path` with one dataset, "mine", of questions "q" and answers "a" in `data_file`."""
    path.write_text(json.dumps({"mine": {"path": data_file, "prompt_field": "q", "answer_field": "a",
                                         "rewards": rewards}}))
    return str(path)

