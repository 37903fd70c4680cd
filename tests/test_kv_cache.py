"""--vllm_kv_cache_gib: the KV cache sizing math against numbers worked by hand, and the flag's parsing."""
import pytest
from transformers import DeepseekV3Config, LlamaConfig, Qwen2VLConfig, Qwen3NextConfig

from grpo.config import parse_args
from grpo.errors import ConfigError
from grpo.rollout.kv_cache import auto_kv_cache_bytes, kv_bytes_per_token
from grpo.rollout.setup import engine_kv_cache_bytes

from .tiny_models import make_tiny_model_dir

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


@pytest.mark.parametrize("config", [DeepseekV3Config(), Qwen3NextConfig(), Qwen2VLConfig()],
                         ids=["mla", "hybrid linear attention", "vision-language"])
def test_caches_auto_cannot_size(config):
    assert kv_bytes_per_token(config) is None
    assert auto_kv_cache_bytes(None, 128, 384) is None


def test_auto_size_by_hand():
    # 16 prompts x 8 samples of at most 384 tokens, +25%: 61,440 tokens x 61,440 bytes = 3.515625 GiB
    assert auto_kv_cache_bytes(61_440, 128, 384) == 61_440 * 61_440
    assert auto_kv_cache_bytes(61_440, 128, 384) / 2**30 == 3.515625
    # never less than one whole sequence, which vLLM checks at start-up
    assert auto_kv_cache_bytes(100, 1, 768, margin=0.5) == 768 * 100


def test_engine_kv_cache_bytes_from_flags(tmp_path):
    model = make_tiny_model_dir(str(tmp_path / "tiny"))  # 2 layers, 2 KV heads, head_dim 64 / 4 = 16
    per_token = 2 * 2 * 2 * 16 * 2
    cfg = parse_args(["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "3", "--k_samples", "4",
                      "--max_seq_length", "512"])
    assert cfg.vllm_kv_cache == "auto"
    # 2 x 3 prompts x 4 samples = 24 sequences of 512 tokens, +25% = 15,360 tokens
    assert engine_kv_cache_bytes(cfg, model) == 15_360 * per_token
    assert engine_kv_cache_bytes(parse_args(["--vllm_kv_cache_gib", "1.5"]), model) == 3 * 2**29
    assert engine_kv_cache_bytes(parse_args(["--vllm_kv_cache_gib", "share"]), model) is None


def test_flag_values_and_defaults(monkeypatch):
    assert parse_args(["--vllm_kv_cache_gib", "AUTO"]).vllm_kv_cache == "auto"
    assert parse_args(["--vllm_kv_cache_gib", "4"]).vllm_kv_cache == 4.0
    for bad in ("lots", "0", "-2", "inf"):
        with pytest.raises(ConfigError, match="--vllm_kv_cache_gib: got .* give auto, share or a number of GiB"):
            parse_args(["--vllm_kv_cache_gib", bad])
    monkeypatch.setenv("WORLD_SIZE", "2")
    server = ["--vllm_mode", "server", "--rollout_gpus", "1"]
    assert parse_args(server).vllm_kv_cache == "share"  # rollout ranks only generate: all of their share
    assert parse_args(server + ["--vllm_kv_cache_gib", "8"]).vllm_kv_cache == 8.0
    with pytest.raises(ConfigError, match="--vllm_kv_cache_gib: auto is for colocated engines"):
        parse_args(server + ["--vllm_kv_cache_gib", "auto"])
