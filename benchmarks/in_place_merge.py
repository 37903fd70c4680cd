"""The in-place merge's cost at a real model's shape (GPU): merge (W' and the 2-bit codes) and unmerge, for every
linear layer of Qwen2.5-7B's shape (28 layers: q, k, v, o, gate, up, down) with a rank-16 adapter, bf16, random
weights; and the memory its records take.

    python benchmarks/in_place_merge.py [--layers 28] [--rank 16] [--b_scale 1e-3] [--profile]

--profile adds the GPU time of each kernel (torch.profiler) for one merge and one unmerge, so that the kernels' own
time shows apart from the launches'.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from grpo.sync.in_place_merge import InPlaceMerge  # noqa: E402

HIDDEN, INTERMEDIATE, KV = 3584, 18944, 512  # Qwen2.5-7B: 28 heads of 128, 4 KV heads


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--b_scale", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN),
              (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * args.layers
    generator = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for rows, columns in shapes:
        weight = (torch.randn(rows, columns, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
        lora_b = (torch.randn(rows, args.rank, device="cuda", generator=generator) * args.b_scale).to(torch.bfloat16)
        lora_a = ((torch.rand(args.rank, columns, device="cuda", generator=generator) * 2 - 1)
                  / columns**0.5).to(torch.bfloat16)
        layers.append((weight, lora_b, lora_a, 2.0))
    checksum = sum(w.float().sum().item() for w, *_ in layers)
    merge = InPlaceMerge()
    merge.set_adapter(layers)
    merge.merge()
    merge.unmerge()  # compiled, records allocated
    merges, unmerges = [], []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        merge.merge()
        torch.cuda.synchronize()
        merges.append(time.perf_counter() - start)
        start = time.perf_counter()
        merge.unmerge()
        torch.cuda.synchronize()
        unmerges.append(time.perf_counter() - start)
    exact = sum(w.float().sum().item() for w, *_ in layers) == checksum
    elements = sum(r * c for r, c in shapes)
    escapes = sum(layer.record.escapes for layer in merge.layers)
    print(f"| layers | parameters | rank | B scale | merge s | unmerge s | records GiB | escapes | base back |")
    print(f"|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(shapes)} | {elements / 1e9:.2f} B | {args.rank} | {args.b_scale:g} | {min(merges):.4f} | "
          f"{min(unmerges):.4f} | {merge.record_bytes / 2**30:.2f} | {escapes / elements:.3%} | {exact} |")
    print(f"GPU: {torch.cuda.get_device_name()}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            merge.merge()
            merge.unmerge()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
