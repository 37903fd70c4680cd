"""Routing replay against the rollout engine: the engine generates and returns the experts it routed each token to
(vLLM: `enable_return_routed_experts`), the trainer's forward (transformers; bf16 on a GPU) scores the completions
with that routing replayed and with its own, and the table gives the router agreement and the engine-vs-trainer
log-prob gap both ways (docs/moe.md#routing-replay).

    python scripts/upcycle_moe.py --out /tmp/smollm2-moe --experts 4 --top_k 2
    python benchmarks/routing_replay.py --model /tmp/smollm2-moe --expert_noise 0.02
    python benchmarks/routing_replay.py --model /tmp/smollm2-moe --engine hf --prompts 2 --k 2 --max_new_tokens 16
                                       # the HF engine (CPU too): the engine is the trainer's model, agreement 1

An upcycled model's experts are copies of one MLP, so which expert runs changes nothing until they differ:
--expert_noise moves each expert's weights apart (relative noise) in both the engine's and the trainer's copy.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the grpo package


def moved_experts(model_path: str, noise: float, out: str) -> str:
    """A copy of the model whose experts differ by `noise` x their weights' std (saved for vLLM to load too)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    shutil.rmtree(out, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    return out


def rollout_engine(kind: str, model_path: str, model):
    """The engine that generates, recording its routing: vLLM from the folder, or HF generate on `model` itself."""
    if kind == "vllm":
        from grpo.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(model_path, gpu_memory_utilization=0.3, max_model_len=2048, enable_sleep=False,
                                 enforce_eager=True, record_routing=True)
    from transformers import AutoTokenizer

    from grpo.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(model, AutoTokenizer.from_pretrained(model_path), record_routing=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a mixture-of-experts folder (Mixtral, Qwen2/3-MoE, OLMoE)")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--expert_noise", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--rows_per_forward", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from grpo.model.routing_replay import RouterAgreement, routing_replay_of
    from grpo.rollout.engine import SamplingSettings
    from grpo.train.logprobs import completion_logprobs
    from grpo.train.micro_batches import cut_rows
    from grpo.train.step_data import build_rollout_batch

    # vLLM's in-process engine joins a process group of one, as under the launcher (it reads RANK and the like)
    import socket

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = str(probe.getsockname()[1])
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", port)):
        os.environ.setdefault(key, value)
    model_path = moved_experts(args.model, args.expert_noise, "/tmp/routing_replay_model") \
        if args.expert_noise else args.model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    engine = rollout_engine(args.engine, model_path, model)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 5000, (32,), generator=generator).tolist() for _ in range(args.prompts)]
    completions = engine.generate(prompts, SamplingSettings(n=args.k, max_new_tokens=args.max_new_tokens))
    shapes = sorted({tuple(c.routed_experts.shape[1:]) for c in completions})
    lengths_ok = all(len(c.routed_experts) == len(prompts[c.prompt_index]) + len(c.token_ids) - 1 for c in completions)

    batch = build_rollout_batch(prompts, completions, pad_id=0)
    agreement = RouterAgreement()
    gap = {"replayed": 0.0, "own routing": 0.0}
    tokens = 0.0
    with torch.no_grad():
        for start in range(0, len(completions), args.rows_per_forward):
            part = cut_rows(batch, list(range(start, min(start + args.rows_per_forward, len(completions))))).to(device)
            with routing_replay_of(model).replaying(part.routed_experts, part.attention_mask, agreement):
                replayed, _ = completion_logprobs(model, part, 1.0)
            own, _ = completion_logprobs(model, part, 1.0)
            mask = part.completion_mask
            gap["replayed"] += ((replayed.float() - part.rollout_logprobs).abs() * mask).sum().item()
            gap["own routing"] += ((own.float() - part.rollout_logprobs).abs() * mask).sum().item()
            tokens += mask.sum().item()
    name = f"{os.path.basename(args.model.rstrip('/'))} (expert noise {args.expert_noise})"
    print("| model | engine | sequences | routing [layers, k] | lengths P + C - 1 | router agreement | gap replayed | "
          "gap own routing |\n|---|---|---|---|---|---|---|---|")
    print(f"| {name} | {args.engine} | {len(completions)} | {shapes} | {lengths_ok} | {agreement.share:.4f} | "
          f"{gap['replayed'] / tokens:.5f} | {gap['own routing'] / tokens:.5f} |")


if __name__ == "__main__":
    main()
