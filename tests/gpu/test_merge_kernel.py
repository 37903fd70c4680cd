"""On a GPU: grpo.sync.merge_kernel writes W + s * B @ A correctly rounded (but where the fp32 sum sits a hair from a
rounding boundary), where W is bitsandbytes' own dequantization bit for bit, for 4-bit nf4 bases (blocks of 32 to 128,
scales double-quantized or not) and 16-bit ones, bf16 and fp16, at shapes that do not fill its tiles; and it refuses
what it cannot write. (The unfused path it replaces, dequantize_4bit into the engine's tensor and then addmm_,
differs from those values by a rounding step in about 3-5% of the elements: benchmarks/sync_merge.py.)"""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None
                                or importlib.util.find_spec("bitsandbytes") is None,
                                reason="needs CUDA, Triton and bitsandbytes")

SHAPES = [(300, 192, 8), (512, 3584, 16), (1000, 320, 64)]  # out, in, rank
DTYPES = [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)]  # the engine's, the LoRA weights'
STEP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}  # one rounding step, relative to the value


def four_bit(weight: torch.Tensor, blocksize: int, nested: bool, **kwargs):
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(weight.cpu(), requires_grad=False, blocksize=blocksize, compress_statistics=nested,
                             quant_type="nf4", **kwargs).cuda()


def merged(weight, lora_b, lora_a, scale, dtype):
    from grpo.sync import merge_kernel

    shape = tuple(weight.quant_state.shape) if weight.__class__.__name__ == "Params4bit" else weight.shape
    out = torch.full(shape, float("nan"), dtype=dtype, device="cuda")  # every element must be written
    assert merge_kernel.fits(out, weight, lora_b, lora_a)
    return merge_kernel.merge_into(out, weight, lora_b, lora_a, scale)


def layer(rows, columns, rank, dtype, lora_dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(rows, columns, device="cuda", generator=generator) * 0.02).to(dtype)
    lora_b = (torch.randn(rows, rank, device="cuda", generator=generator) * 0.05).to(lora_dtype)
    lora_a = (torch.randn(rank, columns, device="cuda", generator=generator) * 0.05).to(lora_dtype)
    return weight, lora_b, lora_a


def check(fused, dense, lora_b, lora_a, scale) -> None:
    """fused against W + s * B @ A in fp64 (B and A rounded to the engine's dtype, as the kernel takes them), rounded
    once: equal but for a few elements, each within one rounding step of the value (or of fp16's subnormals), or of
    the fp32 sums' rounding (rank x 2^-24 of |W| + s * |B| @ |A|) where W and s * B @ A nearly cancel."""
    b, a = lora_b.to(fused.dtype).double(), lora_a.to(fused.dtype).double()
    value = dense.double() + scale * (b @ a)
    reference = value.to(fused.dtype)
    assert torch.isfinite(fused).all()
    assert (fused == reference).double().mean() > 0.999
    sums = (dense.double().abs() + scale * (b.abs() @ a.abs())) * (lora_b.shape[1] + 2) * 2.0 ** -24
    floor = torch.finfo(fused.dtype).smallest_normal * STEP[fused.dtype]  # the step between subnormals
    assert ((fused.double() - value).abs() <= value.abs() * STEP[fused.dtype] + sums + floor).all()


@pytest.mark.parametrize("dtype,lora_dtype", DTYPES)
@pytest.mark.parametrize("blocksize,nested", [(32, True), (64, True), (64, False), (128, True)])
@pytest.mark.parametrize("rows,columns,rank", SHAPES)
def test_four_bit_base(rows, columns, rank, blocksize, nested, dtype, lora_dtype):
    import bitsandbytes.functional as bnbf

    from grpo.sync import merge_kernel

    weight, lora_b, lora_a = layer(rows, columns, rank, dtype, lora_dtype)
    base = four_bit(weight, blocksize, nested)
    if columns % blocksize:  # a block would straddle two rows: left to the unfused path
        assert not merge_kernel.fits(torch.empty(rows, columns, dtype=dtype, device="cuda"), base, lora_b, lora_a)
        return
    # the base alone (B = 0) is bitsandbytes' dequantization, bit for bit
    dense = bnbf.dequantize_4bit(base.data, base.quant_state)
    assert dense.dtype == dtype
    assert torch.equal(merged(base, torch.zeros_like(lora_b), lora_a, 2.0, dtype), dense)
    check(merged(base, lora_b, lora_a, 2.0, dtype), dense, lora_b, lora_a, 2.0)


@pytest.mark.parametrize("dtype,lora_dtype", DTYPES)
@pytest.mark.parametrize("rows,columns,rank", SHAPES)
def test_sixteen_bit_base(rows, columns, rank, dtype, lora_dtype):
    weight, lora_b, lora_a = layer(rows, columns, rank, dtype, lora_dtype, seed=1)
    assert torch.equal(merged(weight, torch.zeros_like(lora_b), lora_a, 0.5, dtype), weight)
    check(merged(weight, lora_b, lora_a, 0.5, dtype), weight, lora_b, lora_a, 0.5)


def test_what_it_does_not_take():
    """fp4 codes, codes stored in another dtype, blocks that straddle rows, a rank above MAX_RANK, another dtype, a
    transposed view, B on the CPU: left to the unfused path."""
    import bitsandbytes as bnb

    from grpo.sync import merge_kernel

    weight, lora_b, lora_a = layer(64, 128, 8, torch.bfloat16, torch.float32)
    out = torch.empty(64, 128, dtype=torch.bfloat16, device="cuda")
    assert merge_kernel.fits(out, weight, lora_b, lora_a)
    assert merge_kernel.fits(out, four_bit(weight, 64, True), lora_b, lora_a)
    fp4 = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="fp4").cuda()
    assert not merge_kernel.fits(out, fp4, lora_b, lora_a)
    assert not merge_kernel.fits(out, four_bit(weight, 64, True, quant_storage=torch.bfloat16), lora_b, lora_a)
    straddling, _, straddling_a = layer(64, 96, 8, torch.bfloat16, torch.float32)  # 96 columns: blocks of 64 cross
    assert not merge_kernel.fits(torch.empty(64, 96, dtype=torch.bfloat16, device="cuda"),
                                 four_bit(straddling, 64, True), lora_b, straddling_a)
    _, wide_b, wide_a = layer(64, 128, merge_kernel.MAX_RANK * 2, torch.bfloat16, torch.float32)
    assert not merge_kernel.fits(out, weight, wide_b, wide_a)
    assert not merge_kernel.fits(out, weight.half(), lora_b, lora_a)
    assert not merge_kernel.fits(torch.empty(128, 64, dtype=torch.bfloat16, device="cuda").t(), weight, lora_b, lora_a)
    assert not merge_kernel.fits(out, weight, lora_b.cpu(), lora_a)
