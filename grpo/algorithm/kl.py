"""KL estimators between the policy and the reference, per token.

Shapes: N = completions (B prompts x group size G), T = completion tokens, V = vocabulary.
"""
from __future__ import annotations

import torch

from grpo.algorithm.registry import KL_ESTIMATORS


KL_CLAMP = 10.0  # bound on the k3 log-ratio before exp and on k3 itself


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref) (Schulman, "Approximating KL divergence", 2020):

        k3 = exp(ref - lp) - (ref - lp) - 1       (>= 0; unbiased for samples drawn from pi)
    Two clamps keep one token the policy has moved far from the reference from blowing up the loss:
    the log-ratio (ref - lp) is clamped to [-10, 10] before exp, and the result k3 to [-10, 10].
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-KL_CLAMP, KL_CLAMP)                  # [N, T]
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-KL_CLAMP, KL_CLAMP)      # [N, T]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman 2020), d = lp - ref:

        k1 = d                  (unbiased, can be negative; its sequence sum is the KL-in-reward penalty)
        k2 = 0.5 * d^2          (biased, >= 0; its gradient is that of KL for on-policy samples)
        k3 = exp(-d) + d - 1    ("low_var_kl": unbiased, >= 0, clamped as in kl_k3)
    logprobs / ref_logprobs [N, T] -> [N, T].
    """
    if estimator == "k3":
        return kl_k3(logprobs, ref_logprobs)
    d = logprobs - ref_logprobs                                                       # [N, T]
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    raise ValueError(f"unknown KL estimator '{estimator}' (use one of {', '.join(KL_ESTIMATORS)})")
