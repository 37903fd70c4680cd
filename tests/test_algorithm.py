"""GRPO math against numbers worked out by hand."""
import math

import pytest
import torch

from grpo.algorithm import (LossSettings, aggregate, group_advantages, kl_k3, masked_mean, policy_loss, reward_std,
                            token_entropy, token_logprobs)


# ------------------------------------------------------------------------------------------- advantages
def test_group_advantages_group_scale():
    # group 1: [1, 0, 1, 0]: mean 0.5, unbiased std = sqrt((4 * 0.25) / 3) = sqrt(1/3) = 0.57735
    #   A = +-0.5 / (0.57735 + 1e-4) = +-0.86588
    # group 2: [2, 2, 2, 2]: all equal -> 0
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, group_size=4, scale="group")
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([a, -a, a, -a, 0, 0, 0, 0]))


def test_group_advantages_batch_and_none_scale():
    # groups [0, 1] and [3, 5]: centered [-0.5, 0.5, -1, 1]
    # batch std of [0, 1, 3, 5]: mean 2.25, squares 5.0625 + 1.5625 + 0.5625 + 7.5625 = 14.75, /3 = 4.91667,
    #   sqrt = 2.21736
    rewards = torch.tensor([0.0, 1.0, 3.0, 5.0])
    torch.testing.assert_close(group_advantages(rewards, 2, scale="none"), torch.tensor([-0.5, 0.5, -1.0, 1.0]))
    s = math.sqrt(14.75 / 3) + 1e-4
    torch.testing.assert_close(group_advantages(rewards, 2, scale="batch"),
                               torch.tensor([-0.5 / s, 0.5 / s, -1 / s, 1 / s]))
    # group scale: group std of [0, 1] = sqrt(0.5) = 0.70711; of [3, 5] = sqrt(2) = 1.41421
    torch.testing.assert_close(group_advantages(rewards, 2, scale="group"),
                               torch.tensor([-0.5 / (0.70711 + 1e-4), 0.5 / (0.70711 + 1e-4),
                                             -1 / (1.41421 + 1e-4), 1 / (1.41421 + 1e-4)]), atol=1e-4, rtol=1e-4)


def test_batch_scale_over_ranks_uses_the_whole_steps_std():
    # the step's rewards [0, 1, 3, 5] live on two ranks: [0, 1] and [3, 5]; mean 9 / 4 = 2.25
    # squared deviations: 5.0625 + 1.5625 on one rank, 0.5625 + 7.5625 on the other -> 14.75, n 4
    # std = sqrt(14.75 / 3) = 2.21736, the single-rank batch std of [0, 1, 3, 5]
    std = reward_std(5.0625 + 1.5625 + 0.5625 + 7.5625, 4.0)
    assert std == pytest.approx(math.sqrt(14.75 / 3))
    s = std + 1e-4
    torch.testing.assert_close(group_advantages(torch.tensor([3.0, 5.0]), 2, scale="batch", batch_std=std),
                               torch.tensor([-1 / s, 1 / s]))
    # without the step's std, one rank would divide by its own: std of [3, 5] = sqrt(2)
    assert group_advantages(torch.tensor([3.0, 5.0]), 2, scale="batch")[1].item() == pytest.approx(1 / (2 ** 0.5 + 1e-4))
    assert reward_std(0.0, 1.0) == 0.0 and reward_std(0.0, 2.0) == 0.0  # one reward; [2, 2]


def test_group_advantages_zero_variance_is_exactly_zero():
    adv = group_advantages(torch.tensor([0.3, 0.3, 0.3]), 3)
    assert torch.equal(adv, torch.zeros(3))


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="unknown advantage scale"):
        group_advantages(torch.zeros(4), 2, scale="rank")
    with pytest.raises(ValueError, match="flat"):
        group_advantages(torch.zeros(2, 2), 2)


def test_group_advantages_group_of_one_is_zero_not_nan():
    # one completion per prompt: r - mean = 0, so every advantage is 0 with any scale
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(torch.tensor([1.0, 3.0]), 1, scale=scale), torch.zeros(2))


