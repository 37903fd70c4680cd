"""On a GPU with vLLM: after every training step the synced engine scores like the trained policy, an engine that
was not synced clearly does not, and sleep frees GPU memory. Each case runs tests/gpu/sync_check.py in its own
process (one in-process vLLM engine per process)."""
import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer_setup import deepspeed_launcher, gpu_flags, launcher_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs CUDA and vLLM")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SYNCED_MAX = 0.02  # mean |log-prob difference| between vLLM and the trainer, both bf16
START_MAX = 0.15  # the same right after GRPOTrainer is built, on the embedded SmolLM2 (see the test)
DECODE_MAX = 0.03  # mean |log-prob difference| over sampled tokens (vLLM's decode path), after the last sync:
# 0.005-0.009 measured on the DeepSeek-V2 shape (H200), 0.74 through vLLM's LoRA, which misses MLA's decode weights


def child_env() -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1"}
    env.pop("MASTER_PORT", None)  # the child picks a free one
    return env


def run_script(script: str, out, *args: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), *args, "--out", str(out)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    print(json.dumps(result))
    return result


# qlora with no options: its default base, quantized again after loading in blocks of 32 with searched scales.
# STOCK_4BIT: bitsandbytes' stock base, as transformers loads it.
STOCK_4BIT = ("--qlora_block_size", "64", "--qlora_block_scale", "absmax")


ADAPTER = ("--rollout_weights", "adapter")
IN_PLACE = ("--rollout_weights", "in_place")
KEEPS_WEIGHTS = ("--sleep_level", "0")  # lora / qlora merged on one GPU by default (grpo.rollout.engines)


@pytest.mark.parametrize("strategy, zero, options",
                         [("full", 2, ()), ("lora", 2, ()), ("qlora", 2, ()), ("full", 3, ()),
                          ("qlora", 2, STOCK_4BIT), ("lora", 2, KEEPS_WEIGHTS), ("qlora", 2, KEEPS_WEIGHTS),
                          ("lora", 2, ADAPTER),
                          pytest.param("qlora", 2, ADAPTER, marks=pytest.mark.xfail(
                              strict=False, reason="vLLM's bitsandbytes kernels on the default base (blocks of 32) "
                              "score the untrained policy 0.0226 from the trainer at step 0 (H100, 2026-11-26), over "
                              "SYNCED_MAX; steps 1-3: 0.013, 0.018, 0.006")),
                          ("lora", 3, ADAPTER), ("lora", 2, IN_PLACE),
                          pytest.param("qlora", 2, STOCK_4BIT + ADAPTER, marks=pytest.mark.xfail(
                              strict=False, reason="at the bound: passed once, then step 2 at 0.0212 over SYNCED_MAX "
                              "(H100, 2026-11-26); vLLM's bitsandbytes kernels and the trainer's differ slightly"))],
                         ids=["full-2", "lora-2", "qlora-2", "full-3", "qlora-2-stock", "lora-2-level0",
                              "qlora-2-level0", "lora-2-adapter",
                              "qlora-2-adapter", "lora-3-adapter", "lora-2-in_place", "qlora-2-stock-adapter"])
def test_sync_is_exact_and_sleep_frees_memory(strategy, zero, options, tmp_path):
    check_sync(run_script("sync_check.py", tmp_path / "result.json", "--strategy", strategy, "--zero", str(zero),
                          *options), strategy)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("strategy, options", [("full", ()), ("lora", ()), ("lora", ADAPTER)],
                         ids=["full", "lora", "lora-adapter"])
