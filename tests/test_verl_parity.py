"""Where grpo's losses and corrections are said to be verl's (0.9.1), value by value, against numbers worked out by
hand: geometric_mask is verl's rollout_rs=seq_mean_k1 (its band holds the geometric mean of rollout / trainer, each
token's log-ratio capped at 20 first), gmpo weighs a sequence by the geometric mean of its correction weights (verl's
geo_mean), and what still differs (a rejected token stays in grpo's denominator) is pinned down as documented in
docs/algorithm.md."""
import math

import pytest
import torch

from grpo.algorithm import LossSettings, gmpo_sequence_weights, policy_loss, rollout_correction

E = math.exp


# ------------------------------------------------------------------------ geometric_mask = verl's seq_mean_k1
def band_inputs():
    # d = trainer - rollout per token; a 0 in the mask marks padding (its d would be far off)
    #   A [-0.1, -0.2]          G = -0.15: e^G = 0.8607 (ratio below 1), e^-G = 1.1618
    #   B [ 0.1,  0.2]          G = +0.15: e^G = 1.1618,                  e^-G = 0.8607
    #   C [ 0.3, -0.3]          G =  0:    1 either way
    #   D [ 0.2, (pad) 5.0]     G = +0.2 over its one token: e^G = 1.2214, e^-G = 0.8187
    #                           (with the padding counted in n it would be 0.1 and e^-0.1 = 0.905, inside)
    d = torch.tensor([[-0.1, -0.2], [0.1, 0.2], [0.3, -0.3], [0.2, 5.0]], dtype=torch.float64)
    trainer = torch.full_like(d, -1.0)
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    return trainer, trainer - d, mask


