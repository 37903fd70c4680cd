"""The policy losses beside PPO's clip (CISPO, SAPO, GMPO), the rollout/trainer mismatch corrections, and the two
edge cases of the shared math (the log-ratio cap, the rows that count in seq_mean_token_sum_norm), against numbers
worked out by hand."""
import math

import pytest
import torch

from grpo.algorithm import (LossSettings, aggregate, aggregation_normaliser, importance_ratio, policy_loss,
                            rollout_correction)

LOSS_TYPES = ("ppo_clip", "cispo", "sapo", "gmpo")


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ratios r = [[1.5, 0.5], [1.1, 1.0]] over old = -1 everywhere, A = [+1, -2], every token in the mask
OLD = torch.full((2, 2), -1.0)
RATIOS = [[1.5, 0.5], [1.1, 1.0]]
ADV = torch.tensor([1.0, -2.0])
MASK = torch.ones(2, 2)


def ratio_inputs():
    return (OLD + torch.tensor(RATIOS).log()).requires_grad_(True)


# ------------------------------------------------------------------------------------------------------ CISPO
def test_cispo_value_and_gradient_by_hand():
    lp = ratio_inputs()
    loss, m = policy_loss(lp, OLD, ADV, MASK, LossSettings(loss_type="cispo", eps_low=0.2, eps_high=0.28))
    loss.backward()
    # weights clip(r, 0.8, 1.28) = [[1.28, 0.8], [1.1, 1.0]], stop-gradient; lp = -1 + ln r
    #   pg = -w * A * lp:  row 0 (A = 1):  -1.28 * (-1 + ln 1.5), -0.8 * (-1 + ln 0.5)
    #                      row 1 (A = -2):  2.2 * (-1 + ln 1.1),   2.0 * (-1)
    pg = [-1.28 * (-1 + math.log(1.5)), -0.8 * (-1 + math.log(0.5)), 2.2 * (-1 + math.log(1.1)), -2.0]
    assert loss.item() == pytest.approx(sum(pg) / 4, abs=1e-6)        # -0.468699
    # d loss / d lp = -w * A / 4: every token has a gradient, the clipped ones too (PPO's clip drops token 0,0)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28 / 4, -0.8 / 4], [2.2 / 4, 2.0 / 4]]))
    # the weight was clipped on tokens (0, 0) above and (0, 1) below, whatever A: 1/4 each
    assert m["clip_frac_high"] == pytest.approx(0.25) and m["clip_frac_low"] == pytest.approx(0.25)


def test_cispo_keeps_the_gradient_ppo_clip_drops():
    # one token, A = +1, ratio 1.5 above 1 + eps_high: PPO's min takes the clipped constant (no gradient);
    # CISPO's gradient is -clip(1.5) * A = -1.28
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(1.5)).requires_grad_(True)
    for loss_type, grad in (("ppo_clip", 0.0), ("cispo", -1.28)):
        lp.grad = None
        loss, _ = policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 1),
                              LossSettings(loss_type=loss_type, eps_low=0.2, eps_high=0.28))
        loss.backward()
        assert lp.grad.item() == pytest.approx(grad, abs=1e-6), loss_type