def test_sync_is_exact_into_a_tensor_parallel_engine(strategy, options, tmp_path):
    """--vllm_tp 2: two data-parallel ranks share one vLLM engine sharded over both; each rank's sync fills its
    shard, so the whole engine scores like the trained policy after every step."""
    out = tmp_path / "result.json"
    proc = subprocess.run([*deepspeed_launcher(), *gpu_flags(2), "--master_port", "29571",
                           os.path.join(HERE, "sync_check.py"), "--strategy", strategy, "--tp", "2", *options,
                           "--out", str(out)],
                          cwd=ROOT, env=launcher_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    print(json.dumps(result))
    assert result["tp"] == 2
    check_sync(result, strategy)


def check_sync(result: dict, strategy: str) -> None:
    steps = [r for r in result["rows"] if "synced" in r]
    adapter = result.get("rollout_weights") == "adapter"
    in_place = result.get("rollout_weights") == "in_place"  # the base shared, the adapter merged into it
    keeps_weights = adapter or in_place or result.get("sleep_level") == 0
    assert len(steps) == 4
    assert steps[0]["synced"] < SYNCED_MAX, steps[0]  # the first sync matches the untrained policy
    if strategy == "qlora" and not adapter:  # vLLM started from the 16-bit checkpoint: off until the 4-bit is sent
        assert steps[0]["never_synced"] > max(0.03, 2 * steps[0]["synced"]), steps[0]
    if adapter or in_place:  # the engine started from the trainer's own base, and a sync moves the adapter alone
        assert steps[0]["never_synced"] < SYNCED_MAX, steps[0]
        assert all(row["sync_tensors"] == 2 * 7 * 12 and row["sync_mib"] < 64 for row in steps), steps
    elif keeps_weights:  # a later sync writes the adapted layers alone (7 per layer), not the whole policy
        assert all(row["sync_tensors"] == 7 * 12 for row in steps[1:]), steps
    shared = steps[0].get("shared_base")
    if (adapter or in_place) and result["zero"] == 2 and result["tp"] == 1:  # one copy of the base (qlora: its 4-bit base)
        assert shared and shared["kept_tensors"] == 0 and shared["parked_tensors"] == shared["shared_tensors"], shared
        assert shared["base_on_gpu"], shared  # every parked tensor came back, as a view of the engine's
    for row in steps[1:]:
        assert row["synced"] < SYNCED_MAX, row
        # an engine that missed this step's sync, or every sync, is clearly off
        assert row["stale"] > max(0.05, 3 * row["synced"]), row
        assert row["never_synced"] > max(0.05, 3 * row["synced"]), row
        assert row["sleep_freed_gib"] > 0, row  # and the synced engine was woken from that sleep
    generated = result["rows"][-1]
    assert generated["completions"] == 8 and generated["prompt_order"] == [0] * 4 + [1] * 4
    assert generated["lengths_ok"] and generated["finite_logprobs"]
    assert generated["base_exact"]  # in-place mode: after 5 merges the shared base is the checkpoint's bit for bit
    # a level-2 sleep dropped the weights: no rollout on garbage; adapter mode and level 0 keep them
    assert generated["unsynced_wake_refused"] != keeps_weights


@pytest.mark.parametrize("strategy, options", [("full", ()), ("lora", KEEPS_WEIGHTS), ("lora", IN_PLACE)],
                         ids=["full", "lora-level0", "lora-in_place"])
def test_sync_reaches_the_decoding_of_mla_attention(strategy, options, tmp_path):
    """DeepSeek-V2/V3's MLA attention: vLLM scores a prompt through kv_b_proj and decodes through W_UK_T / W_UV,
    derived from it at load. In bf16 those are views of kv_b_proj's weight, so a sync that writes it (level 2's whole
    reload too) or an in-place merge reaches decoding as well: the sampled tokens' log-probs match the policy's."""
    result = run_script("sync_check.py", tmp_path / "result.json", "--arch", "mla", "--strategy", strategy, *options)
    steps = [r for r in result["rows"] if "synced" in r]
    assert len(steps) == 4 and steps[0]["synced"] < SYNCED_MAX, steps
    for row in steps[1:]:
        assert row["synced"] < SYNCED_MAX and row["stale"] > max(0.05, 3 * row["synced"]), row
    if result["rollout_weights"] == "in_place":  # one copy of the base, kv_b_proj's included
        assert steps[0]["shared_base"]["kept_tensors"] == 0, steps[0]
    generated = result["rows"][-1]
    assert generated["decode_gap"] < DECODE_MAX, generated
    assert generated["base_exact"] and generated["finite_logprobs"], generated


@pytest.mark.parametrize("strategy, options", [("full", ()), ("lora", ADAPTER)], ids=["full", "lora-adapter"])
def test_soft_capped_attention_scores_as_vllm_does(strategy, options, tmp_path):
    """Gemma 2 caps its attention logits (cap tanh(s / cap)); vLLM applies the cap, torch's SDPA kernels leave it out
    (transformers 5.17's default for Gemma 2). The trainer loads such a model with eager attention, so its log-probs
    are the engine's from the checkpoint on (step 0) through every sync, and over sampled tokens."""
    result = run_script("sync_check.py", tmp_path / "result.json", "--arch", "gemma2", "--strategy", strategy, *options)
    steps = [r for r in result["rows"] if "synced" in r]
    assert len(steps) == 4 and all(row["synced"] < SYNCED_MAX for row in steps), steps
    for row in steps[1:]:
        assert row["stale"] > max(0.05, 3 * row["synced"]), row
    assert result["rows"][-1]["decode_gap"] < DECODE_MAX, result["rows"][-1]


def vllm_has_moe_kernels() -> bool:
    """vLLM's fused-MoE kernels ship as their own library; a trimmed vLLM build may leave them out."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and bool(glob.glob(os.path.join(os.path.dirname(spec.origin), "_moe_C*.so")))


@pytest.mark.skipif(not vllm_has_moe_kernels(), reason="this vLLM build has no fused-MoE kernels (vllm/_moe_C*.so)")
@pytest.mark.parametrize("arch, strategy", [("mixtral", "full"), ("mixtral", "lora"), ("qwen3_moe", "full")])
def test_sync_reaches_fused_experts(arch, strategy, tmp_path):
    """Mixture-of-experts models: transformers fuses a checkpoint's per-expert linears as it loads it (and renames
    Mixtral's block_sparse_moe to mlp), while vLLM loaded them per expert by the checkpoint's names. The sync sends the
    checkpoint's own tensors, so each whole-policy reload (level 2; lora's frozen experts and router too) reaches
    the experts and the engine scores like the policy."""
    result = run_script("sync_check.py", tmp_path / "result.json", "--arch", arch, "--strategy", strategy)
    steps = [r for r in result["rows"] if "synced" in r]
    # step 0 scores the checkpoint itself: vLLM's fused-MoE kernels against transformers' experts, whose routing a
    # random router leaves close to ties (Mixtral 0.042 on an H100, 2026-11-27, the same with and without a sync)
    assert len(steps) == 4 and steps[0]["synced"] < 0.06, steps
    for row in steps[1:]:  # the same near-ties after each sync (mixtral lora 0.030 at step 3 on an H200, 2026-11-29)
        assert row["synced"] < 0.06 and row["stale"] > max(0.05, 3 * row["synced"]), row
    generated = result["rows"][-1]
    assert generated["unsynced_wake_refused"] and generated["finite_logprobs"], generated
    assert generated["decode_gap"] < DECODE_MAX, generated


@pytest.mark.parametrize("strategy, options", [("full", ()), ("lora", ()), ("qlora", ()), ("qlora", STOCK_4BIT)])
def test_engine_samples_the_policy_from_construction_on(strategy, options, tmp_path):
    """evaluate() before train() (and eval at step 0) sees the policy training starts from."""
    result = run_script("trainer_start_check.py", tmp_path / "result.json", "--strategy", strategy, *options)
    # SmolLM2's bf16 forwards in vLLM and in transformers differ by 0.056 on identical weights (full, measured on an
    # H100), and by 0.10 for qlora, whose engine holds dequantize(W) rounded to bf16 once more
    assert result["engine_vs_policy"] < START_MAX, result
    if strategy == "qlora":  # an engine left on the bf16 checkpoint would be off by 1.09 (measured)
        assert result["checkpoint_vs_policy"] > 5 * result["engine_vs_policy"], result
    assert "eval/reward/mean" in result["eval"], result
