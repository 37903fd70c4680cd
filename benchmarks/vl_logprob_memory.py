"""Peak memory of one vision-language loss pass: the model's whole logits against its hidden states (CPU, Linux).

    python benchmarks/vl_logprob_memory.py [--completion 2048] [--rows 2] [--chunk 1024]

A random Qwen2-VL built in code with Qwen2.5-VL's vocabulary (151,936 tokens) and a small body, rows of one image
(4 image tokens) + a 32-token prompt + a completion: completion_logprobs forward and backward, once with
--logprob_chunk_tokens 0 (the model's own [N, T, vocab] logits) and once with the hidden-state path (the multimodal
body's last hidden states, the output layer `--chunk` tokens at a time). Each mode runs in a fresh process; the figure
is its peak RSS (VmHWM) during the pass, over what it held before the pass. fp32 on CPU, so a bf16 GPU holds half.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's grpo

VOCAB = 151_936


def _peak_gib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def measure(chunk: int, completion: int, rows: int) -> dict:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from grpo.model.vision import PromptImages
    from grpo.rollout.engine import Completion
    from grpo.train.logprobs import completion_logprobs
    from grpo.train.step_data import build_rollout_batch

    torch.manual_seed(0)
    image, start, end, video = VOCAB - 4, VOCAB - 3, VOCAB - 2, VOCAB - 1
    text = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=completion + 256,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}, tie_word_embeddings=False)
    vision = dict(depth=1, embed_dim=32, hidden_size=128, mlp_ratio=2, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False))
    # one 56 x 56 image: a 4 x 4 grid of 14-pixel patches, merged 2 x 2 into 4 image tokens
    images = PromptImages([], torch.randn(16, 3 * 2 * 14 * 14), torch.tensor([[1, 4, 4]]), image)
    prompt = [1, 2, start] + [image] * 4 + [end] + list(range(100, 124))
    completions = [Completion(0, torch.randint(1000, VOCAB - 10, (completion,)).tolist(), [], "length")
                   for _ in range(rows)]
    batch = build_rollout_batch([prompt], completions, 0, images=[images])
    _reset_peak()
    before = _peak_gib()
    logprobs, _ = completion_logprobs(model, batch, 1.0, chunk_tokens=chunk)
    logprobs.sum().backward()
    return {"chunk_tokens": chunk, "pass_gib": round(_peak_gib() - before, 3),
            "logits_gib": round(rows * completion * VOCAB * 4 / 2**30, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completion", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: measure this chunk size
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.completion, args.rows)))
        return
    print(f"{args.rows} rows x {args.completion} completion tokens, vocabulary {VOCAB:,}, fp32 on CPU")
    for chunk in (0, args.chunk):
        out = subprocess.run([sys.executable, __file__, "--one", str(chunk), "--completion", str(args.completion),
                              "--rows", str(args.rows)], capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        path = "whole logits" if chunk == 0 else f"hidden states, chunks of {chunk}"
        print(f"{path:34s} pass peak +{result['pass_gib']:.2f} GiB (one [N, T, V] fp32 logits tensor: "
              f"{result['logits_gib']:.2f} GiB)")


if __name__ == "__main__":
    main()
