"""GPU kernels of a merged sync at Qwen2.5-7B's shape (28 layers x 7 linears, LoRA rank 16): the ways of writing
W + s * B @ A into bf16 engine tensors in place (grpo.model.weight_sync._lora_merged_into), with W in bf16 (lora) or
4 bits (qlora, nf4 in blocks of 64), against the fp32 merge the streamed sync computes. Best and median of 5.
GPU only (never run by CI):

    python benchmarks/sync_merge.py
"""
import time, torch
import bitsandbytes.functional as F
torch.manual_seed(0)
H, I, KV, L, R = 3584, 18944, 512, 28, 16
shapes = [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I)]
dev = "cuda"
mods = []
for _ in range(L):
    for out, inp in shapes:
        W = (torch.randn(out, inp, device=dev) * 0.02).to(torch.bfloat16)
        q, qs = F.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
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
def copy_only():
    for W, q, qs, A, B, v in mods:
        v.copy_(W)
def dequant_only():
    for W, q, qs, A, B, v in mods:
        F.dequantize_4bit(q, qs, out=v)
results = {}
for fn in [copy_only, dequant_only, lora_copy_addmm, lora_addmm_out, lora_fp32_ref, qlora_copy_addmm, qlora_out_addmm]:
    fn(); torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter(); fn(); torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    results[fn.__name__] = min(times)
    print(f"{fn.__name__:20s} best {min(times)*1000:.1f} ms  median {sorted(times)[2]*1000:.1f} ms", flush=True)
# agreement: the out= variants equal the copy variants
lora_copy_addmm(); a = [m[5].clone() for m in mods[:7]]; lora_addmm_out(); print("lora out= equal:", all(torch.equal(x, m[5]) for x, m in zip(a, mods[:7])))
qlora_copy_addmm(); a = [m[5].clone() for m in mods[:7]]; qlora_out_addmm(); print("qlora out= equal:", all(torch.equal(x, m[5]) for x, m in zip(a, mods[:7])))