# ------------------------------------------------------------------------------------------- log-probs
def test_token_logprobs_by_hand():
    # logits [0, ln 2, ln 3] -> softmax [1/6, 2/6, 3/6]; token 2 -> ln(0.5), token 0 -> ln(1/6)
    logits = torch.tensor([[[0.0, math.log(2), math.log(3)], [0.0, math.log(2), math.log(3)]]])
    lp = token_logprobs(logits, torch.tensor([[2, 0]]))
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.5), math.log(1 / 6)]]))
    # temperature 2: logits / 2 = [0, ln sqrt2, ln sqrt3] -> weights [1, 1.41421, 1.73205], sum 4.14626
    lp_t = token_logprobs(logits, torch.tensor([[2, 0]]), temperature=2.0)
    torch.testing.assert_close(lp_t, torch.tensor([[math.log(1.73205 / 4.14626), math.log(1 / 4.14626)]]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_chunked_equals_full_log_softmax(temperature):
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 11)
    ids = torch.randint(0, 11, (5, 7))
    reference = torch.log_softmax(logits / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    for chunk in (1, 2, 5, 16):
        torch.testing.assert_close(token_logprobs(logits, ids, temperature=temperature, chunk_size=chunk), reference)


def test_token_logprobs_bf16_logits_give_fp32_and_grads():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 9).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, 9, (3, 4))
    lp = token_logprobs(logits, ids, chunk_size=2)
    assert lp.dtype == torch.float32
    # same numbers as an fp32 log-softmax of the (exactly representable) bf16 values
    reference = torch.log_softmax(logits.detach().float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, reference)
    lp.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16 and logits.grad.abs().sum() > 0


def test_token_logprobs_gradient_by_hand():
    # d log p(y) / d logits = (onehot(y) - softmax(logits / T)) / T
    # logits [0, ln 2, ln 3], token 2, T = 1: p = [1/6, 1/3, 1/2] -> grad [-1/6, -1/3, 1/2]
    logits = torch.tensor([[[0.0, math.log(2), math.log(3)]]], requires_grad=True)
    token_logprobs(logits, torch.tensor([[2]])).sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[-1 / 6, -1 / 3, 1 / 2]]]))
    # T = 2: p = [1, 1.41421, 1.73205] / 4.14626 = [0.24118, 0.34108, 0.41774]
    #   grad = ([0, 0, 1] - p) / 2 = [-0.12059, -0.17054, 0.29113]
    logits.grad = None
    token_logprobs(logits, torch.tensor([[2]]), temperature=2.0).sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.12059, -0.17054, 0.29113]]]), atol=1e-5, rtol=1e-4)


