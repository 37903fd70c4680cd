"""On a GPU: the recorded merge's Triton kernels (grpo.sync.merge_kernel, used by grpo.sync.in_place_merge) write
round(W + s * B @ A) (to the fp32 sums' rounding), keep every element whose unmerge would miss, and their unmerge
gives the base back bit for bit; a layer whose escapes outgrow their first buffer is merged again with room for them
all."""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                reason="needs CUDA and Triton")

SHAPES = [(300, 192, 8), (512, 3584, 16), (1000, 320, 64), (70, 100, 4)]  # out, in, rank (tiles left partly empty)


def layer(rows, columns, rank, dtype, b_scale, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(rows, columns, device="cuda", generator=generator) * 0.02).to(dtype)
    lora_b = (torch.randn(rows, rank, device="cuda", generator=generator) * b_scale).to(dtype)
    lora_a = ((torch.rand(rank, columns, device="cuda", generator=generator) * 2 - 1) / columns**0.5).to(dtype)
    return weight, lora_b, lora_a


def bits(tensor):
    return tensor.view(torch.int16)


def near_rounded_sum(merged, weight, lora_b, lora_a, scale):
    """merged against round(W + s * B @ A) computed in fp64: equal in all but a few elements, each within one step."""
    value = weight.double() + scale * (lora_b.double() @ lora_a.double())
    step = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[weight.dtype]
    assert (merged == value.to(weight.dtype)).double().mean() > 0.999
    tiny = torch.finfo(weight.dtype).smallest_normal * step
    assert ((merged.double() - value).abs() <= value.abs() * step + tiny + 1e-6 * value.abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_scale", [1e-4, 1e-2, 1.0])
@pytest.mark.parametrize("rows,columns,rank", SHAPES)
def test_the_kernels_merge_and_give_the_base_back_exactly(rows, columns, rank, b_scale, dtype):
    from grpo.sync import in_place_merge, merge_kernel

    weight, lora_b, lora_a = layer(rows, columns, rank, dtype, b_scale)
    original = weight.clone()
    assert merge_kernel.fits_recorded(weight, lora_b)
    record = merge_kernel.merge_recording(weight, lora_b, lora_a, 2.0)
    merge_kernel.read_escape_counts([in_place_merge.MergedLayer(weight, lora_b, lora_a, 2.0, record)])
    if record.needed <= record.escape_index.numel():  # (else some elements were left unmerged: the next test)
        near_rounded_sum(weight, original, lora_b, lora_a, 2.0)
        kept = record.escape_index[:record.escapes].long()
        assert kept.unique().numel() == record.escapes  # each escape in its own slot
        assert torch.equal(record.escape_bits[:record.escapes], bits(original).reshape(-1)[kept])
    merge_kernel.unmerge_recorded(weight, lora_b, lora_a, 2.0, record)
    assert torch.equal(bits(weight), bits(original))


def test_escapes_beyond_the_first_buffer_are_merged_again(monkeypatch):
    from grpo.sync import in_place_merge, merge_record

    monkeypatch.setattr(merge_record, "FIRST_ESCAPE_SHARE", 0.0)  # a first buffer of 1024 escapes per layer
    weight, lora_b, lora_a = layer(1000, 320, 16, torch.bfloat16, 1.0)
    original = weight.clone()
    merge = in_place_merge.InPlaceMerge()
    merge.set_adapter([(weight, lora_b, lora_a, 2.0)])
    assert merge.layers[0].use_kernel
    for _ in range(2):  # the second merge reuses the grown buffer
        merge.merge()
        record = merge.layers[0].record
        assert record.escapes == record.needed > 1024 and record.escape_index.numel() >= record.needed
        near_rounded_sum(weight, original, lora_b, lora_a, 2.0)
        merge.unmerge()
        assert torch.equal(bits(weight), bits(original))