# ------------------------------------------------------------------------------------------------------- SAPO
def test_sapo_value_and_gradient_by_hand():
    lp = ratio_inputs()
    loss, m = policy_loss(lp, OLD, ADV, MASK, LossSettings(loss_type="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05))
    loss.backward()
    # f(r) = 4 / tau * sigmoid(tau (r - 1)); tau = 1 on row 0 (A > 0), 1.05 on row 1; pg = -f(r) * A
    f = [4 * sigmoid(0.5), 4 * sigmoid(-0.5), 4 / 1.05 * sigmoid(0.105), 4 / 1.05 * 0.5]  # 2.4898 1.5102 2.0047 1.9048
    pg = [-f[0], -f[1], 2 * f[2], 2 * f[3]]
    assert loss.item() == pytest.approx(sum(pg) / 4, abs=1e-6)        # 0.954717
    # d pg / d lp = -A * f'(r) * r with f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1))
    def slope(tau, r):
        s = sigmoid(tau * (r - 1))
        return 4 * s * (1 - s) * r
    expected = [[-slope(1.0, 1.5) / 4, -slope(1.0, 0.5) / 4], [2 * slope(1.05, 1.1) / 4, 2 * 1.0 / 4]]
    torch.testing.assert_close(lp.grad, torch.tensor(expected))
    assert m["clip_frac"] == 0.0  # nothing is clipped: the gate is smooth


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    # at r = 1 the gate's slope is 1 for any tau: the gradient equals PPO's, -A / n per token
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    adv = torch.tensor([0.7, -1.3])
    grads = {}
    for loss_type in ("ppo_clip", "sapo"):
        lp = old.clone().requires_grad_(True)
        loss, _ = policy_loss(lp, old, adv, MASK, LossSettings(loss_type=loss_type, sapo_tau_pos=3.0,
                                                               sapo_tau_neg=0.5))
        loss.backward()
        grads[loss_type] = lp.grad
    torch.testing.assert_close(grads["sapo"], grads["ppo_clip"])
    torch.testing.assert_close(grads["sapo"], torch.tensor([[-0.7, -0.7], [1.3, 1.3]]) / 4)


# ------------------------------------------------------------------------------------------------------- GMPO
def gmpo_inputs():
    # log-ratios [[0.6, -0.1, 0.2], [0.5, -0.7, (masked) 9.0]], A = [+1, -1]
    old = torch.tensor([[-1.0, -2.0, -1.5], [-0.5, -3.0, -3.0]])
    lp = (old + torch.tensor([[0.6, -0.1, 0.2], [0.5, -0.7, 9.0]])).requires_grad_(True)
    return lp, old, torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_gmpo_value_and_gradient_by_hand():
    lp, old, adv, mask = gmpo_inputs()
    settings = LossSettings(loss_type="gmpo", eps_low=0.4, eps_high=0.4, aggregation="seq_mean_token_mean")
    loss, m = policy_loss(lp, old, adv, mask, settings)
    loss.backward()
    # row 0 (A > 0): min(l, clip(l, -0.4, 0.4)) = [0.4, -0.1, 0.2]: mean 0.5 / 3 -> R_0 = e^(1/6) = 1.181360
    # row 1 (A < 0): max(l, clip(l))            = [0.5, -0.4]:       mean 0.1 / 2 -> R_1 = e^0.05  = 1.051271
    r0, r1 = math.exp(0.5 / 3), math.exp(0.05)
    assert loss.item() == pytest.approx((-r0 + r1) / 2, abs=1e-6)     # -0.065045, verl's mean over sequences
    # gradient: -A_i R_i / (n_i * 2 sequences) on the tokens whose unclipped l was kept, 0 on the clipped ones
    expected = [[0.0, -r0 / 6, -r0 / 6], [r1 / 4, 0.0, 0.0]]
    torch.testing.assert_close(lp.grad, torch.tensor(expected))
    # clipped where the bound held: (0, 0) above with A > 0, (1, 1) below with A < 0; 1 / 5 each
    assert m["clip_frac_high"] == pytest.approx(0.2) and m["clip_frac_low"] == pytest.approx(0.2)


def test_gmpo_one_token_completions_are_ppo_clip_in_log_space():
    # with one token, R = exp(pessimistic clip of l) = PPO's clip with ratio bounds e^-eps .. e^eps
    old = torch.tensor([[-1.0], [-1.0], [-2.0], [-0.3]])
    lp = old + torch.tensor([[0.9], [-0.9], [0.1], [-0.05]])
    adv = torch.tensor([1.0, -1.0, -0.5, 2.0])
    gmpo, _ = policy_loss(lp, old, adv, torch.ones(4, 1), LossSettings(loss_type="gmpo", eps_low=0.4, eps_high=0.4))
    ppo, _ = policy_loss(lp, old, adv, torch.ones(4, 1),
                         LossSettings(eps_low=1 - math.exp(-0.4), eps_high=math.exp(0.4) - 1))
    assert gmpo.item() == pytest.approx(ppo.item(), abs=1e-6)


# -------------------------------------------------------------- every loss: masked rows, extreme ratios, errors
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_a_fully_masked_row_changes_nothing(loss_type, aggregation):
    lp, old, adv, mask = gmpo_inputs()
    settings = LossSettings(loss_type=loss_type, aggregation=aggregation, max_completion_length=3)
    alone, _ = policy_loss(lp, old, adv, mask, settings)
    # a third row without tokens, whose log-ratios are far off: neither its value nor its row counts
    lp3 = torch.cat([lp.detach(), torch.tensor([[5.0, 60.0, -70.0]])]).requires_grad_(True)
    old3 = torch.cat([old, torch.tensor([[-5.0, -50.0, -1.0]])])
    loss, _ = policy_loss(lp3, old3, torch.cat([adv, torch.tensor([3.0])]), torch.cat([mask, torch.zeros(1, 3)]),
                          settings)
    loss.backward()
    assert loss.item() == pytest.approx(alone.item(), abs=1e-6)
    assert torch.all(lp3.grad[2] == 0.0) and torch.isfinite(lp3.grad).all()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padded_position_far_off_gives_no_nan(loss_type):
    # a padded position whose lp - old = 100: exp(100) is inf in fp32, and inf * mask 0 = NaN, as the uncapped
    # ratio gave; the log-ratio is capped at 20 first, so the loss is that of the real tokens alone
    old = torch.tensor([[-1.0, -1.0]])
    lp = torch.tensor([[-0.9, 99.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0]])
    assert torch.isnan((torch.exp(lp - old) * mask).sum())  # the NaN before the cap
    loss, m = policy_loss(lp, old, torch.tensor([1.0]), mask, LossSettings(loss_type=loss_type))
    loss.backward()
    real, _ = policy_loss(lp[:, :1], old[:, :1], torch.tensor([1.0]), mask[:, :1], LossSettings(loss_type=loss_type))
    assert loss.item() == pytest.approx(real.item(), abs=1e-6)
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0.0
    assert m["ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-5)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_extreme_ratios_on_real_tokens_stay_finite(loss_type):
    # log-ratios +-100 on real tokens: capped at +-20 (ratio e^20 = 4.85e8 or e^-20), never inf
    old = torch.tensor([[-1.0, -101.0], [-1.0, -1.0]])
    lp = torch.tensor([[-101.0, -1.0], [-1.0, -1.0]], requires_grad=True)
    loss, m = policy_loss(lp, old, torch.tensor([-1.0, 1.0]), torch.ones(2, 2), LossSettings(loss_type=loss_type))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    if loss_type == "ppo_clip":
        # row 0 (A = -1): max(r, clip(r)) = [clip(e^-20) = 0.8, e^20]; row 1 (A = +1, r = 1): [-1, -1]; 4 tokens
        assert loss.item() == pytest.approx((0.8 + math.exp(20) - 2.0) / 4, rel=1e-6)
    assert m["ratio_max"] == pytest.approx(math.exp(20), rel=1e-5)


def test_gspo_sequence_log_ratio_is_capped_at_10():
    # mean log-ratio 50 over the sequence: s = e^min(50, 10)
    old = torch.tensor([[-60.0, -60.0]])
    lp = torch.tensor([[-10.0, -10.0]])
    ratio = importance_ratio(lp, old, torch.ones(1, 2), "sequence")
    torch.testing.assert_close(ratio, torch.full((1, 2), math.exp(10.0)))


def test_new_losses_refuse_settings_that_do_not_apply():
    lp, old, adv, mask = gmpo_inputs()
    with pytest.raises(ValueError, match="unknown loss_type"):
        policy_loss(lp, old, adv, mask, LossSettings(loss_type="vanilla"))
    with pytest.raises(ValueError, match="importance_sampling_level 'token'"):
        policy_loss(lp, old, adv, mask, LossSettings(loss_type="cispo", importance_sampling_level="sequence"))
    with pytest.raises(ValueError, match="ppo_clip"):
        policy_loss(lp, old, adv, mask, LossSettings(loss_type="sapo", clip_ratio_c=3.0))
    with pytest.raises(ValueError, match="SAPO temperatures"):
        policy_loss(lp, old, adv, mask, LossSettings(loss_type="sapo", sapo_tau_neg=0.0))


# ------------------------------------------------------------------------- seq_mean_token_sum_norm's row count
def test_seq_mean_token_sum_norm_counts_only_rows_with_tokens():
    # rows [2, 4] and [(masked) 100, 100]: one sequence with tokens, L = 4 -> (2 + 4) / (4 * 1) = 1.5;
    # counting the empty row too (as before) gave D = 4 * 2 = 8 and 0.75
    per_token = torch.tensor([[2.0, 4.0], [100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert aggregation_normaliser(mask, "seq_mean_token_sum_norm", 4) == 4.0
    assert aggregate(per_token, mask, "seq_mean_token_sum_norm", 4).item() == pytest.approx(1.5)
    # as seq_mean_token_mean counts its rows
    assert aggregation_normaliser(mask, "seq_mean_token_mean") == 1.0


# ------------------------------------------------------------------------------- rollout/trainer mismatch
# d = trainer - rollout on masked tokens: row 0 [0.1, -0.3, 1.5] (sum 1.3, mean 0.43333),
# row 1 [2.0, -3.0, (masked) 9.0] (sum -1.0, mean -0.5)
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -4.0, -1.0]])
ROLLOUT = TRAINER - torch.tensor([[0.1, -0.3, 1.5], [2.0, -3.0, 9.0]])
RC_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
E = math.exp


def check(weights, expected):
    # compared on the masked tokens only (a padded position's weight never reaches the loss)
    torch.testing.assert_close(weights * RC_MASK, torch.tensor(expected) * RC_MASK)


def test_token_truncate():
    w, capped, masked = rollout_correction(TRAINER, ROLLOUT, RC_MASK, "token_truncate", cap=2.0)
    check(w, [[E(0.1), E(-0.3), 2.0], [2.0, E(-3.0), 0.0]])  # e^1.5 = 4.48 and e^2 = 7.39 cut to 2
    assert capped.tolist() == [[False, False, True], [True, False, False]] and not masked.any()


def test_sequence_truncate():
    w, capped, _ = rollout_correction(TRAINER, ROLLOUT, RC_MASK, "sequence_truncate", cap=2.0)
    check(w, [[2.0] * 3, [E(-1.0)] * 3])                     # e^1.3 = 3.67 cut to 2; e^-1 = 0.368
    assert capped[0].all() and not capped[1].any()


def test_sequence_mask_keeps_the_ratio_inside_the_band():
    # TRL's sequence_mask, cap 3: e^1.3 = 3.669 > 3 -> row 0 weight 0; e^-1 = 0.368 kept as its weight
    w, _, masked = rollout_correction(TRAINER, ROLLOUT, RC_MASK, "sequence_mask")
    check(w, [[0.0] * 3, [E(-1.0)] * 3])
    assert masked.tolist() == [[True] * 3, [False] * 3]
    w, _, masked = rollout_correction(TRAINER, ROLLOUT, RC_MASK, "sequence_mask", low=0.5, high=4.0)
    check(w, [[E(1.3)] * 3, [0.0] * 3])                      # band 0.5 .. 4: now row 1 (0.368) is out


def test_icepop_masks_tokens_outside_the_band():
    # band 0.5 .. 5: e^0.1, e^-0.3 = 0.74, e^1.5 = 4.48 kept; e^2 = 7.39 above, e^-3 = 0.05 below
    w, _, masked = rollout_correction(TRAINER, ROLLOUT, RC_MASK, "icepop")
    check(w, [[E(0.1), E(-0.3), E(1.5)], [0.0, 0.0, 0.0]])
    assert masked.tolist() == [[False, False, False], [True, True, False]]  # the padded position is not counted


def test_geometric_mask_by_the_sequences_geometric_mean():
    # verl's seq_mean_k1: the band holds e^-G (G the mean of d): row 0 e^-0.433 = 0.648, row 1 e^0.5 = 1.649
    # default band 0.999 .. 1.001: both out
    w, _, masked = rollout_correction(TRAINER, ROLLOUT, RC_MASK, "geometric_mask")
    check(w, [[0.0] * 3, [0.0] * 3])
    assert masked.sum().item() == 5
    # band 0.6 .. 1.7: both kept with weight 1 (a mask, not a weight)
    w, _, _ = rollout_correction(TRAINER, ROLLOUT, RC_MASK, "geometric_mask", low=0.6, high=1.7)
    check(w, [[1.0] * 3, [1.0] * 3])
    # band 0.7 .. 1.7: row 0 (0.648) out, row 1 (1.649) kept; a band on e^G (1.542, 0.607) would give the reverse
    w, _, _ = rollout_correction(TRAINER, ROLLOUT, RC_MASK, "geometric_mask", low=0.7, high=1.7)
    check(w, [[0.0] * 3, [1.0] * 3])


def test_corrections_of_extreme_gaps_are_finite():
    trainer = torch.tensor([[0.0, -200.0]])
    rollout = torch.tensor([[-150.0, 0.0]])
    for mode in ("token_truncate", "sequence_truncate", "sequence_mask", "icepop", "geometric_mask"):
        w, _, _ = rollout_correction(trainer, rollout, torch.ones(1, 2), mode)
        assert torch.isfinite(w).all(), mode
    w, _, _ = rollout_correction(trainer, rollout, torch.ones(1, 2), "token_truncate", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, E(-20.0)]]))  # the weight's log is capped at -20 too


