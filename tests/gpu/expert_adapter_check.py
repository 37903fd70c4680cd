"""GPU check of LoRA on a mixture of experts' fused experts as vLLM 0.26 reads it from a folder: the per-expert
adapter grpo saves beside peft's (lora_adapter/vllm; grpo/sync/expert_adapters.py, docs/moe.md).

    python tests/gpu/expert_adapter_check.py --arch mixtral --out result.json

Builds sync_check's random Mixtral / Qwen3-MoE (8 experts, 2 per token, saved one tensor per expert), puts a LoRA
adapter of rank 16 on attention and every expert, moves it as if trained, saves the final adapter as a run does, then
starts vLLM with `enable_lora` and scores a fixed sequence with `LoRARequest(<out>/lora_adapter/vllm)`. Records the
mean |vLLM log-prob - trainer log-prob| with the adapter, and the same gap without it (the base against the policy:
how far the adapter moved the policy), per token.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402
from sync_check import MODEL_DIR, build_model  # noqa: E402  (beside this script)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=["mixtral", "qwen3_moe"], default="mixtral")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    from grpo.algorithm import token_logprobs
    from grpo.checkpoint.vllm_adapter import write_vllm_adapter
    from grpo.config.options import GRPOConfig
    from grpo.model.loading import load_policy

    path = build_model(f"{MODEL_DIR}-{args.arch}", args.arch)
    cfg = GRPOConfig(model_name_or_path=path, tuning_strategy="lora", lora_rank=16, lora_alpha=32, lora_dropout=0.0)
    policy = load_policy(cfg, path, torch.bfloat16, torch.device("cuda"))
    torch.manual_seed(0)
    with torch.no_grad():  # as if trained: lora_B starts at zero
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn_like(p))
    folder = write_vllm_adapter(policy, tempfile.mkdtemp(prefix="expert-adapter-"), path)
    sequence = torch.randint(3, 32000, (1, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids = sequence.cuda()
        trained = token_logprobs(policy(input_ids=ids).logits[:, :-1], ids[:, 1:])[0].float().cpu()
    policy.cpu()
    torch.cuda.empty_cache()
    llm = LLM(model=path, dtype="bfloat16", enable_lora=True, max_lora_rank=16, max_loras=1, enforce_eager=True,
              gpu_memory_utilization=0.3, max_model_len=512, skip_tokenizer_init=True,
              logprobs_mode="processed_logprobs")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)

    def scored(**request):
        out = llm.generate([TokensPrompt(prompt_token_ids=sequence[0].tolist())], params, use_tqdm=False,
                           **request)[0]
        return torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])

    adapted = scored(lora_request=LoRARequest("policy", 1, folder))
    base = scored()
    result = {"arch": args.arch, "adapter_folder": folder,
              "gap_with_adapter": (adapted - trained).abs().mean().item(),
              "gap_with_adapter_max": (adapted - trained).abs().max().item(),
              "gap_without_adapter": (base - trained).abs().mean().item()}
    print(json.dumps(result), flush=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
