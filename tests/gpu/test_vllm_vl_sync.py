"""On a GPU with vLLM: weight sync is exact for a Qwen2.5-VL-shaped model (full / lora / qlora) on a prompt with an
image, vLLM expands the image to the same tokens as grpo's renderer, and a stale engine is clearly off. Each case
runs tests/gpu/vl_sync_check.py in its own process."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs CUDA and vLLM")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# mean |log-prob difference|, both bf16; vLLM's image processor may resize slightly differently. The qlora policy after
# step 2 is the touchiest: 0.034 with the weights kept over sleep (level 1), 0.017 and 0.041 dropped and re-sent
# (level 2), in three runs on one H100; a stale engine is 1.9 or more off.
SYNCED_MAX = 0.05


LAYERS = 12  # of the check's language model; LoRA's 7 linears in each
ADAPTER_SYNC_MIB = 64  # the adapter alone (rank 16): a sync that sends more is sending the base


def run_check(tmp_path, *args: str) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1"}
    env.pop("MASTER_PORT", None)
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "vl_sync_check.py"), *args, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    print(json.dumps(result))
    return result


@pytest.mark.parametrize("strategy", ["full", "lora", "qlora"])
def test_vl_sync_is_exact(strategy, tmp_path):
    check_sync(run_check(tmp_path, "--strategy", strategy))


@pytest.mark.parametrize("strategy", ["lora", "qlora"])
def test_vl_sync_is_exact_adapter_mode(strategy, tmp_path):
    """VL sync test, adapter mode: vLLM holds one copy of the base (qlora: the trainer's 4-bit base, its vision tower
    in 16 bits), shared with the trainer, and takes the adapter through its LoRA on the language model at each
    sync; it scores like the trained policy after every step."""
    result = run_check(tmp_path, "--strategy", strategy, "--rollout_weights", "adapter")
    steps = [r for r in result["rows"] if "synced" in r]
    # the engine started from the trainer's own base: right before any sync (lora_B = 0)
    assert steps[0]["never_synced"] < SYNCED_MAX, steps[0]
    assert all(row["sync_tensors"] == 2 * 7 * LAYERS and row["sync_mib"] < ADAPTER_SYNC_MIB for row in steps), steps
    shared = steps[0]["shared_base"]  # one copy of the base: every frozen tensor a view of the engine's
    assert shared and shared["kept_tensors"] == 0 and shared["parked_tensors"] == shared["shared_tensors"], shared
    assert shared["base_on_gpu"], shared
    check_sync(result)


def check_sync(result: dict) -> None:
    steps = [r for r in result["rows"] if "synced" in r]
    assert steps[0]["image_tokens_match"], steps[0]
    assert steps[0]["synced"] < SYNCED_MAX, steps[0]
    for row in steps[1:]:
        assert row["synced"] < SYNCED_MAX, row
        assert row["stale"] > max(0.05, 3 * row["synced"]), row
        assert row["never_synced"] > max(0.05, 3 * row["synced"]), row
    generated = result["rows"][-1]
    assert generated["completions"] == 8 and generated["no_placeholder_sampled"] and generated["finite_logprobs"]