def test_band_0_9_to_1_2_holds_the_inverse_geometric_mean_as_verl_does():
    trainer, rollout, mask = band_inputs()
    w, capped, masked = rollout_correction(trainer, rollout, mask, "geometric_mask", low=0.9, high=1.2)
    # verl keeps a sequence when 0.9 <= e^-G <= 1.2, i.e. 0.833 <= e^G <= 1.111:
    #   A 1.1618 kept, B 0.8607 out, C 1 kept, D 0.8187 out
    assert (w * mask).tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
    assert masked.tolist() == [[False, False], [True, True], [False, False], [True, False]]
    assert not capped.any()
    # the rule before (0.9 <= e^G <= 1.2) kept B and C and dropped A: that mask is no longer produced
    old_rule = [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    assert (w * mask).tolist() != old_rule


def test_the_band_in_ratio_terms_is_its_reciprocal():
    # the same masks as a band on e^G, written the other way round: 1/1.2 .. 1/0.9 on the inverse
    trainer, rollout, mask = band_inputs()
    w_verl, _, _ = rollout_correction(trainer, rollout, mask, "geometric_mask", low=0.9, high=1.2)
    # swapping trainer and rollout flips G's sign: the band 0.9 .. 1.2 then holds e^G itself (the old rule)
    w_swapped, _, _ = rollout_correction(rollout, trainer, mask, "geometric_mask", low=0.9, high=1.2)
    assert (w_swapped * mask).tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    w_inverse, _, _ = rollout_correction(rollout, trainer, mask, "geometric_mask", low=1 / 1.2, high=1 / 0.9)
    torch.testing.assert_close(w_inverse * mask, w_verl * mask)


def test_default_band_edge():
    # G = +0.001 on every token: e^G = 1.0010005 is above 1.001, e^-G = 0.9990005 is inside 0.999 .. 1.001
    trainer = torch.full((1, 3), -2.0, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    w, _, _ = rollout_correction(trainer, trainer - 0.001, mask, "geometric_mask")
    assert w.tolist() == [[1.0, 1.0, 1.0]]
    # G = -0.001: e^-G = 1.0010005 is above the band
    w, _, masked = rollout_correction(trainer, trainer + 0.001, mask, "geometric_mask")
    assert w.tolist() == [[0.0, 0.0, 0.0]] and masked.all()


def test_each_tokens_log_ratio_is_capped_at_20_before_the_mean():
    # d = [50, -19.9]: capped [20, -19.9], mean 0.05 -> e^-0.05 = 0.9512, inside 0.9 .. 1.2 (verl caps per token);
    # the uncapped mean 15.05 would be far out
    trainer = torch.tensor([[0.0, -19.9]], dtype=torch.float64)
    rollout = torch.tensor([[-50.0, 0.0]], dtype=torch.float64)
    w, _, masked = rollout_correction(trainer, rollout, torch.ones(1, 2, dtype=torch.float64), "geometric_mask",
                                      low=0.9, high=1.2)
    assert w.tolist() == [[1.0, 1.0]] and not masked.any()


# --------------------------------------------------------- a rejected token stays in grpo's denominator (not verl's)
def rejected_row_inputs():
    # ratios 1 (lp = old), A = [+1, -1]: ppo_clip's pg_t = -A; row 0 (3 tokens) kept, row 1 (2 tokens) rejected
    old = torch.full((2, 3), -1.0)
    lp = old.clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # geometric_mask's weights
    return lp, old, torch.tensor([1.0, -1.0]), mask, weights


def test_token_mean_keeps_rejected_tokens_in_the_denominator():
    lp, old, adv, mask, weights = rejected_row_inputs()
    loss, _ = policy_loss(lp, old, adv, mask, LossSettings(), is_weights=weights)
    # grpo: (3 * -1 + 2 * 0) / 5 tokens = -0.6; verl drops row 1 from the mask: -3 / 3 = -1.0
    assert loss.item() == pytest.approx(-0.6)
    verl = (-1.0 * 3) / 3
    assert loss.item() == pytest.approx(verl * 3 / 5)  # grpo = verl x kept tokens / all tokens


def test_seq_mean_token_mean_matches_verl_for_a_rejected_sequence():
    lp, old, adv, mask, weights = rejected_row_inputs()
    loss, _ = policy_loss(lp, old, adv, mask, LossSettings(aggregation="seq_mean_token_mean"), is_weights=weights)
    # grpo: (-1 + 0) / 2 sequences; verl: row 1 has no token left (it adds nothing) over its global batch size of
    # 2 sequences (the mini-batch's, rejected ones included): the same -0.5
    assert loss.item() == pytest.approx(-0.5)


def test_a_rejected_sequence_keeps_its_kl_term():
    lp, old, adv, mask, weights = rejected_row_inputs()
    ref = old - torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0]])  # k1 = lp - ref: 0 on row 0, 0.5 on row 1
    settings = LossSettings(beta=0.1, kl_estimator="k1")
    loss, _ = policy_loss(lp, old, adv, mask, settings, ref_logprobs=ref, is_weights=weights)
    # grpo: (-3 + 0.1 * (0.5 + 0.5)) / 5 = -0.58; verl (row 1 out of the mask): -3 / 3 + 0.1 * 0 = -1.0
    assert loss.item() == pytest.approx(-0.58)


