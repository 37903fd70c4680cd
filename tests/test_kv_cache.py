"""--vllm_kv_cache_gib: the KV cache sizing math against numbers worked by hand, and the flag's parsing."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig, Qwen2VLConfig, Qwen3NextConfig

from grpo.config import parse_args
from grpo.errors import ConfigError
from grpo.rollout.kv_cache import (auto_kv_cache_bytes, checkpoint_weight_bytes, engine_kv_cache_bytes,
                                   kv_bytes_per_token, within_free, within_share)

from .tiny_models import make_tiny_model_dir
from .trainer_setup import ROOT, child_env

# the 0.68B Llama of the rollout benchmark: 20 layers, 16 heads of 96 over hidden 1536, 8 KV heads
LLAMA_068 = LlamaConfig(num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=8, hidden_size=1536)


def test_bytes_per_token_by_hand():
    # 2 (K, V) x 20 layers x 8 KV heads x 96 x 2 bytes (bf16)
    assert kv_bytes_per_token(LLAMA_068) == 2 * 20 * 8 * 96 * 2 == 61_440
    # tensor parallelism splits the KV heads: 4 per GPU over 2 GPUs
    assert kv_bytes_per_token(LLAMA_068, tensor_parallel_size=2) == 30_720
    # more GPUs than KV heads: vLLM replicates, one head per GPU
    assert kv_bytes_per_token(LLAMA_068, tensor_parallel_size=16) == 2 * 20 * 1 * 96 * 2
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 576 / 9 = 64
    smollm2 = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_bytes_per_token(smollm2) == 2 * 30 * 3 * 64 * 2 == 23_040
    # an explicit head_dim wins over hidden / heads
    assert kv_bytes_per_token(LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          hidden_size=64, head_dim=32)) == 2 * 2 * 2 * 32 * 2


@pytest.mark.parametrize("config", [DeepseekV3Config(), Qwen3NextConfig()], ids=["mla", "hybrid linear attention"])
def test_caches_auto_cannot_size(config):
    assert kv_bytes_per_token(config) is None
    assert auto_kv_cache_bytes(None, 128, 384, 384) is None


def test_a_vision_language_models_cache_is_its_language_models():
    config = Qwen2VLConfig(text_config={"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
                                        "hidden_size": 256})
    # 2 (K and V) x 3 layers x 2 KV heads x 32 head_dim x 2 bytes
    assert kv_bytes_per_token(config) == 2 * 3 * 2 * 32 * 2 == 768


def test_a_field_that_refuses_to_be_read_means_no_single_size():
    class PerLayerHeadDim:  # as transformers' Gemma-4 text config, whose head_dim differs per layer
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 2, 4, 2, 64

        @property
        def head_dim(self):
            raise RuntimeError("head_dim differs per layer")

    assert kv_bytes_per_token(PerLayerHeadDim()) is None


def test_auto_size_by_hand():
    # 16 prompts x 8 samples of at most 128 + 256 tokens, +25%: 61,440 tokens x 61,440 bytes = 3.515625 GiB
    assert auto_kv_cache_bytes(61_440, 128, 384, 384) == 61_440 * 61_440
    assert auto_kv_cache_bytes(61_440, 128, 384, 384) / 2**30 == 3.515625
    # never less than one max_seq_length sequence and 256 tokens of slack (vLLM's start-up check, whole blocks)
    assert auto_kv_cache_bytes(100, 1, 128, 768) == (768 + 256) * 100


def test_within_share_by_hand():
    # 0.3 of 80 GiB = 24 GiB, minus 14 GiB of weights leaves 10: auto may take up to half of it, 5 GiB
    assert within_share(5 * 2**30, 0.3, 80 * 2**30, 14 * 2**30)
    assert not within_share(5 * 2**30 + 1, 0.3, 80 * 2**30, 14 * 2**30)


def test_within_free_by_hand():
    # 60 GiB free, 17.9 GiB of 4-bit 32B weights: (60 - 17.9) / 2 = 21.05 GiB for the cache
    gib = 2**30
    assert within_free(10 * gib, 60 * gib, int(17.9 * gib))
    assert within_free(int(21.05 * gib), 60 * gib, int(17.9 * gib))
    assert not within_free(int(21.05 * gib) + 2, 60 * gib, int(17.9 * gib))
    assert not within_free(1, 10 * gib, 12 * gib)  # the weights alone do not fit
    # and 6 GiB stay beside the cache for the engine's own use: 20 GiB free, 10 of weights, 4 of cache leaves 6
    assert within_free(4 * gib, 20 * gib, 10 * gib)
    assert not within_free(4 * gib + 1, 20 * gib, 10 * gib)
    assert not within_free(gib, 10 * gib + 2 * gib - 1, 5 * gib)  # half of 7 GiB holds 1, but 6 do not stay


def test_adapters_may_take_the_free_memory_beyond_the_share(tmp_path):
    model = make_tiny_model_dir(str(tmp_path / "tiny"))
    flags = ["--per_device_train_batch_size", "128", "--k_samples", "64", "--max_prompt_length", "2048",
             "--rollout_max_new_tokens", "2048", "--max_seq_length", "4096"]
    # 128 x 64 sequences of 4,096 tokens, +25%, at 2 layers x 2 KV heads x 16 x 2 (K, V) x 2 bytes: 10 GiB
    size = 8_192 * 4_096 * 5 // 4 * (2 * 2 * 2 * 16 * 2)
    assert size == 10 * 2**30
    weights = checkpoint_weight_bytes(model)
    # a GPU whose 0.3 share leaves too little: weights + 2 x size is 0.6 of it
    total = int((2 * size + weights) / 0.6)
    free_enough, free_short = 2 * size + weights, 2 * size + weights - 2
    for strategy in ("lora", "qlora"):
        cfg = parse_args(flags + ["--tuning_strategy", strategy])
        assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=total, gpu_free_bytes=free_enough) == size
        assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=total, gpu_free_bytes=free_short) is None
        assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=total) is None  # free memory unknown
    # full fine-tuning's optimizer state arrives after the engine: the share alone decides
    full = parse_args(flags + ["--tuning_strategy", "full"])
    assert engine_kv_cache_bytes(full, model, gpu_total_bytes=total, gpu_free_bytes=total) is None
    # an engine awake through training keeps its cache there, and torch's cap (--gpu_memory_gib) counts vLLM's pool
    # even while it sleeps: the share alone decides for both
    lora = parse_args(flags + ["--tuning_strategy", "lora"])
    assert engine_kv_cache_bytes(lora, model, gpu_total_bytes=total, gpu_free_bytes=total) == size
    for more in (["--vllm_sleep", "false"], ["--gpu_memory_gib", str(total / 2**30)]):
        cfg = parse_args(flags + ["--tuning_strategy", "lora"] + more)
        assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=total, gpu_free_bytes=total) is None


def test_under_a_cap_the_cache_stays_within_half_of_what_the_cap_leaves(tmp_path, grpo_log):
    model = make_tiny_model_dir(str(tmp_path / "tiny"))
    flags = ["--per_device_train_batch_size", "128", "--k_samples", "64", "--max_prompt_length", "2048",
             "--rollout_max_new_tokens", "2048", "--max_seq_length", "4096", "--tuning_strategy", "qlora"]
    size = 10 * 2**30  # as above: 8,192 sequences of 4,096 tokens, +25%, at 256 bytes a token
    weights = checkpoint_weight_bytes(model)
    total = int((2 * size + weights) / 0.3) + 1  # a GPU whose 0.3 share holds the cache: auto takes it uncapped
    assert engine_kv_cache_bytes(parse_args(flags), model, gpu_total_bytes=total) == size
    # capped to weights + 20 GiB: half of the 20 left is the 10 GiB cache, and 10 GiB (>= 6) stay beside it
    fits = (weights + 2 * size) / 2**30
    assert engine_kv_cache_bytes(parse_args(flags + ["--gpu_memory_gib", str(fits)]), model,
                                 gpu_total_bytes=total) == size
    # 1 MiB less: more than half of what the cap leaves, so the share (of the cap) sizes it, and the line says why
    short = fits - 2**-10
    assert engine_kv_cache_bytes(parse_args(flags + ["--gpu_memory_gib", str(short)]), model,
                                 gpu_total_bytes=total) is None
    assert grpo_log[-1].startswith(f"vLLM KV cache: the memory share (the step's rollouts need 10.00 GiB, more than "
                                   f"half of what --gpu_memory_gib {short:g} leaves after")


def test_checkpoint_weight_bytes_from_headers(tmp_path):
    model = make_tiny_model_dir(str(tmp_path / "tiny"))
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    # per layer: q 64x64, k and v 64x32, o 64x64, gate and up 64x128, down 128x64, two norms of 64 = 36,992
    # values; two layers, the final norm, untied embeddings and output layer; fp32 on disk, bf16 in the engine
    values = 2 * 36_992 + 64 + 2 * vocab * 64
    assert checkpoint_weight_bytes(model) == 2 * values
    assert checkpoint_weight_bytes(model, tensor_parallel_size=2) == values
    assert checkpoint_weight_bytes(str(tmp_path)) is None
    assert checkpoint_weight_bytes("no-such-org/no-such-model") is None  # a hub id that is not cached


def test_checkpoint_weight_bytes_of_a_cached_hub_model(tmp_path, monkeypatch):
    import huggingface_hub.constants

    model = make_tiny_model_dir(str(tmp_path / "tiny"))
    # the local cache's layout for hub id org/tiny: refs/main names the snapshot folder that holds the files
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(model, repo / "snapshots" / ("0" * 40))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert checkpoint_weight_bytes("org/tiny") == checkpoint_weight_bytes(model)


def test_auto_keeps_the_share_when_the_weights_are_unknown(tmp_path):
    model = make_tiny_model_dir(str(tmp_path / "tiny"))
    for shard in glob.glob(os.path.join(model, "*.safetensors")):
        os.remove(shard)  # config alone: nothing tells how much of the share the weights take
    assert engine_kv_cache_bytes(parse_args([]), model, gpu_total_bytes=80 * 2**30) is None


def test_engine_kv_cache_bytes_from_flags(tmp_path, monkeypatch):
    model = make_tiny_model_dir(str(tmp_path / "tiny"))  # 2 layers, 2 KV heads, head_dim 64 / 4 = 16
    per_token = 2 * 2 * 2 * 16 * 2
    cfg = parse_args(["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "3", "--k_samples", "4",
                      "--max_prompt_length", "128", "--rollout_max_new_tokens", "64", "--max_seq_length", "512"])
    assert cfg.vllm_kv_cache == "auto"
    # 2 x 3 prompts x 4 samples = 24 sequences of at most 128 + 64 tokens, +25% = 5,760 tokens
    size = 5_760 * per_token
    assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=2**30) == size
    # multi-turn episodes grow to their token budget: 24 x (128 + 256) tokens, +25% = 11,520; never past the sequence
    assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=2**30, completion_tokens=256) == 11_520 * per_token
    assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=2**30, completion_tokens=10_000) == 15_360 * per_token
    # a GPU where that is more than half of what the 0.3 share leaves after the weights: the share instead
    weights = checkpoint_weight_bytes(model)
    small_gpu = int((2 * size + weights) / 0.3) - 1000
    assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=small_gpu) is None
    assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=small_gpu + 2000) == size
    # without gpu_total_bytes, the GPU's own total (as the trainer's engine start asks it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, small_gpu))
    assert engine_kv_cache_bytes(cfg, model) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 80 * 2**30))
    assert engine_kv_cache_bytes(cfg, model) == size
    assert engine_kv_cache_bytes(parse_args(["--vllm_kv_cache_gib", "1.5"]), model) == 3 * 2**29
    assert engine_kv_cache_bytes(parse_args(["--vllm_kv_cache_gib", "share"]), model) is None


def test_a_sequence_parallel_engine_holds_its_share_of_the_completions(tmp_path, monkeypatch):
    model = make_tiny_model_dir(str(tmp_path / "tiny"))  # 2 layers, 2 KV heads, head_dim 16, fp32: 256 B per token
    per_token = 2 * 2 * 2 * 16 * 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "3", "--k_samples", "3",
             "--max_prompt_length", "128", "--rollout_max_new_tokens", "64", "--max_seq_length", "512",
             "--sequence_parallel_size", "2"]
    # k = 3 over a group of 2: the fuller engine generates 2 of each prompt's; 6 prompts x 2 = 12 sequences of
    # 128 + 64 tokens, +25% = 2,880 tokens
    assert engine_kv_cache_bytes(parse_args(flags), model, gpu_total_bytes=2**30) == 2_880 * per_token
    # the first rank generating them all: 6 x 3 = 18 sequences, 4,320 tokens
    first = parse_args(flags + ["--sequence_parallel_rollout", "first"])
    assert engine_kv_cache_bytes(first, model, gpu_total_bytes=2**30) == 4_320 * per_token


def test_flag_values_and_defaults(monkeypatch):
    assert parse_args(["--vllm_kv_cache_gib", "AUTO"]).vllm_kv_cache == "auto"
    assert parse_args(["--vllm_kv_cache_gib", "4"]).vllm_kv_cache == 4.0
    for bad in ("lots", "0", "-2", "inf", "0.0001"):
        with pytest.raises(ConfigError, match="--vllm_kv_cache_gib: got .* give auto, share or a number of GiB"):
            parse_args(["--vllm_kv_cache_gib", bad])
    monkeypatch.setenv("WORLD_SIZE", "2")
    server = ["--rollout_mode", "server", "--rollout_gpus", "1"]
    assert parse_args(server).vllm_kv_cache == "share"  # rollout ranks only generate: all of their share
    assert parse_args(server + ["--vllm_kv_cache_gib", "8"]).vllm_kv_cache == 8.0
    with pytest.raises(ConfigError, match="--vllm_kv_cache_gib: auto is for colocated engines"):
        parse_args(server + ["--vllm_kv_cache_gib", "auto"])


def test_wake_keeps_torch_cache_only_with_room_to_spare():
    from grpo.rollout.vllm import WAKE_MARGIN_BYTES, room_beside_cache

    gib = 2**30
    assert WAKE_MARGIN_BYTES == gib
    # 3.5 GiB of KV cache to map: 4.5 GiB free is exactly enough with the 1 GiB margin, a byte less is not
    assert room_beside_cache(int(4.5 * gib), int(3.5 * gib))
    assert not room_beside_cache(int(4.5 * gib) - 1, int(3.5 * gib))
    # nothing to map still needs the margin (vLLM's own temporaries outside torch's cache)
    assert not room_beside_cache(gib // 2, 0)


# two gloo ranks whose GPUs report different memory: both must size the KV cache from the same figures
RANKS_AGREE = """
import os, socket, torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    gib = 2**30
    torch.cuda.is_available = lambda: False  # gloo reduces on the CPU, also on a host with one GPU
    torch.cuda.mem_get_info = lambda device=None: ((70 - 9 * rank) * gib, (80 - rank) * gib)
    from grpo.runtime.gpu_budget import least_gpu_memory
    assert least_gpu_memory() == (61 * gib, 79 * gib), least_gpu_memory()
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port,), nprocs=2)
    print("agreed")
