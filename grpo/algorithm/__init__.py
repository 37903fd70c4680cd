"""GRPO math as pure tensor functions: no model, no engine, no config object; each module beside the equations it
implements. Bad arguments raise ValueError with a message that says what to pass instead.

    advantages          A = (r - mean_group) / (std_group + eps), the reward spread, KL folded into the reward
    kl                  k1 / k2 / k3 estimators of KL(policy || reference) per token
    logprobs            log p(token) and entropy from logits, or from hidden states in chunks
    aggregation         masked means; token_mean / seq_mean_token_mean / seq_mean_token_sum(_norm)
    losses              PPO-clip (token or sequence ratio, dual clip), CISPO, SAPO, GMPO, with KL and entropy
    rollout_correction  truncated / masked importance weights for the engine-trainer mismatch
"""
from grpo.algorithm.advantages import ADVANTAGE_SCALES, group_advantages, kl_penalized_rewards, reward_std
from grpo.algorithm.aggregation import (AGGREGATIONS, aggregate, aggregation_normaliser, aggregation_numerator,
                                        masked_mean)
from grpo.algorithm.kl import KL_CLAMP, kl_estimate, kl_k3
from grpo.algorithm.logprobs import hidden_token_logprobs, token_entropy, token_logprobs
from grpo.algorithm.losses import (LOG_RATIO_CLAMP, SEQ_LOG_RATIO_CAP, LossSettings, cispo_token_loss,
                                   gmpo_sequence_loss, gmpo_sequence_weights, importance_ratio, policy_loss,
                                   ppo_clip_token_loss, sapo_token_loss, token_log_ratio)
from grpo.algorithm.rollout_correction import rollout_correction

__all__ = [
    "ADVANTAGE_SCALES", "AGGREGATIONS", "KL_CLAMP", "LOG_RATIO_CLAMP", "SEQ_LOG_RATIO_CAP", "LossSettings", "aggregate",
    "aggregation_normaliser", "aggregation_numerator", "cispo_token_loss", "gmpo_sequence_loss",
    "gmpo_sequence_weights", "group_advantages", "hidden_token_logprobs", "importance_ratio", "kl_estimate", "kl_k3",
    "kl_penalized_rewards", "masked_mean", "policy_loss", "ppo_clip_token_loss", "reward_std", "rollout_correction",
    "sapo_token_loss", "token_entropy", "token_log_ratio", "token_logprobs",
]