def test_rollout_correction_bad_arguments():
    with pytest.raises(ValueError, match="unknown rollout correction"):
        rollout_correction(TRAINER, ROLLOUT, RC_MASK, "token_mask")
    with pytest.raises(ValueError, match="0 <= low < high"):
        rollout_correction(TRAINER, ROLLOUT, RC_MASK, "icepop", low=5.0, high=2.0)


# ------------------------------------------------------------------------------------- losses registered by name
def test_the_built_in_losses_are_the_registry_and_the_configs_choices():
    from grpo.algorithm.registry import POLICY_LOSSES
    from grpo.config.choices import LOSS_TYPES as CHOICES

    assert tuple(POLICY_LOSSES) == tuple(CHOICES) == LOSS_TYPES  # --help lists them in this order
    assert [n for n, loss in POLICY_LOSSES.items() if loss.sequence_ratio] == ["ppo_clip", "sapo"]
    assert [n for n, loss in POLICY_LOSSES.items() if loss.dual_clip] == ["ppo_clip"]


def test_a_loss_registered_by_name_is_a_choice_of_the_config_and_computed_by_policy_loss():
    from grpo.algorithm import register_policy_loss
    from grpo.algorithm.registry import POLICY_LOSSES
    from grpo.config import GRPOConfig
    from grpo.config.cli import build_parser
    from grpo.errors import ConfigError

    seen = []

    @register_policy_loss("reinforce_ratio", dual_clip=True)
    def reinforce_ratio(terms):
        """pg_t = -A r_t, no clip."""
        seen.append(terms)
        return -terms.adv * terms.ratio, None, None

    try:
        config = GRPOConfig(loss_type="reinforce_ratio", clip_ratio_c=3.0)
        assert config.loss_type == "reinforce_ratio"
        with pytest.raises(ConfigError, match="'sequence' goes with --loss_type ppo_clip or sapo"):
            GRPOConfig(loss_type="reinforce_ratio", importance_sampling_level="sequence")
        (action,) = [a for a in build_parser()._actions if a.dest == "loss_type"]
        assert list(action.choices) == [*LOSS_TYPES, "reinforce_ratio"]

        lp = ratio_inputs()
        loss, m = policy_loss(lp, OLD, ADV, MASK, LossSettings(loss_type="reinforce_ratio"))
        loss.backward()
        assert len(seen) == 1 and seen[0].eps_high == 0.2  # eps_high None: eps_low
        # pg = -A r: row 0 (A = 1): -1.5, -0.5; row 1 (A = -2): 2.2, 2.0; token mean 0.55; d/d lp = -A r / 4
        assert loss.item() == pytest.approx(0.55)
        torch.testing.assert_close(lp.grad, torch.tensor([[-0.375, -0.125], [0.55, 0.5]]))
        assert m["clip_frac"] == 0.0 and m["ratio_max"] == pytest.approx(1.5)
    finally:
        del POLICY_LOSSES["reinforce_ratio"]
    with pytest.raises(ConfigError, match="choose one of ppo_clip, cispo, sapo, gmpo$"):
        GRPOConfig(loss_type="reinforce_ratio")
    with pytest.raises(ValueError, match="unknown loss_type"):
        policy_loss(ratio_inputs(), OLD, ADV, MASK, LossSettings(loss_type="reinforce_ratio"))