def test_token_logprobs_bad_arguments():
    with pytest.raises(ValueError, match="token_ids"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_entropy(torch.zeros(2, 3, 5), chunk_size=0)


def test_token_entropy_uniform_and_peaked():
    uniform = torch.zeros(1, 1, 4)                        # H = ln 4
    peaked = torch.tensor([[[0.0, math.log(3), -1e9, -1e9]]])  # p = [1/4, 3/4]: H = -(.25 ln .25 + .75 ln .75)
    torch.testing.assert_close(token_entropy(uniform), torch.tensor([[math.log(4)]]))
    torch.testing.assert_close(token_entropy(peaked), torch.tensor([[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]]))
    # temperature 2 halves the logits: [0, ln sqrt3] -> p = [1, 1.73205] / 2.73205 = [0.36603, 0.63397]
    #   H = -(0.36603 ln 0.36603 + 0.63397 ln 0.63397) = 0.36787 + 0.28893 = 0.65681
    torch.testing.assert_close(token_entropy(peaked, temperature=2.0), torch.tensor([[0.65681]]), atol=1e-5, rtol=1e-5)


def test_token_entropy_chunked_equals_full():
    torch.manual_seed(0)
    logits = torch.randn(5, 3, 7)
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(token_entropy(logits, chunk_size=2), -(logp.exp() * logp).sum(-1))


# ------------------------------------------------------------------------------------------------- KL
def test_kl_k3_values():
    # d = ref - lp.  d = 0 -> e^0 - 0 - 1 = 0;  d = 1 -> e - 2 = 0.71828;  d = -1 -> e^-1 + 1 - 1 = 0.36788
    lp = torch.tensor([-1.0, -2.0, -1.0])
    ref = torch.tensor([-1.0, -1.0, -2.0])
    torch.testing.assert_close(kl_k3(lp, ref), torch.tensor([0.0, math.e - 2, math.exp(-1)]))


def test_kl_k3_clamps():
    # d = 50 is clamped to 10: e^10 - 11 = 22015.5 -> clamped to 10;  d = -50 -> -10: e^-10 + 9 = 9.0000454
    out = kl_k3(torch.tensor([0.0, 0.0]), torch.tensor([50.0, -50.0]))
    torch.testing.assert_close(out, torch.tensor([10.0, math.exp(-10) + 9.0]))


def test_masked_mean_and_empty_mask():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(v, m).item() == pytest.approx(1.5)
    torch.testing.assert_close(masked_mean(v, m, dim=1), torch.tensor([1.5, 0.0]))


# ----------------------------------------------------------------------------------------- policy loss
# Two sequences, three tokens. Sequence 0 (A = +1) has 3 tokens, sequence 1 (A = -1) has 2 (last masked).
LP = torch.tensor([[math.log(1.5), 0.0, math.log(0.5)], [math.log(0.5), math.log(1.1), 0.0]])
OLD = torch.zeros(2, 3)
ADV = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# ratios: [[1.5, 1.0, 0.5], [0.5, 1.1, 1.0]]
# eps_low = 0.2, eps_high = 0.3 -> clip range [0.8, 1.3]
#   seq 0 (A=+1): min(r, clip(r)) = [min(1.5, 1.3), 1.0, min(0.5, 0.8)] = [1.3, 1.0, 0.5] -> per-token loss -[...]
#   seq 1 (A=-1): min(-r, -clip(r)) = [min(-0.5, -0.8), min(-1.1, -1.1), ...] = [-0.8, -1.1] -> loss [0.8, 1.1]
PER_TOKEN = [[-1.3, -1.0, -0.5], [0.8, 1.1, 0.0]]


def test_policy_loss_token_mean_and_clip_fractions():
    loss, m = policy_loss(LP, OLD, ADV, MASK, LossSettings(eps_low=0.2, eps_high=0.3))
    # sum over 5 masked tokens: -1.3 - 1.0 - 0.5 + 0.8 + 1.1 = -0.9; / 5 = -0.18
    assert loss.item() == pytest.approx(-0.18, abs=1e-6)
    # clipped high: seq 0 token 0 (A>0, 1.5 > 1.3) -> 1/5; clipped low: seq 1 token 0 (A<0, 0.5 < 0.8) -> 1/5
    # seq 0 token 2 (ratio 0.5 < 0.8 but A > 0) is not clipped: the min picks the unclipped term
    assert m["clip_frac_high"] == pytest.approx(0.2)
    assert m["clip_frac_low"] == pytest.approx(0.2)
    assert m["clip_frac"] == pytest.approx(0.4)
    # ratio mean over masked: (1.5 + 1 + 0.5 + 0.5 + 1.1) / 5 = 0.92; max 1.5
    assert m["ratio_mean"] == pytest.approx(0.92)
    assert m["ratio_max"] == pytest.approx(1.5)
    assert m["kl"] == 0.0 and m["pg_loss"] == pytest.approx(-0.18, abs=1e-6)


def test_policy_loss_same_eps_clips_differently():
    # with eps_high = eps_low = 0.2 the range is [0.8, 1.2]: seq 0 token 0 becomes min(1.5, 1.2) = 1.2
    # sum: -1.2 - 1.0 - 0.5 + 0.8 + 1.1 = -0.8; / 5 = -0.16
    loss, m = policy_loss(LP, OLD, ADV, MASK, LossSettings(eps_low=0.2))
    assert loss.item() == pytest.approx(-0.16, abs=1e-6)


def test_policy_loss_other_aggregations():
    # seq_mean_token_mean: seq 0 mean (-1.3 - 1 - 0.5) / 3 = -0.93333; seq 1 (0.8 + 1.1) / 2 = 0.95
    #   mean = (-0.93333 + 0.95) / 2 = 0.0083333
    loss, _ = policy_loss(LP, OLD, ADV, MASK,
                          LossSettings(eps_low=0.2, eps_high=0.3, aggregation="seq_mean_token_mean"))
    assert loss.item() == pytest.approx((-2.8 / 3 + 1.9 / 2) / 2, abs=1e-6)
    # seq_mean_token_sum_norm with L = 4: seq sums -2.8 and 1.9 -> (-0.7 + 0.475) / 2 = -0.1125
    loss, _ = policy_loss(LP, OLD, ADV, MASK,
                          LossSettings(eps_low=0.2, eps_high=0.3, aggregation="seq_mean_token_sum_norm",
                                       max_completion_length=4))
    assert loss.item() == pytest.approx(-0.1125, abs=1e-6)
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(LP, OLD, ADV, MASK, LossSettings(aggregation="seq_mean_token_sum_norm"))
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        policy_loss(LP, OLD, ADV, MASK, LossSettings(aggregation="sum"))


def test_seq_mean_skips_empty_sequences():
    # a fully masked sequence does not count: mean over the one remaining sequence
    per_token = torch.tensor([[2.0, 4.0], [100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert aggregate(per_token, mask, "seq_mean_token_mean").item() == pytest.approx(3.0)


def test_policy_loss_with_kl_penalty():
    # ref = lp + d with d = [[0, 1, 0], [-1, 0, 0]] -> k3 = [[0, e-2, 0], [e^-1, 0, 0]]
    ref = LP + torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    loss, m = policy_loss(LP, OLD, ADV, MASK, LossSettings(beta=0.1, eps_low=0.2, eps_high=0.3), ref_logprobs=ref)
    kl_sum = (math.e - 2) + math.exp(-1)  # masked tokens only
    assert loss.item() == pytest.approx((-0.9 + 0.1 * kl_sum) / 5, abs=1e-6)
    assert m["kl"] == pytest.approx(kl_sum / 5, abs=1e-6)
    assert m["pg_loss"] == pytest.approx(-0.18, abs=1e-6)


def test_policy_loss_is_weights_scale_the_policy_term():
    w = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0]])
    # per-token pg: [-2.6, -1.0, -0.5, 0.8, 0.55] -> sum -2.75 / 5 = -0.55
    loss, m = policy_loss(LP, OLD, ADV, MASK, LossSettings(eps_low=0.2, eps_high=0.3), is_weights=w)
    assert loss.item() == pytest.approx(-0.55, abs=1e-6)
    assert m["pg_loss"] == pytest.approx(-0.55, abs=1e-6)
    # the weights scale the loss, not the ratio: the clip fractions stay those of the unweighted case
    assert m["clip_frac_high"] == pytest.approx(0.2) and m["clip_frac_low"] == pytest.approx(0.2)


def test_policy_loss_kl_is_logged_without_penalty_when_beta_is_zero():
    # same ref as above: the kl metric is reported, the loss is the plain surrogate
    ref = LP + torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    loss, m = policy_loss(LP, OLD, ADV, MASK, LossSettings(beta=0.0, eps_low=0.2, eps_high=0.3), ref_logprobs=ref)
    assert loss.item() == pytest.approx(-0.18, abs=1e-6)
    assert m["kl"] == pytest.approx(((math.e - 2) + math.exp(-1)) / 5, abs=1e-6)


def test_policy_loss_per_micro_batch_aggregates_its_rows_only():
    # row 0 alone: (-1.3 - 1.0 - 0.5) / 3 = -0.93333; row 1 alone: (0.8 + 1.1) / 2 = 0.95
    loss0, m0 = policy_loss(LP[:1], OLD[:1], ADV[:1], MASK[:1], LossSettings(eps_low=0.2, eps_high=0.3))
    loss1, m1 = policy_loss(LP[1:], OLD[1:], ADV[1:], MASK[1:], LossSettings(eps_low=0.2, eps_high=0.3))
    assert loss0.item() == pytest.approx(-2.8 / 3, abs=1e-6)
    assert loss1.item() == pytest.approx(0.95, abs=1e-6)
    # row 0 has only the high clip (1 of 3 tokens), row 1 only the low one (1 of 2 tokens)
    assert (m0["clip_frac_high"], m0["clip_frac_low"]) == (pytest.approx(1 / 3), 0.0)
    assert (m1["clip_frac_high"], m1["clip_frac_low"]) == (0.0, pytest.approx(0.5))


def test_policy_loss_fully_masked_row_is_skipped_in_seq_mean():
    # row 1 fully masked: seq_mean_token_mean is row 0's mean alone, -2.8 / 3; token_mean likewise
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    for aggregation in ("seq_mean_token_mean", "token_mean"):
        loss, m = policy_loss(LP, OLD, ADV, mask, LossSettings(eps_low=0.2, eps_high=0.3, aggregation=aggregation))
        assert loss.item() == pytest.approx(-2.8 / 3, abs=1e-6)
    # ratio over row 0 only: mean (1.5 + 1 + 0.5) / 3 = 1.0, max 1.5
    assert m["ratio_mean"] == pytest.approx(1.0) and m["ratio_max"] == pytest.approx(1.5)
    # nothing masked in at all: a zero loss and zero metrics, no NaN
    loss, m = policy_loss(LP, OLD, ADV, torch.zeros(2, 3))
    assert loss.item() == 0.0 and m["ratio_max"] == 0.0 and m["clip_frac"] == 0.0


def test_policy_loss_bad_arguments():
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(LP, OLD, torch.zeros(2, 3), MASK)
    with pytest.raises(ValueError, match="mask must have the shape"):
        policy_loss(LP, OLD, ADV, MASK[:, :2])
    with pytest.raises(ValueError, match="ref_logprobs must have the shape"):
        policy_loss(LP, OLD, ADV, MASK, LossSettings(beta=0.1), ref_logprobs=LP[:1])
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(LP, OLD, ADV, MASK, LossSettings(eps_low=1.5))
    with pytest.raises(ValueError, match="max_completion_length > 0"):
        policy_loss(LP, OLD, ADV, MASK, LossSettings(aggregation="seq_mean_token_sum_norm", max_completion_length=0))


def test_gradients_flow_only_through_logprobs():
    lp = LP.clone().requires_grad_(True)
    old = OLD.clone().requires_grad_(True)
    adv = ADV.clone().requires_grad_(True)
    ref = (LP + 0.5).requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, MASK, LossSettings(beta=0.0, eps_low=0.2, eps_high=0.3), ref_logprobs=ref)
    loss.backward()
    assert old.grad is None and adv.grad is None and ref.grad is None
    # d loss / d lp_t = -A * ratio_t / 5 where the unclipped term is the active one, else 0:
    #   seq 0: token 0 clipped (1.5 > 1.3) -> 0; token 1 -> -1/5; token 2 (0.5, unclipped side wins) -> -0.5/5
    #   seq 1: token 0 clipped (0.5 < 0.8) -> 0; token 1 -> +1.1/5; token 2 masked -> 0
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.2, -0.1], [0.0, 0.22, 0.0]]))


