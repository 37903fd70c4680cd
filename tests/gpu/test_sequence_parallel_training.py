"""On 2 GPUs with vLLM colocated: a GRPO run with --sequence_parallel_size 2 (one group of 2 ranks, ZeRO-2, lora) on a
random llama-0.68b (16 heads) trains 2 steps; the group's ranks train on the same completions (each rank's engine
generating its share of every prompt's, --sequence_parallel_rollout share), and the trainer's sharded log-probs match
the engines' about as closely as one GPU's unsharded ones do."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer_setup import ROOT, deepspeed_launcher, gpu_flags, launcher_env, train_rows

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or importlib.util.find_spec("vllm") is None,
    reason="needs 2 GPUs and vLLM")


def _model(folder) -> str:
    path = str(folder / "llama068")
    proc = subprocess.run([sys.executable, "benchmarks/random_model.py", "--out", path], cwd=ROOT,
                          env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return path


def _run(model, out, port: int, gpus: int, *flags: str) -> list[dict]:
    cmd = [*deepspeed_launcher(), *gpu_flags(gpus), "--master_port", str(port), "train_grpo.py",
           "--model_name_or_path", model, "--dataset_names", "arith", "--tuning_strategy", "lora",
           "--per_device_train_batch_size", "4", "--k_samples", "4", "--rollout_max_new_tokens", "64",
           "--max_prompt_length", "128", "--max_seq_length", "192", "--save_steps", "0", "--eval_max_prompts", "8",
           "--seed", "0", "--vllm_enforce_eager", "true", "--max_steps", "2", "--logprob_check_steps", "1",
           "--rollout_engine", "vllm", "--vllm_gpu_memory_utilization", "0.3", "--deepspeed", "zero2",
           "--output_dir", str(out), "--overwrite_output_dir", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    rows = train_rows(out)
    print([{k: round(r[k], 4) for k in ("step", "loss", "reward/mean", "rollout/logprob_diff_mean", "time/step")}
           for r in rows])
    return rows


def _completions(out, rank):
    with open(os.path.join(out, "completions", f"rank{rank}.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def test_one_group_of_two_trains_on_the_rollouts_its_engines_share(tmp_path):
    model = _model(tmp_path)
    one = _run(model, tmp_path / "one", 29571, 1)
    sp = _run(model, tmp_path / "sp", 29573, 2, "--sequence_parallel_size", "2")
    assert [r["step"] for r in sp] == [1, 2]
    # one data-parallel rank either way: the same prompts, one row each per step
    drawn = [[r["index"] for r in _completions(tmp_path / run, 0)] for run in ("sp", "one")]
    assert drawn[0] == drawn[1] and drawn[0]
    assert not os.path.exists(tmp_path / "sp" / "completions" / "rank1.jsonl")  # the group's rows, written once
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in sp)
    # engine vs trainer over the sampled tokens (bf16): the sharded forward scores as the whole one does
    for mine, theirs in zip(sp, one):
        gap, reference = mine["rollout/logprob_diff_mean"], theirs["rollout/logprob_diff_mean"]
        assert gap < 1.5 * reference + 0.01, (mine["step"], gap, reference)
