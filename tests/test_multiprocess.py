"""Two DeepSpeed ranks on CPU (gloo), launched as a user would: `deepspeed --num_gpus 2 train_grpo.py ...`."""
import json
import os
import shutil
import subprocess

import pytest

from grpo.reporting import read_metrics

from .tiny_models import make_tiny_model_dir
from .trainer_setup import write_prompt_registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD_MODULE = '''
from grpo import register_reward

@register_reward("says_seven")
def says_seven(completions, answers, **row):
    return [c.split().count("7") / max(len(c.split()), 1) for c in completions]
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mp")
    model = make_tiny_model_dir(str(folder / "model"))
    registry = write_prompt_registry(str(folder / "data"), reward="says_seven")
    (folder / "rewards.py").write_text(REWARD_MODULE)
    return folder, model, registry


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
@pytest.mark.parametrize("zero, strategy", [("zero2", "full"), ("zero3", "lora")])
def test_two_ranks(zero, strategy, setup):
    folder, model, registry = setup
    out = folder / f"out_{zero}"
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(29500 + (7 if zero == "zero3" else 3)),
           os.path.join(ROOT, "train_grpo.py"), "--model_name_or_path", model, "--dataset_config_path", registry,
           "--dataset_names", "toy", "--reward_module", str(folder / "rewards.py"), "--output_dir", str(out),
           "--tuning_strategy", strategy, "--deepspeed", zero, "--max_steps", "2", "--k_samples", "4",
           "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
           "--rollout_max_new_tokens", "8", "--max_prompt_length", "32", "--max_seq_length", "48",
           "--learning_rate", "1e-3", "--save_steps", "2", "--eval_max_prompts", "4"]
    launcher_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}  # the launcher sets its own
    env = {**{k: v for k, v in os.environ.items() if k not in launcher_vars},
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 rank(s)" in proc.stderr + proc.stdout
    rows = [r for r in read_metrics(str(out / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # every rank trained on its own prompts: 2 steps x 4 prompts each, no prompt on both ranks
    seen = {}
    for rank in (0, 1):
        with open(out / "completions" / f"rank{rank}.jsonl") as fh:
            seen[rank] = [json.loads(line)["index"] for line in fh]
        assert len(seen[rank]) == 2 * 4
    assert not set(seen[0]) & set(seen[1])
    assert os.path.isdir(out / "checkpoint-2" / "engine")
    final = out / ("model" if strategy == "full" else "lora_adapter")
    assert os.path.isfile(final / ("model.safetensors" if strategy == "full" else "adapter_model.safetensors"))