def test_gradients_with_kl_and_is_weights():
    lp = LP.clone().requires_grad_(True)
    old = OLD.clone().requires_grad_(True)
    adv = ADV.clone().requires_grad_(True)
    ref = (LP + torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])).requires_grad_(True)
    w = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0]], requires_grad=True)
    loss, _ = policy_loss(lp, old, adv, MASK,
                          LossSettings(beta=0.1, eps_low=0.2, eps_high=0.3), ref_logprobs=ref, is_weights=w)
    loss.backward()
    assert old.grad is None and adv.grad is None and ref.grad is None and w.grad is None
    # token_mean over 5 tokens: d loss / d lp_t = (d pg_t + 0.1 * d k3_t) / 5
    #   d pg_t  = -A * ratio_t * w_t on unclipped tokens: [[0, -1, -0.5], [0, 1.1 * 0.5 = 0.55, 0]]
    #   d k3_t  = d/d lp (e^(ref - lp) - (ref - lp) - 1) = 1 - e^(ref - lp): [[0, 1 - e, 0], [1 - e^-1, 0, 0]]
    #   -> [[0, (-1 + 0.1 (1 - e)) / 5 = -0.2343656, -0.1], [0.1 (1 - e^-1) / 5 = 0.0126424, 0.11, 0]]
    expected = torch.tensor([[0.0, (-1 + 0.1 * (1 - math.e)) / 5, -0.1],
                             [0.1 * (1 - math.exp(-1)) / 5, 0.11, 0.0]])
    torch.testing.assert_close(lp.grad, expected)


