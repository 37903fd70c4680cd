"""On a GPU with vLLM: after every training step the synced engine samples from the trained policy."""
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


@pytest.mark.parametrize("strategy, zero", [("full", 2), ("lora", 2), ("qlora", 2), ("full", 3)])
def test_sync_is_exact_and_sleep_frees_memory(strategy, zero, tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + zero * 10 + len(strategy))}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sync_check.py"), "--strategy", strategy, "--zero",
                           str(zero), "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(json.dumps(result))
    rows = [r for r in result["rows"] if "synced" in r]
    assert rows[0]["synced"] < 0.02  # the first sync (qlora: dequantized base) matches the policy
    for row in rows[1:]:
        assert row["synced"] < 0.02, row
        assert row["stale"] > max(0.05, 3 * row["synced"]), row  # an engine left unsynced is clearly off
        assert row["sleep_freed_gib"] > 0
    assert result["rows"][-1]["finite_logprobs"]
