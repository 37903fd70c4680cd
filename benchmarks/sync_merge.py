"""GPU kernels of a merged sync at Qwen2.5-7B's shape (28 layers x 7 linears, LoRA rank 16): the ways of writing
W + s * B @ A into bf16 engine tensors in place (grpo.sync.weight_sync._lora_merged_into), with W in bf16 (lora) or
4 bits (qlora, nf4 in blocks of BLOCK, default 32 as qlora's default base, scales double-quantized), against the fp32
merge the streamed sync computes, and the one-pass kernel of grpo.sync.merge_kernel. Best and median of 5.
GPU only (never run by CI):

    python benchmarks/sync_merge.py
    BLOCK=64 python benchmarks/sync_merge.py     # bitsandbytes' stock base
"""
import os, sys, time, torch
import bitsandbytes as bnb
import bitsandbytes.functional as F
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.sync import merge_kernel
BLOCK = int(os.environ.get("BLOCK", "32"))
torch.manual_seed(0)
H, I, KV, L, R = 3584, 18944, 512, 28, 16
shapes = [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I)]
dev = "cuda"
mods = []
for _ in range(L):
    for out, inp in shapes:
        W = (torch.randn(out, inp, device=dev) * 0.02).to(torch.bfloat16)
        p4 = bnb.nn.Params4bit(W.cpu(), requires_grad=False, blocksize=BLOCK, compress_statistics=True,
                               quant_type="nf4").cuda()
        q, qs = p4, p4.quant_state
        A = torch.randn(R, inp, device=dev) * 0.01
        B = torch.randn(out, R, device=dev) * 0.01
        view = torch.empty(out, inp, device=dev, dtype=torch.bfloat16)
        mods.append((W, q, qs, A, B, view))
s = 2.0
def lora_copy_addmm():
    for W, q, qs, A, B, v in mods:
        v.copy_(W); v.addmm_(B.to(v.dtype), A.to(v.dtype), alpha=s)
def lora_addmm_out():
    for W, q, qs, A, B, v in mods:
        torch.addmm(W, B.to(v.dtype), A.to(v.dtype), alpha=s, out=v)
def lora_fp32_ref():
    for W, q, qs, A, B, v in mods:
        v.copy_((W.float() + s * (B @ A)).to(v.dtype))
def qlora_copy_addmm():
    for W, q, qs, A, B, v in mods:
        v.copy_(F.dequantize_4bit(q, qs)); v.addmm_(B.to(v.dtype), A.to(v.dtype), alpha=s)
def qlora_out_addmm():
    for W, q, qs, A, B, v in mods:
        F.dequantize_4bit(q, qs, out=v); v.addmm_(B.to(v.dtype), A.to(v.dtype), alpha=s)
def lora_fused():
    for W, q, qs, A, B, v in mods:
        merge_kernel.merge_into(v, W, B, A, s)
def qlora_fused():
    for W, q, qs, A, B, v in mods:
        merge_kernel.merge_into(v, q, B, A, s)
def copy_only():
    for W, q, qs, A, B, v in mods:
        v.copy_(W)
def dequant_only():
    for W, q, qs, A, B, v in mods:
        F.dequantize_4bit(q, qs, out=v)
results = {}
for fn in [copy_only, dequant_only, lora_copy_addmm, lora_addmm_out, lora_fp32_ref, lora_fused, qlora_copy_addmm,
           qlora_out_addmm, qlora_fused]:
    fn(); torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter(); fn(); torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    results[fn.__name__] = min(times)
    print(f"{fn.__name__:20s} best {min(times)*1000:.1f} ms  median {sorted(times)[2]*1000:.1f} ms", flush=True)
# agreement: the out= variants equal the copy variants
lora_copy_addmm(); a = [m[5].clone() for m in mods[:7]]; lora_addmm_out(); print("lora out= equal:", all(torch.equal(x, m[5]) for x, m in zip(a, mods[:7])))
qlora_copy_addmm(); a = [m[5].clone() for m in mods[:7]]; qlora_out_addmm(); print("qlora out= equal:", all(torch.equal(x, m[5]) for x, m in zip(a, mods[:7])))
# the one-pass kernel against the unfused path: share of equal elements, largest difference
for unfused_fn, fused_fn in ((lora_copy_addmm, lora_fused), (qlora_out_addmm, qlora_fused)):
    unfused_fn(); a = [m[5].clone() for m in mods[:7]]; fused_fn()
    same = sum((x == m[5]).sum().item() for x, m in zip(a, mods[:7])) / sum(x.numel() for x in a)
    worst = max((x.float() - m[5].float()).abs().max().item() for x, m in zip(a, mods[:7]))
    print(f"{fused_fn.__name__} vs {unfused_fn.__name__}: {same:.6f} equal, largest difference {worst:.2e}")