def test_gradient_with_seq_sum_norm_aggregation():
    lp = LP.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, OLD, ADV, MASK,
                          LossSettings(eps_low=0.2, eps_high=0.3, aggregation="seq_mean_token_sum_norm",
                                       max_completion_length=4))
    loss.backward()
    # every token is divided by L = 4 and by the 2 sequences: d loss / d lp_t = -A * ratio_t / 8 on unclipped
    #   tokens: [[0, -1/8, -0.5/8], [0, 1.1/8, 0]] = [[0, -0.125, -0.0625], [0, 0.1375, 0]]
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.125, -0.0625], [0.0, 0.1375, 0.0]]))


# ------------------------------------------------------------------ GSPO, dual-clip, KL estimators, entropy
from grpo.algorithm import importance_ratio, kl_estimate, kl_penalized_rewards  # noqa: E402


def gspo_inputs():
    # row 0: three tokens, lp - old = [0.3, -0.1, 0.1]: mean 0.1 -> s_0 = exp(0.1) = 1.105171
    # row 1: one token (mask [1, 0, 0]), lp - old = [-0.2, 5, 5]: the masked 5s do not count -> s_1 = exp(-0.2) = 0.818731
    old = torch.tensor([[-1.0, -2.0, -1.5], [-0.5, -3.0, -3.0]])
    lp = (old + torch.tensor([[0.3, -0.1, 0.1], [-0.2, 5.0, 5.0]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    return lp, old, mask


def test_sequence_ratio_uses_each_sequences_own_tokens():
    lp, old, mask = gspo_inputs()
    ratio = importance_ratio(lp, old, mask, "sequence")
    s0, s1 = math.exp(0.1), math.exp(-0.2)
    torch.testing.assert_close(ratio, torch.tensor([[s0, s0, s0], [s1, s1, s1]]))
    torch.testing.assert_close(importance_ratio(lp, old, mask, "token"), torch.exp(lp - old))


def test_gspo_loss_and_gradient_by_hand():
    lp, old, mask = gspo_inputs()
    adv = torch.tensor([1.0, -1.0])
    # eps 0.2: s_0 = 1.105171 and s_1 = 0.818731 are inside [0.8, 1.2], nothing clipped
    #   row 0 (A = +1): pg = -s_0 on 3 tokens; row 1 (A = -1): pg = +s_1 on 1 token
    #   token_mean = (3 * -1.105171 + 0.818731) / 4 = -2.496782 / 4 = -0.624196
    loss, m = policy_loss(lp, old, adv, mask, LossSettings(importance_sampling_level="sequence"))
    assert loss.item() == pytest.approx(-0.624196, abs=1e-6)
    assert m["clip_frac"] == 0.0
    # gradient: loss = (-3 s_0 + s_1) / 4, ds_0/dlp_0t = s_0 / 3, ds_1/dlp_10 = s_1 (masked tokens: 0)
    #   dloss/dlp_0t = -s_0 / 4 = -0.276293; dloss/dlp_10 = s_1 / 4 = 0.204683
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.276293] * 3, [0.204683, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_gspo_tiny_clip_range():
    lp, old, mask = gspo_inputs()
    # GSPO's clip range 3e-4 / 4e-4: s_0 = 1.105 > 1.0004 with A > 0 -> pg = -1.0004 (3 tokens, clipped high);
    # s_1 = 0.8187 < 0.9997 with A < 0 -> -min(-0.8187, -0.9997) = 0.9997 (1 token, clipped low)
    # token_mean = (3 * -1.0004 + 0.9997) / 4 = -2.0015 / 4 = -0.500375; both clipped: no gradient
    loss, m = policy_loss(lp, old, torch.tensor([1.0, -1.0]), mask,
                          LossSettings(eps_low=3e-4, eps_high=4e-4, importance_sampling_level="sequence"))
    assert loss.item() == pytest.approx(-0.500375, abs=1e-6)
    assert m["clip_frac_high"] == pytest.approx(0.75) and m["clip_frac_low"] == pytest.approx(0.25)
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))


def test_dual_clip_caps_negative_advantages():
    # row 0: A = -2, token ratios [4, 2, 0.5]; row 1: A = +1, ratio 4 on its one token; eps 0.2, clip_ratio_c 3
    #   r = 4:   -min(4 * -2, 1.2 * -2) = -min(-8, -2.4) = 8  -> capped at -A * c = 6
    #   r = 2:   -min(-4, -2.4) = 4                           (below 6: kept)
    #   r = 0.5: -min(-1, 0.8 * -2 = -1.6) = 1.6
    #   row 1:   -min(4, 1.2) = -1.2                          (A > 0: never capped)
    # token_mean = (6 + 4 + 1.6 - 1.2) / 4 = 10.4 / 4 = 2.6   (without the dual clip: (8 + 4 + 1.6 - 1.2) / 4 = 3.1)
    old = torch.zeros(2, 3)
    lp = torch.log(torch.tensor([[4.0, 2.0, 0.5], [4.0, 1.0, 1.0]])).requires_grad_(True)
    adv, mask = torch.tensor([-2.0, 1.0]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, m = policy_loss(lp, old, adv, mask, LossSettings(clip_ratio_c=3.0))
    assert loss.item() == pytest.approx(2.6)
    assert m["clip_frac_dual"] == pytest.approx(0.25)
    assert policy_loss(lp, old, adv, mask)[0].item() == pytest.approx(3.1)
    loss.backward()
    # the capped token is a constant (no gradient); r = 2 keeps d(-A r)/dlp / 4 = 2 * 2 / 4 = 1
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(lp, old, adv, mask, LossSettings(clip_ratio_c=1.0))


def test_kl_estimators_by_hand():
    # d = lp - ref = [0.5, -1.0]
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    # k2 = 0.5 d^2 = [0.125, 0.5]
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), torch.tensor([[0.125, 0.5]]))
    # k3 = exp(-d) + d - 1: exp(-0.5) + 0.5 - 1 = 0.606531 - 0.5 = 0.106531; exp(1) - 1 - 1 = 0.718282
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), torch.tensor([[0.106531, 0.718282]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), kl_k3(lp, ref))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(lp, ref, "k4")


