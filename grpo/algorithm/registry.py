"""The algorithm's variants by name, known before torch loads (GRPOConfig's choices, --help and its checks read them
from here, through grpo.config.choices; the math never reads the config).

A policy loss is one function registered by name, as verl's core_algos registers its own:

    @register_policy_loss("my_loss")
    def my_loss(terms: LossTerms):
        pg = -terms.adv * terms.ratio                                   # pg_t [N, T]
        return pg, None, None                                           # + the clipped tokens, low and high (or None)

is --loss_type my_loss for GRPOConfig (once registered), and policy_loss computes it. The built-in ones are in
loss_types.py. The other variants are plain lists of names: each is one branch of its function's math.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
ROLLOUT_CORRECTIONS = ("token_truncate", "sequence_truncate", "sequence_mask", "icepop", "geometric_mask")
# the default band [low, high] of each masking correction (grpo.algorithm.rollout_correction)
ROLLOUT_MASK_BANDS = {"sequence_mask": (0.0, 3.0), "icepop": (0.5, 5.0), "geometric_mask": (0.999, 1.001)}


@dataclass(frozen=True)
class LossTerms:
    """What a policy loss is given (policy_loss forms it per micro-batch); tensors are [N, T] unless said."""
    logprobs: Any         # lp, with gradient
    old_logprobs: Any     # old, no gradient
    ratio: Any            # importance_ratio(lp, old, mask, importance_sampling_level)
    adv: Any              # A [N, 1], no gradient
    mask: Any             # 1 on completion tokens, in logprobs' dtype
    eps_low: float        # the clip range (LossSettings.eps_low, .upper_eps)
    eps_high: float
    settings: Any         # the LossSettings, for a loss's own settings (sapo_tau_pos / neg)


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: `fn(terms) -> (pg, clipped_low, clipped_high)`, pg [N, T] the token loss before the
    dual clip and the correction weights, clipped_low / high [N, T] bool the tokens whose clip bound held (None: the
    loss has no clip), and the options it takes."""
    name: str
    fn: Callable[[LossTerms], tuple]
    sequence_ratio: bool    # takes --importance_sampling_level sequence (GSPO's ratio); else token ratios only
    dual_clip: bool         # takes --clip_ratio_c
    sequence_weights: bool  # the correction weights act on the whole sequence: their geometric mean (gmpo)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, sequence_ratio: bool = False, dual_clip: bool = False,
                         sequence_weights: bool = False):
    """Decorator: make `fn(terms: LossTerms) -> (pg, clipped_low, clipped_high)` the policy loss `name`
    (--loss_type name). Registering a name again replaces its loss."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_policy_loss needs a non-empty loss name, got {name!r}")

    def decorator(fn: Callable) -> Callable:
        POLICY_LOSSES[name] = PolicyLoss(name, fn, sequence_ratio, dual_clip, sequence_weights)
        return fn
    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered as `name`; ValueError naming the registered ones when there is none."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown loss_type '{name}' (use one of {', '.join(POLICY_LOSSES)})")
    return POLICY_LOSSES[name]


def policy_losses_taking(option: str) -> list[str]:
    """The names of the losses that take `option` ('sequence_ratio' or 'dual_clip'), in registration order."""
    return [name for name, loss in POLICY_LOSSES.items() if getattr(loss, option)]
