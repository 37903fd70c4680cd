"""On a GPU with vLLM: train_grpo.py runs a vision-language model with qlora and the engine holding the trainer's own
4-bit base (`--rollout_weights adapter`), prompts with images, for two steps. The engine is built from a folder the
trainer writes, and vLLM reads the model's processor from that folder at the first image prompt, after start-up: the
folder must outlive the engine's start (it did not once, and every such run failed at its first rollout)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer_setup import ROOT, deepspeed_launcher, gpu_flags, launcher_env, train_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs CUDA and vLLM")
HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.environ.get("GRPO_GPU_VL_MODEL", "/tmp/grpo_gpu_vl_model")


def test_qlora_vision_language_run_with_the_engine_on_the_trainers_4bit_base(tmp_path):
    build = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); "
                            f"from vl_sync_check import build_model; build_model({MODEL_DIR!r})"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    out = tmp_path / "out"
    cmd = [*deepspeed_launcher(), *gpu_flags(1), "--master_port", "29591", "train_grpo.py",
           "--model_name_or_path", MODEL_DIR, "--tuning_strategy", "qlora", "--rollout_engine", "vllm",
           "--rollout_weights", "adapter", "--vllm_enforce_eager", "true", "--dataset_names", "shapes",
           "--per_device_train_batch_size", "4", "--k_samples", "4", "--rollout_max_new_tokens", "32",
           "--max_steps", "2", "--logprob_check_steps", "1", "--save_steps", "0", "--eval_on_start", "false",
           "--train_split_ratio", "1.0", "--seed", "0", "--output_dir", str(out), "--overwrite_output_dir"]
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), capture_output=True,
                          text=True, timeout=900)
    log = (out / "train.log").read_text() if (out / "train.log").exists() else ""
    assert proc.returncode == 0, log[-6000:] + proc.stderr[-4000:]
    assert "takes the adapter at each sync" in log and "held once" in log, log[-4000:]
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2], rows
    # the engine scored the sampled tokens like the trainer (a stale or wrong base is several nats away)
    assert all(r["rollout/logprob_diff_mean"] < 0.1 for r in rows), rows