# --------------------------------------------------------------- gmpo: one weight per sequence, their geometric mean
def test_gmpo_sequence_weights_by_hand():
    w = torch.tensor([[2.0, 0.5, 9.0], [E(0.4), 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    seq = gmpo_sequence_weights(w, mask)
    # row 0: sqrt(2 * 0.5) = 1 (the padding's 9 is not counted; the arithmetic mean would be 1.25)
    # row 1: exp((0.4 + ln 1e-10) / 2) = exp(-11.3129) = 1.2214e-5, verl's floor on a zero weight
    # row 2: every weight 0 (a rejected sequence): exactly 0
    # row 3: no token: exp(0) = 1 (it reaches no loss)
    expected = [1.0, E((0.4 + math.log(1e-10)) / 2), 0.0, 1.0]
    torch.testing.assert_close(seq, torch.tensor(expected).unsqueeze(1).expand(4, 3), rtol=1e-5, atol=0.0)


def test_one_zero_weight_of_a_hundred_scales_the_sequence_by_0_79():
    w = torch.ones(1, 100)
    w[0, 37] = 0.0
    seq = gmpo_sequence_weights(w, torch.ones(1, 100))
    assert seq[0, 0].item() == pytest.approx(1e-10 ** 0.01, rel=1e-5)  # 0.7943


def test_gmpo_loss_uses_the_geometric_mean_of_token_weights():
    # ratios 1 -> R_i = 1, pg_i = -A_i; token_truncate-like weights [2, 0.5] on row 0, icepop-like [e^0.4, 0] on row 1
    old = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2)
    w = torch.tensor([[2.0, 0.5], [E(0.4), 0.0]])
    settings = LossSettings(loss_type="gmpo", aggregation="seq_mean_token_mean")
    loss, m = policy_loss(lp, old, adv, mask, settings, is_weights=w)
    loss.backward()
    w1 = E((0.4 + math.log(1e-10)) / 2)
    # verl's geo_mean: mean_i(-A_i * R_i * W_i) = (-1 * 1 + 1 * w1) / 2
    assert loss.item() == pytest.approx((-1.0 + w1) / 2, abs=1e-7)
    # the token-weighted loss before: mean_t(w_t) per sequence, (-1.25 + 0.7459) / 2 = -0.2521; no longer produced
    old_value = (-(2.0 + 0.5) / 2 + (E(0.4) + 0.0) / 2) / 2
    assert abs(loss.item() - old_value) > 0.2
    # gradient: -A_i R_i W_i / (n_i * 2 sequences) on every token (no bound held)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, -0.25], [w1 / 4, w1 / 4]]))


def test_gmpo_with_a_rejected_sequence_gives_it_nothing():
    # geometric_mask's weights: row 1 rejected -> its loss and gradient are exactly 0, as verl's mask gives
    old = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    lp = (old + torch.tensor([[0.1, 0.1], [0.3, -0.2]])).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0])
    w = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    loss, _ = policy_loss(lp, old, adv, torch.ones(2, 2), LossSettings(loss_type="gmpo",
                                                                      aggregation="seq_mean_token_mean"),
                          is_weights=w)
    loss.backward()
    # row 0: l = [0.1, 0.1] inside +-0.2: R_0 = e^0.1, pg_0 = -2 e^0.1; over 2 sequences
    assert loss.item() == pytest.approx(-2 * E(0.1) / 2, abs=1e-6)
    assert torch.all(lp.grad[1] == 0.0)


def test_sequence_wide_weights_are_unchanged_under_gmpo():
    # sequence_truncate's weight is the same on every token: its geometric mean is itself
    w = torch.tensor([[1.7, 1.7, 1.7], [0.3, 0.3, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(gmpo_sequence_weights(w, mask), torch.tensor([[1.7] * 3, [0.3] * 3]))


# ------------------------------------------------------------------------------ gmpo's clip at verl's defaults
def test_gmpo_at_the_default_clip_is_verls_default():
    # verl's clip_ratio_low / clip_ratio_high default to 0.2 (and take precedence over clip_ratio); so do grpo's eps.
    # l = [0.3, 0.1], A = +1: min(l, clip(l, -0.2, 0.2)) = [0.2, 0.1] -> R = e^0.15 (at 0.4 it would be e^0.2)
    settings = LossSettings(loss_type="gmpo", aggregation="seq_mean_token_mean")
    assert (settings.eps_low, settings.upper_eps) == (0.2, 0.2)
    old = torch.tensor([[-1.0, -1.0]])
    lp = old + torch.tensor([[0.3, 0.1]])
    loss, _ = policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), settings)
    assert loss.item() == pytest.approx(-E(0.15), abs=1e-6)
    wide, _ = policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2),
                          LossSettings(loss_type="gmpo", eps_low=0.4, eps_high=0.4, aggregation="seq_mean_token_mean"))
    assert wide.item() == pytest.approx(-E(0.2), abs=1e-6)