def test_policy_loss_uses_the_chosen_kl_estimator():
    # advantages 0 -> pg = 0; loss = beta * token_mean(k2) = 0.1 * (0.125 + 0.5) / 2 = 0.03125
    lp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    loss, m = policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 2),
                          LossSettings(beta=0.1, kl_estimator="k2"), ref_logprobs=ref)
    assert loss.item() == pytest.approx(0.03125)
    assert m["kl"] == pytest.approx(0.3125)


def test_kl_in_reward_by_hand():
    # r'_i = r_i - beta * sum_t m_it (lp_it - ref_it), beta = 0.1
    #   row 0: d = [0.5, -1.0, (masked 6)] -> sum -0.5 -> 1 - 0.1 * -0.5 = 1.05
    #   row 1: d = [0.5, -0.25, (masked 0)] -> sum 0.25 -> 0 - 0.1 * 0.25 = -0.025
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -0.25, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    got = kl_penalized_rewards(torch.tensor([1.0, 0.0]), lp, ref, mask, beta=0.1)
    torch.testing.assert_close(got, torch.tensor([1.05, -0.025]))


def test_entropy_bonus_gradient_raises_entropy():
    # logits [0, ln 3] -> p = [0.25, 0.75], log p = [-1.386294, -0.287682]
    #   H = 0.25 * 1.386294 + 0.75 * 0.287682 = 0.346574 + 0.215762 = 0.562335
    #   dH/dz_j = -p_j (log p_j + H): dz_0 = -0.25 * (-0.823959) = 0.205990, dz_1 = -0.75 * 0.274653 = -0.205990
    # advantage 0 -> pg = 0; loss = -0.1 * H = -0.0562335, dloss/dz = -0.1 * dH/dz = [-0.0205990, 0.0205990]
    logits = torch.tensor([[[0.0, math.log(3.0)]]], requires_grad=True)
    entropy = token_entropy(logits, with_grad=True)
    assert entropy.item() == pytest.approx(0.562335, abs=1e-6)
    lp = token_logprobs(logits, torch.tensor([[1]]))
    loss, m = policy_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 1),
                          LossSettings(entropy_coef=0.1), entropy=entropy)
    assert loss.item() == pytest.approx(-0.0562335, abs=1e-7)
    assert m["entropy_loss"] == pytest.approx(-0.0562335, abs=1e-7)
    loss.backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.0205990, 0.0205990]]]), atol=1e-6, rtol=0)
    # a gradient step on the loss moves the distribution toward uniform: entropy rises
    with torch.no_grad():
        assert token_entropy(logits - 1.0 * logits.grad).item() > 0.562335
    # for logging (the default), entropy carries no gradient
    assert not token_entropy(logits).requires_grad
    with pytest.raises(ValueError, match="entropy_coef"):
        policy_loss(lp, lp.detach(), torch.zeros(1), torch.ones(1, 1), LossSettings(entropy_coef=0.1))