# --------------------------------------------------------------------------- rollout corrections registered by name
ROLLOUT_CORRECTIONS = ("token_truncate", "sequence_truncate", "sequence_mask", "icepop", "geometric_mask")


def test_the_built_in_corrections_are_the_registry_and_the_configs_choices():
    from grpo.algorithm.registry import ROLLOUT_CORRECTIONS as REGISTERED, rollout_mask_bands
    from grpo.config.choices import ROLLOUT_CORRECTION_NAMES

    assert tuple(REGISTERED) == tuple(ROLLOUT_CORRECTION_NAMES) == ROLLOUT_CORRECTIONS  # --help's order
    assert rollout_mask_bands() == {"sequence_mask": (0.0, 3.0), "icepop": (0.5, 5.0),
                                    "geometric_mask": (0.999, 1.001)}


def test_a_correction_registered_by_name_is_a_choice_of_the_config_and_computed_by_rollout_correction():
    from grpo.algorithm import register_rollout_correction
    from grpo.algorithm.registry import ROLLOUT_CORRECTIONS as REGISTERED
    from grpo.config import GRPOConfig, parse_args
    from grpo.config.cli import build_parser
    from grpo.errors import ConfigError

    seen = []

    @register_rollout_correction("half_band", band=(0.5, 2.0), help="half the token's ratio, 0 outside the band")
    def half_band(c):
        """w_t = e^d_t / 2 inside [low, high], else 0."""
        seen.append(c)
        keep = (c.log_ratio >= math.log(c.low)) & (c.log_ratio <= math.log(c.high))
        return (c.log_ratio.exp() / 2).masked_fill(~keep, 0.0), None, ~keep

    try:
        config = GRPOConfig(rollout_is_correction=True, rollout_correction="half_band", rollout_mask_high=8.0)
        assert (config.rollout_correction, config.is_correction) == ("half_band", True)
        cfg = parse_args(["--rollout_is_correction", "--rollout_correction", "half_band", "--rollout_mask_low", "0.1"])
        assert (cfg.rollout_correction, cfg.rollout_mask_low) == ("half_band", 0.1)
        with pytest.raises(ConfigError, match="0 <= low < high"):  # its default band is checked as the built-ins'
            GRPOConfig(rollout_is_correction=True, rollout_correction="half_band", rollout_mask_low=3.0)
        parser = build_parser()
        (action,) = [a for a in parser._actions if a.dest == "rollout_correction"]
        assert list(action.choices) == [*ROLLOUT_CORRECTIONS, "half_band"]
        assert "geometric_mask,half_band}" in " ".join(parser.format_help().split())  # --help lists it

        # the config's correction, as the trainer's update calls it: band 0.5 .. 8 (the config's high)
        w, capped, masked = rollout_correction(TRAINER, ROLLOUT, RC_MASK, config.rollout_correction,
                                               config.rollout_is_cap, config.rollout_mask_low,
                                               config.rollout_mask_high)
        assert len(seen) == 1 and (seen[0].low, seen[0].high, seen[0].cap) == (0.5, 8.0, 2.0)
        # e^0.1, e^-0.3 = 0.74, e^1.5 = 4.48, e^2 = 7.39 kept (halved); e^-3 = 0.05 below
        check(w, [[E(0.1) / 2, E(-0.3) / 2, E(1.5) / 2], [E(2.0) / 2, 0.0, 0.0]])
        assert not capped.any() and masked.tolist() == [[False, False, False], [False, True, False]]  # padding not
        loss, _ = policy_loss(ratio_inputs(), OLD, ADV, MASK, LossSettings(), is_weights=torch.full((2, 2), 0.5))
        assert loss.item() == pytest.approx(0.5 * policy_loss(ratio_inputs(), OLD, ADV, MASK, LossSettings())[0].item())
    finally:
        del REGISTERED["half_band"]
    with pytest.raises(ConfigError, match="choose one of token_truncate, sequence_truncate, sequence_mask, icepop, "
                                          "geometric_mask$"):
        GRPOConfig(rollout_is_correction=True, rollout_correction="half_band")
    with pytest.raises(ValueError, match="unknown rollout correction 'half_band'"):
        rollout_correction(TRAINER, ROLLOUT, RC_MASK, "half_band")
