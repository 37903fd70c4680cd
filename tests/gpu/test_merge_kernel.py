"""On a GPU: grpo.model.merge_kernel writes W + s * B @ A correctly rounded, where W is bitsandbytes' own
dequantization bit for bit, for 4-bit nf4 bases (blocks of 32 to 128, scales double-quantized or not) and 16-bit
ones, at shapes that do not fill its tiles. (The unfused path it replaces, dequantize_4bit into the engine's tensor
and then addmm_, differs from those values by a rounding step in about 3-5% of the elements:
benchmarks/sync_merge.py.)"""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None
                                or importlib.util.find_spec("bitsandbytes") is None,
                                reason="needs CUDA, Triton and bitsandbytes")

SHAPES = [(300, 192, 8), (512, 3584, 16), (1000, 320, 64)]  # out, in, rank


def four_bit(weight: torch.Tensor, blocksize: int, nested: bool):
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(weight.cpu(), requires_grad=False, blocksize=blocksize, compress_statistics=nested,
                             quant_type="nf4").cuda()


def merged(weight, lora_b, lora_a, scale):
    from grpo.model import merge_kernel

    shape = tuple(weight.quant_state.shape) if weight.__class__.__name__ == "Params4bit" else weight.shape
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    assert merge_kernel.fits(out, weight, lora_b, lora_a)
    return merge_kernel.merge_into(out, weight, lora_b, lora_a, scale)


def layer(rows, columns, rank, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(rows, columns, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
    lora_b = torch.randn(rows, rank, device="cuda", generator=generator) * 0.05
    lora_a = torch.randn(rank, columns, device="cuda", generator=generator) * 0.05
    return weight, lora_b, lora_a


def exact(dense: torch.Tensor, lora_b, lora_a, scale) -> torch.Tensor:
    """W + s * B @ A in fp64 (B and A rounded to bf16 as both paths take them), rounded once to bf16."""
    product = lora_b.to(torch.bfloat16).double() @ lora_a.to(torch.bfloat16).double()
    return (dense.double() + scale * product).to(torch.bfloat16)


def check(fused, reference, terms: torch.Tensor) -> None:
    """Correctly rounded but where the fp32 sum sits within a hair of a rounding boundary; every element within one
    bf16 step, or, where W and s * B @ A nearly cancel, within the fp32 rounding of `terms` (|W| + |s * B @ A|)."""
    assert torch.isfinite(fused).all()
    assert (fused == reference).float().mean() > 0.999
    step = reference.float().abs() * 2.0 ** -7 + terms.float() * 2.0 ** -20
    assert ((fused.float() - reference.float()).abs() <= step).all()


def terms(dense, lora_b, lora_a, scale):
    return dense.float().abs() + scale * (lora_b.float() @ lora_a.float()).abs()


@pytest.mark.parametrize("blocksize,nested", [(32, True), (64, True), (64, False), (128, True)])
@pytest.mark.parametrize("rows,columns,rank", SHAPES)
def test_four_bit_base(rows, columns, rank, blocksize, nested):
    import bitsandbytes.functional as bnbf

    from grpo.model import merge_kernel

    weight, lora_b, lora_a = layer(rows, columns, rank)
    base = four_bit(weight, blocksize, nested)
    if columns % blocksize:  # a block would straddle two rows: left to the unfused path
        assert not merge_kernel.fits(torch.empty(rows, columns, dtype=torch.bfloat16, device="cuda"), base, lora_b,
                                     lora_a)
        return
    # the base alone (B = 0) is bitsandbytes' dequantization, bit for bit
    dense = bnbf.dequantize_4bit(base.data, base.quant_state)
    assert torch.equal(merged(base, torch.zeros_like(lora_b), lora_a, 2.0), dense)
    check(merged(base, lora_b, lora_a, 2.0), exact(dense, lora_b, lora_a, 2.0), terms(dense, lora_b, lora_a, 2.0))


@pytest.mark.parametrize("rows,columns,rank", SHAPES)
def test_sixteen_bit_base(rows, columns, rank):
    weight, lora_b, lora_a = layer(rows, columns, rank, seed=1)
    assert torch.equal(merged(weight, torch.zeros_like(lora_b), lora_a, 0.5), weight)
    check(merged(weight, lora_b, lora_a, 0.5), exact(weight, lora_b, lora_a, 0.5), terms(weight, lora_b, lora_a, 0.5))


def test_what_it_does_not_take():
    """fp4 codes, blocks that straddle rows, another dtype, a transposed view: left to the unfused path."""
    from grpo.model import merge_kernel
    import bitsandbytes as bnb

    weight, lora_b, lora_a = layer(64, 64, 8)
    out = torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")
    fp4 = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="fp4").cuda()
    assert not merge_kernel.fits(out, fp4, lora_b, lora_a)
    straddling = four_bit(layer(64, 96, 8)[0], 64, True)  # 96 columns: a block of 64 crosses into the next row
    assert not merge_kernel.fits(torch.empty(64, 96, dtype=torch.bfloat16, device="cuda"), straddling,
                                 lora_b, layer(64, 96, 8)[2])
    assert not merge_kernel.fits(out, weight.half(), lora_b, lora_a)
    assert not merge_kernel.fits(out.t(), weight, lora_b, lora_a)
    assert merge_kernel.fits(out, weight, lora_b, lora_a)
