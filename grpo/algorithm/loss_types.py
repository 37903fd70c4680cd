"""The --loss_type choices: each one function registered by name (registry.py), given LossTerms and returning
(pg [N, T], clipped_low, clipped_high), the tokens whose clip bound held.

The command line reads this file for the names before torch loads, so each loss takes its math from losses.py when it
is called (losses.py's policy_loss is the only caller): the equations are there, beside the math.
"""
from __future__ import annotations

from grpo.algorithm.registry import LossTerms, register_policy_loss


def pessimistic_clips(below, above, adv) -> tuple:
    """The tokens whose clip bound held under PPO's pessimism: the lower bound where A < 0, the upper where A > 0.
    below / above [N, T] bool, adv [N, 1]."""
    return below & (adv < 0), above & (adv > 0)


@register_policy_loss("ppo_clip", sequence_ratio=True, dual_clip=True)
def ppo_clip(t: LossTerms) -> tuple:
    """PPO's clipped surrogate with DAPO's decoupled bounds (GRPO, DAPO; GSPO with the sequence ratio)."""
    from grpo.algorithm.losses import ppo_clip_token_loss

    pg = ppo_clip_token_loss(t.ratio, t.adv, t.eps_low, t.eps_high)
    return (pg, *pessimistic_clips(t.ratio < 1.0 - t.eps_low, t.ratio > 1.0 + t.eps_high, t.adv))


@register_policy_loss("cispo")
def cispo(t: LossTerms) -> tuple:
    """CISPO: the clipped, stop-gradient IS weight on every token's log-prob; the weight is clipped whatever the sign
    of A."""
    from grpo.algorithm.losses import cispo_token_loss

    pg = cispo_token_loss(t.logprobs, t.ratio, t.adv, t.eps_low, t.eps_high)
    return pg, t.ratio < 1.0 - t.eps_low, t.ratio > 1.0 + t.eps_high


@register_policy_loss("sapo", sequence_ratio=True)
def sapo(t: LossTerms) -> tuple:
    """SAPO: a smooth sigmoid gate instead of the clip (no clip to count)."""
    from grpo.algorithm.losses import sapo_token_loss

    return sapo_token_loss(t.ratio, t.adv, t.settings.sapo_tau_pos, t.settings.sapo_tau_neg), None, None


@register_policy_loss("gmpo", sequence_weights=True)
def gmpo(t: LossTerms) -> tuple:
    """GMPO: the geometric mean of the token ratios, each clipped in log space (its bounds are on the log-ratio)."""
    from grpo.algorithm.losses import gmpo_sequence_loss, token_log_ratio

    log_ratio = token_log_ratio(t.logprobs, t.old_logprobs)                                      # [N, T]
    pg = gmpo_sequence_loss(log_ratio, t.adv, t.mask, t.eps_low, t.eps_high)
    return (pg, *pessimistic_clips(log_ratio < -t.eps_low, log_ratio > t.eps_high, t.adv))