"""


def test_every_rank_counts_on_the_least_gpu_memory(tmp_path):
    script = tmp_path / "ranks_agree.py"
    script.write_text(RANKS_AGREE)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=child_env())
    assert proc.returncode == 0 and proc.stdout.strip().endswith("agreed"), proc.stderr[-3000:]


def test_a_cache_left_to_the_share_says_how_many_sequences_it_holds(tmp_path, grpo_log):
    model = make_tiny_model_dir(str(tmp_path / "tiny"))
    # 4 x 8 = 32 sequences of min(1024, 64 + 960) tokens; 2 layers x 2 KV heads x 16 x 2 (K, V) x 2 bytes = 256 bytes
    # a token, so a sequence takes 256 KiB and the step, +25%, 10 MiB
    cfg = parse_args(["--per_device_train_batch_size", "4", "--k_samples", "8", "--max_prompt_length", "64",
                      "--rollout_max_new_tokens", "960", "--max_seq_length", "1024", "--tuning_strategy", "lora"])
    weights = checkpoint_weight_bytes(model)
    sequence = 1024 * 256
    for room_sequences, said in ((8, "about 8 of the step's 32 sequences of 1024 tokens at once"), (40, None)):
        total = int((room_sequences * sequence + weights) / 0.3) + 1  # the 0.3 share less the weights
        assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=total) is None  # more than half of it: the share
        line = grpo_log[-1]
        assert line.startswith("vLLM KV cache: the memory share (the step's rollouts need 0.01 GiB")
        if said:  # 8 sequences at a time: the rest wait, and how to hold them all
            assert said in line and "vLLM queues and preempts the rest" in line and "--vllm_kv_cache_gib 1 " in line
        else:  # it holds all 32 at once, only without auto's half for vLLM's activations: nothing more to say
            assert "at once" not in line
    # under --gpu_memory_gib vLLM's share is of the cap, not of the whole GPU: a GPU with room for 4 more sequences
    # in its share, capped to the size above, still holds 8
    cap_total = int((8 * sequence + weights) / 0.3) + 1
    capped = parse_args(["--per_device_train_batch_size", "4", "--k_samples", "8", "--max_prompt_length", "64",
                         "--rollout_max_new_tokens", "960", "--max_seq_length", "1024", "--tuning_strategy", "lora",
                         "--gpu_memory_gib", str(cap_total / 2**30)])
    assert engine_kv_cache_bytes(capped, model, gpu_total_bytes=cap_total + int(4 * sequence / 0.3)) is None
    assert "about 8 of the step's 32 sequences" in grpo_log[-1]
    assert engine_kv_cache_bytes(cfg, model, gpu_total_bytes=cap_total + int(4 * sequence / 0.3)) is None
    assert "about 12 of the step's 32 sequences" in grpo_log[-1]
