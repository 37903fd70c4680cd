"""GRPO math as pure tensor functions: no model, no engine, no config object; each module beside the equations it
implements. Bad arguments raise ValueError with a message that says what to pass instead.

    advantages          A = (r - mean_group) / (std_group + eps), the reward spread, KL folded into the reward
    kl                  k1 / k2 / k3 estimators of KL(policy || reference) per token
    logprobs            log p(token) and entropy from logits, or from hidden states in chunks
    aggregation         masked means; token_mean / seq_mean_token_mean / seq_mean_token_sum(_norm)
    losses              PPO-clip (token or sequence ratio, dual clip), CISPO, SAPO, GMPO, with KL and entropy
    rollout_correction  truncated / masked importance weights for the engine-trainer mismatch
    sharded_logprobs    a sequence cut into N shards (sequence parallelism), a shard's log-probs, completions' scores
    registry            the variants by name (@register_policy_loss, @register_rollout_correction; loss_types and
                        rollout_correction hold the built-in ones), torch-free

The names below load their module (and torch) on first use: the command line reads the registry without them.
"""
import sys
import types

import grpo.algorithm.loss_types  # noqa: F401 (registers the built-in policy losses)

_MODULES = {
    "advantages": ("ADVANTAGE_SCALES", "group_advantages", "kl_penalized_rewards", "reward_std"),
    "aggregation": ("aggregate", "aggregation_normaliser", "aggregation_numerator", "masked_mean"),
    "kl": ("KL_CLAMP", "kl_estimate", "kl_k3"),
    "logprobs": ("hidden_token_logprobs", "token_entropy", "token_logprobs"),
    "losses": ("LOG_RATIO_CLAMP", "SEQ_LOG_RATIO_CAP", "LossSettings", "cispo_token_loss", "gmpo_sequence_loss",
               "gmpo_sequence_weights", "importance_ratio", "policy_loss", "ppo_clip_token_loss", "sapo_token_loss",
               "token_log_ratio"),
    "rollout_correction": ("rollout_correction",),
    "sharded_logprobs": ("TokenScoring", "completion_scores", "shard_sequence", "shard_token_scores"),
    "registry": ("AGGREGATIONS", "CorrectionTerms", "LossTerms", "PolicyLoss", "RolloutCorrection", "get_policy_loss",
                 "get_rollout_correction", "register_policy_loss", "register_rollout_correction"),
}
_LAZY = {name: f"grpo.algorithm.{module}" for module, names in _MODULES.items() for name in names}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'grpo.algorithm' has no attribute {name!r}")


class _Package(types.ModuleType):
    """rollout_correction names a module and its function: once the module loads (which sets the package's attribute
    to it), grpo.algorithm.rollout_correction stays the function."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

# registers the built-in rollout corrections (no torch); imported after the swap, so that the package's
# rollout_correction stays the function
import grpo.algorithm.rollout_correction  # noqa: E402,F401
