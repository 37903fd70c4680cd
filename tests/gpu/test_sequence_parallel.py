"""On 2 GPUs (nccl, bf16): Ulysses sequence parallelism (grpo.runtime.sequence_parallel, DeepSpeed's attention) gives
the same completion log-probs as one GPU without it, on a small random Llama with a 1000-token sequence."""

import pytest
import torch

from tests.spawn_ranks import join_world, spawn_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
LENGTH, COMPLETION = 1001, 600  # odd: the sequence is padded to a multiple of 2


def _model_dir(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _inputs():
    torch.manual_seed(1)
    ids = torch.randint(1, 512, (1, LENGTH))
    return ids, torch.ones_like(ids)


def _load(path, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.bfloat16).to(device)


def _rank_main(rank, port, path, out):
    join_world(rank, port)
    torch.cuda.set_device(rank)
    import deepspeed
    import deepspeed.comm as ds_dist

    from grpo.runtime.sequence_parallel import register_ulysses, sharded_completion_logprobs

    deepspeed.init_distributed(dist_backend="nccl")
    model = _load(path, f"cuda:{rank}")
    mpu = register_ulysses(model, 2)
    ids, mask = _inputs()
    with torch.no_grad():
        logprobs = sharded_completion_logprobs(model.model, model.lm_head, ids.cuda(), mask.cuda(), COMPLETION,
                                               mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(),
                                               2, chunk_tokens=256)
    if rank == 0:
        torch.save(logprobs.float().cpu(), out)
    ds_dist.barrier()


def test_two_gpus_match_one(tmp_path):
    from grpo.algorithm import hidden_token_logprobs

    path = _model_dir(str(tmp_path / "model"))
    out = str(tmp_path / "sp.pt")
    spawn_ranks(_rank_main, path, out)
    sharded = torch.load(out)
    model = _load(path, "cuda:0")
    ids, _ = _inputs()
    with torch.no_grad():
        hidden = model.model(input_ids=ids.cuda(), use_cache=False).last_hidden_state[0]
        full, _ = hidden_token_logprobs(hidden[:-1], model.lm_head, ids[0, 1:].cuda(), chunk_tokens=256)
    reference = full[-COMPLETION:].float().cpu().unsqueeze(0)
    # bf16: the two paths add the same terms in other orders (attention over gathered heads, chunk boundaries)
    assert (sharded - reference).abs().mean() < 0.02, (sharded - reference).abs().mean()
    assert torch.allclose(sharded, reference, atol=0.15)
