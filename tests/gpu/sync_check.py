"""One GPU check of weight sync into vLLM, in its own process (vLLM allows one in-process engine per process).

    python tests/gpu/sync_check.py --strategy lora --zero 2 --out result.json
    deepspeed --num_gpus 2 tests/gpu/sync_check.py --strategy lora --tp 2 --out result.json   # one engine, TP 2

Builds (once, on the GPU) a ~200M-parameter random Llama whose output layer is scaled up so that log-probs are far
from flat, trains it with DeepSpeed for 3 steps on a fixed sequence with vLLM asleep (level 2: its weights dropped,
so each sync sends the whole policy), syncs after each step, wakes vLLM and records per step, as mean |vLLM log-prob - trainer log-prob| over the sequence:
  synced        the engine after this step's sync
  stale         the engine before this step's sync (an engine that missed one sync)
  never_synced  the engine as started from the checkpoint (an engine never synced)
plus the sync's time / bytes / tensors and the GPU memory freed by sleep; then checks that waking after a sleep with
no sync is refused, and samples from the woken engine.
With --tp 2 (two ranks), both ranks train the same sequence (data parallel) and share one vLLM engine sharded over
them, so each rank's sync must land in its own shard; rank 0 writes the result.
With --rollout_weights adapter (lora / qlora), the engine holds the base once (qlora: the trainer's own 4-bit base,
written as a pre-quantized folder) and each sync sends the adapter alone; it sleeps at level 1, so a wake without a
sync is allowed and samples the last synced adapter. With one GPU per engine the trainer's frozen base (qlora: its
packed 4-bit weights too) then becomes views of the engine's weights (held once), and the engine's sleeps drop its
KV cache only. With --rollout_weights in_place (lora) the engine loads the 16-bit checkpoint without LoRA, shares
its weights with the trainer's base in the same way, and merges each synced adapter into them while it is awake
(taken out, exactly, when it sleeps or the trainer runs a forward). --sleep_level 0: a merged engine that keeps its weights too (sleeps free the KV cache alone), so a
sync writes only what changed. --arch mla: a DeepSeek-V2 model, whose vLLM attention scores a prompt through kv_b_proj
and decodes through weights derived from it at load. Last, the completions sampled after the final sync are scored by
the trainer: decode_gap, the mean |vLLM log-prob - trainer log-prob| over sampled tokens (vLLM's decode path).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402
from qlora_rounding_args import add_qlora_rounding_args, qlora_rounding  # noqa: E402  (beside this script)

MODEL_DIR = os.environ.get("GRPO_GPU_MODEL", "/tmp/grpo_gpu_model")
LEARNING_RATES = {"full": 1e-4, "lora": 5e-3, "qlora": 5e-3}  # large enough that each step visibly moves log-probs


MOE_ARCHS = ("mixtral", "qwen3_moe")
MOE_TARGETS = "all-linear"  # attention and every expert (grpo.sync.expert_adapters: per-expert LoRA for vLLM)


def build_model(path: str, arch: str = "llama") -> str:
    """A random Llama (or, arch "mla", a DeepSeek-V2 of MLA attention and dense MLPs, with DeepSeek-V2-Lite's
    attention widths; "mixtral" / "qwen3_moe", 8 experts, 2 per token, saved with one tensor per expert as their
    checkpoints are; "gemma2", Gemma 2's soft-capped attention with a cap of 2, low enough that it changes every
    score) saved as a bf16 safetensors checkpoint (reused when already there)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, Gemma2Config, Gemma2ForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(0)
    shared = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, max_position_embeddings=2048,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "mla":
        config = DeepseekV2Config(**shared, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
                                  q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                  v_head_dim=128, first_k_dense_replace=4, n_routed_experts=4, n_shared_experts=1,
                                  num_experts_per_tok=2, moe_intermediate_size=512)
        model_class = DeepseekV2ForCausalLM
    elif arch == "mixtral":
        config = MixtralConfig(**shared, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                               num_local_experts=8, num_experts_per_tok=2)
        model_class = MixtralForCausalLM
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(**shared, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                                head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=704)
        model_class = Qwen3MoeForCausalLM
    elif arch == "gemma2":
        # Gemma 2 ties its embeddings; vLLM's Gemma2 model asserts it
        config = Gemma2Config(**{**shared, "tie_word_embeddings": True}, num_hidden_layers=4, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=64, query_pre_attn_scalar=64,
                              attn_logit_softcapping=2.0, final_logit_softcapping=30.0, sliding_window=1024)
        model_class = Gemma2ForCausalLM
    else:
        config = LlamaConfig(**shared, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4)
        model_class = LlamaForCausalLM
    with torch.device("cuda"):
        model = model_class(config).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # log-probs far from uniform, as in a trained model
    model.save_pretrained(path + ".tmp", safe_serialization=True)
    os.replace(path + ".tmp", path)
    return path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["full", "lora", "qlora"], required=True)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size (= the number of ranks)")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the DeepSpeed launcher")
    parser.add_argument("--arch", choices=["llama", "mla", "gemma2", *MOE_ARCHS], default="llama",
                        help="mla: a DeepSeek-V2 model, whose vLLM attention decodes through W_UK_T / W_UV; "
                             "mixtral / qwen3_moe: experts that transformers fuses on load, vLLM per expert; "
                             "gemma2: soft-capped attention logits, which vLLM applies and the trainer must too")
    parser.add_argument("--rollout_weights", choices=["merged", "adapter", "in_place"], default="merged")
    parser.add_argument("--sleep_level", type=int, choices=[0, 2], default=2,
                        help="0: the engine keeps its weights (frees its KV cache alone), so a sync writes only what "
                             "changed, in place")
    add_qlora_rounding_args(parser)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import deepspeed

    from grpo.runtime import distributed as dist_utils
    from grpo.algorithm import token_logprobs
    from grpo.config.options import GRPOConfig
    from grpo.runtime.deepspeed_config import load_deepspeed_config
    from grpo.model.loading import load_policy
    from grpo.rollout.engine import SamplingSettings
    from grpo.rollout.vllm import VLLMRolloutEngine
    from grpo.sync.weight_sync import sync_weights

    dist_utils.init_distributed()
    path = MODEL_DIR if args.arch == "llama" else f"{MODEL_DIR}-{args.arch}"
    if dist_utils.rank() == 0:  # one writer; the other rank waits for the finished folder
        build_model(path, args.arch)
    dist_utils.barrier()
    cfg = GRPOConfig(model_name_or_path=path, tuning_strategy=args.strategy, lora_rank=16, lora_alpha=32,
                     lora_dropout=0.0, deepspeed=f"zero{args.zero}", per_device_train_batch_size=1, k_samples=2,
                     **({"lora_target_modules": MOE_TARGETS} if args.arch in MOE_ARCHS else {}), **qlora_rounding(args))
    device = dist_utils.device()
    policy = load_policy(cfg, path, torch.bfloat16, device)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=trainable,
                                      optimizer=torch.optim.AdamW(trainable, lr=LEARNING_RATES[args.strategy]),
                                      config=load_deepspeed_config(cfg, use_bf16=True))
    start = time.perf_counter()
    adapter = args.rollout_weights == "adapter"
    in_place = args.rollout_weights == "in_place"
    engine_path = path
    if adapter and args.strategy == "qlora":
        from grpo.model.quantized_checkpoint import write_4bit_checkpoint

        engine_path = f"{path}.4bit.rank{dist_utils.rank()}"
        write_4bit_checkpoint(engine.module, engine_path)
    parked = {}
    if (adapter or in_place) and args.tp == 1:  # as the trainer does: its base waits in CPU memory
        from grpo.sync.shared_base import park_frozen_base

        parked = park_frozen_base(engine.module)
    vllm = VLLMRolloutEngine(engine_path, tensor_parallel_size=args.tp, gpu_memory_utilization=0.3, max_model_len=512,
                             seed=0, enforce_eager=True, lora_rank=16 if adapter else None, sleep_level=args.sleep_level,
                             quantized=adapter and args.strategy == "qlora", merge_in_place=in_place)
    main_rank = dist_utils.rank() == 0
    engine_start_s = time.perf_counter() - start
    shared = None
    if adapter or in_place:  # ... then its frozen base (qlora: its packed 4-bit weights too) becomes views of the engine's own
        shared = vllm.share_base(engine.module, parked)
        shared = shared and {"shared_tensors": shared.shared, "kept_tensors": shared.kept,
                             "shared_gib": shared.shared_bytes / 2**30, "parked_tensors": len(parked),
                             "base_on_gpu": all(p.is_cuda for p in engine.module.parameters())}
    if in_place:  # as the trainer does: a forward of the policy takes the adapter out of the shared base first
        from grpo.rollout.engines import release_base_before_forward

        assert vllm.merges_in_place, shared
        release_base_before_forward(vllm, engine.module)
    # the frozen base as loaded: in-place mode must give it back bit for bit after every merge
    base_copy = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters() if not p.requires_grad} \
        if in_place else {}

    sequence = torch.randint(3, 32000, (1, 96), generator=torch.Generator().manual_seed(1))
    ids = sequence.to(device)

    def trainer_logprobs(tokens=ids):
        with torch.no_grad():
            logits = engine.module(input_ids=tokens).logits
        return token_logprobs(logits[:, :-1], tokens[:, 1:])[0].float().cpu()

    def vllm_logprobs():
        return torch.tensor(vllm.prompt_logprobs(sequence[0].tolist()))

    def gap(a, b):
        return (a - b).abs().mean().item()

    initial = vllm_logprobs()  # the checkpoint as vLLM loaded it
    current = trainer_logprobs()
    first = sync_weights(vllm, engine.module, args.strategy, zero3=args.zero == 3, first_sync=True)
    previous = vllm_logprobs()
    rows = [{"step": 0, "synced": gap(previous, current), "never_synced": gap(initial, current),
             "engine_start_s": engine_start_s, "shared_base": shared, "sync_s": first.seconds, "sync_mib": first.bytes / 2**20,
             "sync_tensors": first.tensors}]
    if main_rank:
        print(json.dumps(rows[-1]), flush=True)
    for step in range(1, args.steps + 1):
        vllm.sleep()
        freed = vllm.last_sleep_freed_bytes
        loss = -token_logprobs(engine(input_ids=ids).logits[:, :-1], ids[:, 1:]).mean()  # raise p(sequence)
        engine.backward(loss)
        engine.step()
        current = trainer_logprobs()
        stats = sync_weights(vllm, engine.module, args.strategy, zero3=args.zero == 3)  # while asleep
        vllm.wake()
        synced = vllm_logprobs()
        rows.append({"step": step, "loss": loss.item(), "synced": gap(synced, current),
                     "synced_max": (synced - current).abs().max().item(), "stale": gap(previous, current),
                     "never_synced": gap(initial, current), "sync_s": stats.seconds,
                     "sync_mib": stats.bytes / 2**20, "sync_tensors": stats.tensors,
                     "sleep_freed_gib": freed / 2**30})
        previous = synced
        if main_rank:
            print(json.dumps(rows[-1]), flush=True)
    # a level-2 sleep dropped the weights: waking without a sync is refused, and a sync makes the engine whole again
    vllm.sleep()
    try:
        vllm.wake()
        refused = False
    except RuntimeError:
        refused = True
    sync_weights(vllm, engine.module, args.strategy, zero3=args.zero == 3)
    vllm.wake()
    # the woken, synced engine still generates
    start = time.perf_counter()
    out = vllm.generate([sequence[0, :16].tolist(), sequence[0, 16:40].tolist()],
                        SamplingSettings(n=4, max_new_tokens=32))
    generate_s = time.perf_counter() - start
    vllm.sleep()  # in-place mode: the adapter taken out of the shared base
    base_exact = all(torch.equal(p.detach().cpu(), base_copy[n]) for n, p in engine.module.named_parameters()
                     if n in base_copy)
    # the sampled tokens' log-probs (vLLM's decode path; the gaps above score a prompt, its prefill path) against
    # the trainer's on the same tokens
    prompts = [sequence[0, :16].tolist(), sequence[0, 16:40].tolist()]
    decode_gaps = []
    for completion in out:
        prompt = prompts[completion.prompt_index]
        trained = trainer_logprobs(torch.tensor([prompt + completion.token_ids], device=device))[len(prompt) - 1:]
        decode_gaps.append(gap(trained, torch.tensor(completion.logprobs)))
    rows.append({"generate_s": generate_s, "completions": len(out), "base_exact": base_exact,
                 "decode_gap": sum(decode_gaps) / len(decode_gaps), "decode_gap_max": max(decode_gaps),
                 "unsynced_wake_refused": refused, "prompt_order": [c.prompt_index for c in out],
                 "lengths_ok": all(len(c.token_ids) == len(c.logprobs) > 0 for c in out),
                 "finite_logprobs": all(torch.isfinite(torch.tensor(c.logprobs)).all().item() for c in out)})
    if main_rank:
        print(json.dumps(rows[-1]), flush=True)
        with open(args.out, "w") as fh:
            json.dump({"strategy": args.strategy, "arch": args.arch, "zero": args.zero, "tp": args.tp,
                       "rollout_weights": args.rollout_weights, "sleep_level": args.sleep_level, "rows": rows}, fh, indent=1)
    dist_utils.shutdown()


if __name__ == "__main__":
    main()
