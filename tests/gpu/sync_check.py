"""One GPU check of weight sync into vLLM, run in its own process (one vLLM engine per process).

    python tests/gpu/sync_check.py --strategy lora --zero 2 --out result.json

Builds (once) a ~200M-parameter random Llama with a sharpened output layer, trains it for 3 DeepSpeed steps on
a fixed sequence with vLLM asleep, syncs after each step, and records per step:
  synced  mean |vLLM log-prob - trainer log-prob| over the sequence after the sync
  stale   the same for an engine that was not synced (its log-probs are those from before the step)
plus sync time / bytes and the GPU memory freed by sleep.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

MODEL_DIR = os.environ.get("GRPO_GPU_MODEL", "/tmp/grpo_gpu_model_x2")


def build_model(path: str) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
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
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import deepspeed

    from grpo import distributed as dist_utils
    from grpo.algorithm import token_logprobs
    from grpo.config import GRPOConfig
    from grpo.ds_config import load_deepspeed_config
    from grpo.models import load_policy
    from grpo.rollout.vllm import VLLMRolloutEngine
    from grpo.sync import sync_weights

    dist_utils.init_distributed()
    path = build_model(MODEL_DIR)
    cfg = GRPOConfig(model_name_or_path=path, tuning_strategy=args.strategy, lora_rank=16, lora_alpha=32,
                     lora_dropout=0.0, deepspeed=f"zero{args.zero}", per_device_train_batch_size=1, k_samples=2)
    device = dist_utils.device()
    policy = load_policy(cfg, path, torch.bfloat16, device)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    lr = 2e-5 if args.strategy == "full" else 2e-3
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=trainable,
                                      optimizer=torch.optim.AdamW(trainable, lr=lr),
                                      config=load_deepspeed_config(cfg, use_bf16=True))
    vllm = VLLMRolloutEngine(path, gpu_memory_utilization=0.3, max_model_len=512, seed=0, enforce_eager=True)

    gen = torch.Generator().manual_seed(1)
    sequence = torch.randint(3, 32000, (1, 96), generator=gen)
    ids = sequence.to(device)

    def trainer_logprobs():
        with torch.no_grad():
            logits = engine.module(input_ids=ids).logits
        return token_logprobs(logits[:, :-1], ids[:, 1:])[0].float().cpu()

    def vllm_logprobs():
        return torch.tensor(vllm.prompt_logprobs(sequence[0].tolist()))

    first = sync_weights(vllm, engine.module, args.strategy, zero3=args.zero == 3, first_sync=True)
    previous = vllm_logprobs()
    rows = [{"step": 0, "synced": (previous - trainer_logprobs()).abs().mean().item(), "sync_s": first.seconds,
             "sync_bytes": first.bytes}]
    for step in range(1, args.steps + 1):
        vllm.sleep()
        freed = vllm.last_sleep_freed_bytes
        loss = -token_logprobs(engine(input_ids=ids).logits[:, :-1], ids[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        current = trainer_logprobs()
        stats = sync_weights(vllm, engine.module, args.strategy, zero3=args.zero == 3)
        vllm.wake()
        synced = vllm_logprobs()
        rows.append({"step": step, "loss": loss.item(), "synced": (synced - current).abs().mean().item(),
                     "synced_max": (synced - current).abs().max().item(),
                     "stale": (previous - current).abs().mean().item(), "sync_s": stats.seconds,
                     "sync_bytes": stats.bytes, "sleep_freed_gib": freed / 2**30})
        previous = synced
        print(json.dumps(rows[-1]), flush=True)
    # a woken engine still generates from the synced policy
    from grpo.rollout.base import SamplingSettings

    start = time.perf_counter()
    out = vllm.generate([sequence[0, :16].tolist()], SamplingSettings(n=4, max_new_tokens=32))
    rows.append({"generate_s": time.perf_counter() - start, "completions": len(out),
                 "finite_logprobs": all(torch.isfinite(torch.tensor(c.logprobs)).all().item() for c in out)})
    with open(args.out, "w") as fh:
        json.dump({"strategy": args.strategy, "zero": args.zero, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
