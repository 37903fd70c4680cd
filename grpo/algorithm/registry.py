"""The algorithm's variants by name, known before torch loads (GRPOConfig's choices, --help and its checks read them
from here, through grpo.config.choices; the math never reads the config).

A policy loss is one function registered by name, as verl's core_algos registers its own:

    @register_policy_loss("my_loss")
    def my_loss(terms: LossTerms):
        pg = -terms.adv * terms.ratio                                   # pg_t [N, T]
        return pg, None, None                                           # + the clipped tokens, low and high (or None)

is --loss_type my_loss for GRPOConfig (once registered), and policy_loss computes it. The built-in ones are in
loss_types.py. A rollout correction (the engine-trainer mismatch's weights) is registered the same way:

    @register_rollout_correction("my_mask", band=(0.5, 2.0), help="the token's ratio, 0 outside the band")
    def my_mask(c: CorrectionTerms):
        keep = (c.log_ratio >= math.log(c.low)) & (c.log_ratio <= math.log(c.high))      # [N, T]
        return c.log_ratio.exp() * keep, None, ~keep                    # w + the capped and the masked tokens (or None)

is --rollout_correction my_mask (its band --rollout_mask_low / high), and rollout_correction computes it; the built-in
ones are in rollout_correction.py. The other variants are plain lists of names: each is one branch of its function's
math.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
ADVANTAGE_SCALES = ("group", "batch", "none")  # the divisor of group_advantages (--scale_rewards)
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


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


@dataclass(frozen=True)
class CorrectionTerms:
    """What a rollout correction is given (rollout_correction forms it, without gradient); tensors are [N, T]."""
    log_ratio: Any        # d_t = trainer_t - rollout_t on completion tokens, 0 elsewhere
    seq_log_ratio: Any    # D_i = sum_t d_t, the sequence's log-ratio, on each of its tokens
    mask: Any             # 1 on completion tokens, in the log-probs' dtype
    cap: float            # --rollout_is_cap (a truncating correction's bound)
    low: Optional[float]  # the band (a masking correction's, --rollout_mask_low / high or its default; else None)
    high: Optional[float]


@dataclass(frozen=True)
class RolloutCorrection:
    """A registered rollout correction: `fn(terms) -> (w, capped, masked)`, w [N, T] the loss's token weights,
    capped / masked [N, T] bool the tokens cut to the cap / set to 0 (None: none); band the default [low, high] of
    a masking correction (None: it takes --rollout_is_cap, not a band); help its --help phrase."""
    name: str
    fn: Callable[[CorrectionTerms], tuple]
    band: Optional[tuple[float, float]]
    help: str


ROLLOUT_CORRECTIONS: dict[str, RolloutCorrection] = {}
DEFAULT_ROLLOUT_CORRECTION = "token_truncate"  # --rollout_correction's meaning when not given


def register_rollout_correction(name: str, *, band: Optional[tuple[float, float]] = None, help: str = ""):
    """Decorator: make `fn(terms: CorrectionTerms) -> (w, capped, masked)` the rollout correction `name`
    (--rollout_correction name); `band` (low, high) makes it a masking one, its band set by --rollout_mask_low / high.
    Registering a name again replaces its correction."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_rollout_correction needs a non-empty correction name, got {name!r}")
    if band is not None and not 0.0 <= band[0] < band[1]:
        raise ValueError(f"a rollout correction's band needs 0 <= low < high, got {band}")

    def decorator(fn: Callable) -> Callable:
        ROLLOUT_CORRECTIONS[name] = RolloutCorrection(name, fn, None if band is None else tuple(band), help)
        return fn
    return decorator


def get_rollout_correction(name: str) -> RolloutCorrection:
    """The correction registered as `name`; ValueError naming the registered ones when there is none."""
    if name not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction '{name}' (use one of {', '.join(ROLLOUT_CORRECTIONS)})")
    return ROLLOUT_CORRECTIONS[name]


def rollout_mask_bands() -> dict[str, tuple[float, float]]:
    """Each masking correction's default band [low, high], in registration order."""
    return {name: c.band for name, c in ROLLOUT_CORRECTIONS.items() if c.band is not None}
