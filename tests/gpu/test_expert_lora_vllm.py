"""GPU: LoRA on a mixture of experts' fused experts in vLLM 0.26: synced as an adapter (one LoRA per expert and
checkpoint tensor, the frozen experts shared with vLLM's fused ones) and read from the saved lora_adapter/vllm."""
import importlib.util

import pytest
import torch

from tests.gpu.test_vllm_sync import ADAPTER, DECODE_MAX, SYNCED_MAX, run_script, vllm_has_moe_kernels

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                 reason="needs a GPU and vLLM"),
              pytest.mark.skipif(not vllm_has_moe_kernels(), reason="this vLLM build has no fused-MoE kernels")]
# step 0 scores the checkpoint itself: vLLM's fused-MoE kernels against transformers' experts, whose routing a random
# router leaves close to ties (Mixtral 0.042 on an H100, 2026-11-27; test_vllm_sync.test_sync_reaches_fused_experts)
CHECKPOINT_MAX = 0.06


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_lora_on_the_experts_syncs_as_an_adapter(arch, tmp_path):
    result = run_script("sync_check.py", tmp_path / "result.json", "--arch", arch, "--strategy", "lora", *ADAPTER)
    steps = [r for r in result["rows"] if "synced" in r]
    assert steps[0]["synced"] < CHECKPOINT_MAX, steps
    for row in steps[1:]:
        assert row["synced"] < max(SYNCED_MAX, CHECKPOINT_MAX) and row["stale"] > 2 * row["synced"], row
    shared = steps[0]["shared_base"]
    assert shared and shared["shared_tensors"] > 0, shared  # (kept_tensors: experts vLLM holds in another layout)
    assert result["rows"][-1]["decode_gap"] < max(DECODE_MAX, CHECKPOINT_MAX), result["rows"][-1]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_the_saved_expert_adapter_loads_in_vllm(arch, tmp_path):
    result = run_script("expert_adapter_check.py", tmp_path / "result.json", "--arch", arch)
    assert result["gap_with_adapter"] < CHECKPOINT_MAX, result
    assert result["gap_without_adapter"] > 3 * result["gap_with_adapter"], result
