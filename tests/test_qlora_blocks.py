"""--qlora_block_scale mse: the scale search, against numbers worked by hand, and bitsandbytes storing its result."""
import pytest
import torch

from grpo.model.qlora_rounding import SCALE_FRACTIONS, codebook, mse_block_rounding

NF4_BELOW_ONE = 0.7229568362236023  # nf4's second-largest code


def test_one_large_weight_no_longer_sets_the_block_scale():
    """A block of 32: one weight 1.0, 31 weights 0.6. nf4 codes near 0.6: 0.5626170 and 0.7229568.

    absmax (s = 1):   0.6 -> 0.5626170, error 31 * 0.0373830^2 = 0.04332
    s = 0.84:         0.6 / 0.84 = 0.714 -> 0.7229568, 0.84 * 0.7229568 = 0.6072837;
                      1.0 -> code 1 -> 0.84;  error 31 * 0.0072837^2 + 0.16^2 = 0.00164 + 0.0256 = 0.02724
    s = 0.83:         0.83 * 0.7229568 = 0.6000542;  error 31 * 0.0000542^2 + 0.17^2 = 0.02890
    s = 0.85:         0.85 * 0.7229568 = 0.6145133;  error 31 * 0.0145133^2 + 0.15^2 = 0.02903
    s = 0.86:         0.6 / 0.86 = 0.698 -> 0.7229568 (the midpoint is 0.6428), 0.6217429; error 0.03425
    so s = 0.84 of the grid's fractions (steps of 0.01)."""
    block = torch.full((32,), 0.6)
    block[5] = 1.0
    rounded = mse_block_rounding(block, codebook("nf4"), 32)
    expected = torch.full((32,), 0.84 * NF4_BELOW_ONE)
    expected[5] = 0.84
    torch.testing.assert_close(rounded, expected, atol=1e-6, rtol=0)
    error = (rounded - block).square().sum().item()
    assert error == pytest.approx(31 * (0.84 * NF4_BELOW_ONE - 0.6) ** 2 + 0.16 ** 2, abs=1e-6)
    assert error == pytest.approx(0.02724, abs=1e-5)
    # the same block in its own sign: the negative side has other codes, and -1.0 still takes the code -1
    flipped = mse_block_rounding(-block, codebook("nf4"), 32)
    assert flipped.abs().max().item() < 1.0 and flipped[5].item() == flipped.min().item()


def test_a_block_already_on_the_codes_keeps_its_largest_magnitude_as_scale():
    codes = codebook("nf4")
    block = torch.cat([codes, codes]) * 0.37  # every nf4 code once, twice: absmax rounding is exact
    torch.testing.assert_close(mse_block_rounding(block, codes, 32), block, atol=1e-7, rtol=0)
    zeros = torch.zeros(64)
    assert torch.equal(mse_block_rounding(zeros, codes, 32), zeros)  # no division by a zero scale


@pytest.mark.parametrize("quant_type,block_size", [("nf4", 32), ("nf4", 64), ("fp4", 32)])
def test_bitsandbytes_stores_the_searched_rounding_exactly_and_it_beats_absmax(quant_type, block_size):
    import bitsandbytes.functional as bnbf

    from grpo.model.qlora_rounding import round_4bit

    torch.manual_seed(0)
    weight = torch.distributions.StudentT(3.0).sample((96, 128)) * 0.02  # heavy-tailed, like trained weights
    searched = mse_block_rounding(weight, codebook(quant_type), block_size)
    assert searched.shape == weight.shape and searched.dtype == torch.float32
    # its largest magnitude per block is the chosen scale, so bitsandbytes' absmax quantization keeps it as it is
    # (scales kept in 32 bits here; double quantization rounds them to 8 bits as for any 4-bit base)
    torch.testing.assert_close(round_4bit(searched, quant_type, block_size, double_quant=False), searched,
                               atol=1e-7, rtol=1e-6)
    q, state = bnbf.quantize_4bit(searched, blocksize=block_size, quant_type=quant_type, compress_statistics=False)
    largest = searched.reshape(-1, block_size).abs().amax(1)
    torch.testing.assert_close(state.absmax, largest)
    fractions = largest / weight.reshape(-1, block_size).abs().amax(1)
    assert fractions.min().item() >= SCALE_FRACTIONS[0].item() - 1e-6 and fractions.max().item() <= 1 + 1e-6
    # block by block, never worse than bitsandbytes' own rounding, and better overall
    per_block = lambda rounded: (rounded - weight).reshape(-1, block_size).square().sum(1)  # noqa: E731
    absmax = round_4bit(weight, quant_type, block_size, double_quant=False)
    assert (per_block(searched) <= per_block(absmax) + 1e-9).all()
    assert per_block(searched).sum() < 0.97 * per_block(absmax).sum()


def test_the_search_is_the_brute_force_one_in_any_chunks():
    """Every block's rounding at every scale by the nearest code (argmin over the 16), the least error kept."""
    torch.manual_seed(1)
    weight = torch.distributions.StudentT(3.0).sample((12, 64)) * 0.02
    codes = codebook("nf4")
    blocks = weight.reshape(-1, 32)
    best, best_error = None, torch.full((blocks.shape[0], 1), float("inf"))
    for fraction in SCALE_FRACTIONS.tolist():
        scale = blocks.abs().amax(1, keepdim=True) * fraction
        nearest = codes[((blocks / scale).clamp(-1, 1).unsqueeze(-1) - codes).abs().argmin(-1)] * scale
        error = (nearest - blocks).square().sum(1, keepdim=True)
        best = nearest if best is None else torch.where(error < best_error, nearest, best)
        best_error = torch.minimum(error, best_error)
    expected = best.reshape(weight.shape)
    torch.testing.assert_close(mse_block_rounding(weight, codes, 32), expected, atol=0, rtol=0)
    torch.testing.assert_close(mse_block_rounding(weight, codes, 32, chunk=96), expected, atol=0, rtol=0)
