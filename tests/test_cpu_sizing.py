"""A run on a CPU is sized for a CPU: train_grpo.py gives the options it was not given the values of
grpo/config/cpu_sizing.py (run_grpo.sh's CPU values, read from there), says so in one line, and keeps every option
given; a resume keeps its run's options; a GRPOConfig built in Python keeps its values and hears which are a GPU's."""
import json
import os
import subprocess
import sys

import pytest
import torch

from grpo.config import GRPOConfig, parse_args
from grpo.config.cpu_sizing import CPU_VALUES, SHELL_VARIABLES, size_for_cpu

from .trainer_setup import ROOT, child_env


def sized(args, on_cpu=True):
    config = parse_args(args)
    return config, size_for_cpu(config, on_cpu=on_cpu)


def test_options_not_given_take_the_cpu_values_and_one_line_names_them(grpo_log):
    config, values = sized(["--max_steps", "3", "--rollout_max_new_tokens", "64"])
    assert values == {k: v for k, v in CPU_VALUES.items() if k not in ("max_steps", "rollout_max_new_tokens")}
    assert (config.max_steps, config.rollout_max_new_tokens) == (3, 64)  # given: they win
    assert (config.per_device_train_batch_size, config.learning_rate, config.eval_max_prompts, config.save_steps) \
        == (4, 6e-4, 32, 7)
    lines = [line for line in grpo_log if line.startswith("on a CPU")]
    assert lines == ["on a CPU: --per_device_train_batch_size 4 --learning_rate 0.0006 --eval_max_prompts 32 "
                     "--save_steps 7 (sized for minutes, not hours, on a few cores; the defaults are a GPU's); give "
                     "any of these flags to choose another value"]
    assert size_for_cpu(config, on_cpu=True) == {}  # once (the training and the rollout ranks both ask)


def test_a_gpu_keeps_the_defaults():
    config, values = sized([], on_cpu=False)
    assert values == {} and (config.max_steps, config.per_device_train_batch_size,
                             config.rollout_max_new_tokens, config.eval_max_prompts) == (-1, 2, 256, 64)


def test_values_from_a_config_file_a_guide_spelling_or_epochs_count_as_given(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 2, "eval_max_prompts": 64}))
    config, values = sized(["--config", str(path), "--learning_rate_lora", "1e-4", "--epochs", "2"])
    assert set(values) == {"rollout_max_new_tokens", "save_steps"}
    assert (config.per_device_train_batch_size, config.eval_max_prompts, config.learning_rate, config.max_steps,
            config.epochs) == (2, 64, 1e-4, -1, 2)


def test_full_fine_tuning_keeps_its_learning_rate_and_the_sequence_length_follows():
    config, values = sized(["--tuning_strategy", "full", "--max_prompt_length", "1000"])
    assert "learning_rate" not in values and config.learning_rate == 1e-6
    assert config.max_seq_length == 1040  # --max_prompt_length + the CPU's 40 new tokens, as derived at parse time


def test_a_resume_keeps_its_runs_options(tmp_path):
    config, values = sized(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])
    assert values == {} and config.per_device_train_batch_size == 2


def test_a_config_built_in_python_is_kept_and_told_what_a_cpu_run_takes(grpo_log):
    config = GRPOConfig(max_steps=5, per_device_train_batch_size=4)
    assert size_for_cpu(config, on_cpu=True) == {}
    assert (config.rollout_max_new_tokens, config.eval_max_prompts) == (256, 64)
    hint, = [line for line in grpo_log if line.startswith("on a CPU")]
    assert "rollout_max_new_tokens=256, eval_max_prompts=64" in hint and "rollout_max_new_tokens=40" in hint
    grpo_log.clear()
    size_for_cpu(GRPOConfig(max_steps=5, rollout_max_new_tokens=40, eval_max_prompts=8), on_cpu=True)
    assert not grpo_log  # sized already: nothing to say


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's values apply on a CPU")
def test_train_grpo_on_a_cpu_runs_with_the_cpu_values(tiny_model, registry, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train_grpo.py"), "--model_name_or_path", tiny_model,
         "--dataset_config_path", registry, "--dataset_names", "toy", "--output_dir", str(out), "--max_steps", "1",
         "--k_samples", "2", "--max_prompt_length", "32", "--eval_on_start", "false", "--lora_rank", "4",
         "--lora_alpha", "8"], capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    options = json.loads((out / "grpo_config.json").read_text())
    assert {k: options[k] for k in CPU_VALUES} == {**CPU_VALUES, "max_steps": 1}
    line = "on a CPU: --per_device_train_batch_size 4 --rollout_max_new_tokens 40 --learning_rate 0.0006"
    assert line in proc.stderr and line in (out / "train.log").read_text()
    assert "1 step of 4 prompts x 2 samples per rank" in proc.stderr


FAKE_PYTHON = """#!/bin/sh
# the launcher's python: train_grpo.py's arguments are printed as JSON instead of training
if [ "$1" = train_grpo.py ]; then
  shift
  exec "{python}" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@"
fi
exec "{python}" "$@"
"""


def test_run_grpo_sh_passes_the_same_cpu_values(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    no_gpu = tmp_path / "bin"
    no_gpu.mkdir()
    (no_gpu / "nvidia-smi").write_text("#!/bin/sh\nexit 1\n")  # a CPU machine, even on a GPU host
    (no_gpu / "nvidia-smi").chmod(0o755)
    env = child_env(PYTHON=str(fake), PATH=f"{no_gpu}{os.pathsep}{os.environ['PATH']}", OUTPUT_DIR=str(tmp_path / "o"))
    for name in SHELL_VARIABLES.values():  # none given: the script's own values
        env.pop(name, None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "run_grpo.sh")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    args = json.loads(proc.stdout.strip().splitlines()[-1])
    passed = {args[i][2:]: args[i + 1] for i in range(0, len(args) - 1) if args[i].startswith("--")}
    for key in SHELL_VARIABLES:
        assert float(passed[key]) == CPU_VALUES[key], key
    assert passed["eval_max_prompts"] == str(CPU_VALUES["eval_max_prompts"])
