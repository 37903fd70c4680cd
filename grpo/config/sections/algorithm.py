"""The GRPO algorithm: groups and sampling, the KL term, the clipped policy loss and its variants, aggregation,
advantage scaling, the rollout correction and dynamic sampling, and the checks of those options. The algorithm's
variants are named in grpo/algorithm/registry.py (the math finds them there too)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo.algorithm.registry import POLICY_LOSSES, ROLLOUT_CORRECTIONS, policy_losses_taking, rollout_mask_bands
from grpo.config.choices import (AGGREGATIONS, DEFAULT_ROLLOUT_CORRECTION, IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS,
                                 LOSS_TYPES, REWARD_SCALES, ROLLOUT_CORRECTION_NAMES)
from grpo.config.sections.option import need, option


def _corrections_help() -> str:
    """--rollout_correction's help: each registered correction with its --help phrase."""
    named = [f"{name} ({c.help})" if c.help else name for name, c in ROLLOUT_CORRECTIONS.items()]
    listed = ", ".join(named[:-1]) + " or " + named[-1] if len(named) > 1 else ", ".join(named)
    return f"How --rollout_is_correction corrects: {listed}. See docs/algorithm.md."


@dataclass
class AlgorithmOptions:
    k_samples: int = option(8, "Completions per prompt (the group size G); at least 2.", "grpo")
    rollout_max_new_tokens: int = option(256, "Longest completion in tokens.", "grpo")
    temperature: float = option(1.0, "Sampling temperature of rollouts (log-probs use the same temperature).",
                              "grpo")
    top_p: float = option(1.0, "Nucleus sampling of rollouts.", "grpo")
    kl_beta: float = option(0.0, "KL coefficient beta: adds beta * KL(policy || reference) to the loss (or, with "
                               "--kl_in_reward, subtracts it from the reward). 0: no KL term and no reference pass; "
                               "0.04 was GRPO's original value.", "grpo")
    kl_estimator: str = option("k3", "Per-token KL estimator in the loss: k1 (lp - ref), k2 (0.5 (lp - ref)^2) or k3 "
                                   "(low_var_kl).", "grpo", choices=KL_ESTIMATORS)
    kl_in_reward: bool = option(
        False, "With --kl_beta > 0: subtract beta * sum_t (lp - ref) (k1 over the completion) from each reward "
               "before advantages, instead of adding KL to the loss.", "grpo")
    entropy_coef: float = option(0.0, "Entropy bonus: the loss gets -entropy_coef x the aggregated token entropy "
                                    "(with gradient; 0 = off).", "grpo")
    clip_epsilon_low: float = option(0.2, "PPO clip: ratio is kept above 1 - eps_low.", "grpo")
    clip_epsilon_high: Optional[float] = option(
        None, "PPO clip: ratio is kept below 1 + eps_high (default: eps_low; DAPO uses 0.28).", "grpo")
    importance_sampling_level: str = option(
        "token", "PPO ratio per token, or per sequence (GSPO: exp of the mean token log-ratio, clipped with the same "
                 "eps; GSPO uses tiny ranges such as 3e-4 / 4e-4).", "grpo", choices=IMPORTANCE_SAMPLING_LEVELS)
    clip_ratio_c: Optional[float] = option(
        None, "Dual-clip PPO: for A < 0 the token loss is capped at -A x clip_ratio_c (> 1; verl uses 3). "
              "Default off.", "grpo")
    loss_aggregation: str = option("token_mean", "How token losses become one number: " + ", ".join(AGGREGATIONS),
                                 "grpo", choices=AGGREGATIONS)
    scale_rewards: str = option("batch", "Advantage scaling: (r - group mean) divided by the std of the step's whole "
                              "batch (batch), of the group (group, the original GRPO), or not divided (none, "
                              "Dr. GRPO).", "grpo", choices=REWARD_SCALES)
    num_iterations: int = option(1, "Optimizer updates per rollout batch (mu); >1 reuses stored old log-probs.",
                               "grpo")
    mask_truncated_completions: bool = option(
        False, "Exclude completions that hit --rollout_max_new_tokens from the loss.", "grpo")
    rollout_is_correction: Optional[bool] = option(
        None, "Weight the loss by min(exp(trainer_old - rollout logprob), cap) (truncated IS). Default: on with "
              "--async_rollout or --max_staleness (their rollouts come from policies steps behind), off otherwise.",
        "grpo",
        nargs="?", const=True)  # a bare flag still means true
    rollout_is_cap: float = option(2.0, "Cap of the truncated importance-sampling weight.", "grpo")
    rollout_correction: Optional[str] = option(None, _corrections_help(), "grpo", choices=ROLLOUT_CORRECTION_NAMES)
    rollout_mask_low: Optional[float] = option(
        None, "Lower bound of the masking band of --rollout_correction (default per mode: "
              + ", ".join(f"{m} {lo}" for m, (lo, _) in rollout_mask_bands().items()) + ").", "grpo")
    rollout_mask_high: Optional[float] = option(
        None, "Upper bound of the masking band (default per mode: "
              + ", ".join(f"{m} {hi}" for m, (_, hi) in rollout_mask_bands().items()) + ").", "grpo")
    loss_type: str = option(
        "ppo_clip", "Policy loss: ppo_clip (GRPO / DAPO / GSPO, with the clip options above), cispo (clipped, "
                    "stop-gradient IS weight on every token's log-prob; clip = --clip_epsilon_low/high), sapo "
                    "(soft sigmoid gate instead of the clip; --sapo_tau_pos/neg) or gmpo (geometric mean of the "
                    "token ratios, clipped in log space by --clip_epsilon_low/high; the paper uses 0.4). "
                    "See docs/algorithm.md.", "grpo", choices=LOSS_TYPES)
    sapo_tau_pos: float = option(1.0, "SAPO gate temperature for tokens with A > 0.", "grpo")
    sapo_tau_neg: float = option(1.05, "SAPO gate temperature for tokens with A <= 0 (larger: damped sooner).", "grpo")
    filter_zero_std_groups: bool = option(
        False, "Dynamic sampling (DAPO): drop groups whose rewards are all equal and draw more prompts until the "
               "step has its prompts; each draw consumes data (epochs pass faster).", "grpo")
    max_generation_rounds: int = option(
        3, "With --filter_zero_std_groups, most rollout rounds per step; after them the step is topped up with "
           "uniform groups (advantage 0).", "grpo")

    def check_algorithm(self) -> None:
        need(self.loss_aggregation in AGGREGATIONS, "loss_aggregation",
             f"got '{self.loss_aggregation}', choose one of {', '.join(AGGREGATIONS)}")
        need(self.scale_rewards in REWARD_SCALES, "scale_rewards",
             f"got '{self.scale_rewards}', choose one of {', '.join(REWARD_SCALES)}")
        need(self.k_samples >= 2, "k_samples",
             f"must be at least 2 (got {self.k_samples}): group-relative advantages need a group to compare with")
        need(self.rollout_max_new_tokens > 0, "rollout_max_new_tokens", "must be > 0")
        need(self.temperature > 0, "temperature", "must be > 0 (use --eval_greedy for greedy eval)")
        need(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(self.kl_beta >= 0, "kl_beta", "must be >= 0")
        need(0.0 < self.clip_epsilon_low < 1.0, "clip_epsilon_low", "must be in (0, 1)")
        need(self.clip_epsilon_high > 0, "clip_epsilon_high", "must be > 0")
        need(self.num_iterations >= 1, "num_iterations", "must be >= 1")
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator",
             f"got '{self.kl_estimator}', choose one of {', '.join(KL_ESTIMATORS)}")
        need(not self.kl_in_reward or self.kl_beta > 0, "kl_in_reward",
             "needs --kl_beta > 0: it moves that penalty from the loss into the reward")
        need(self.entropy_coef >= 0, "entropy_coef", f"must be >= 0 (a bonus on entropy), got {self.entropy_coef}")
        need(self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level",
             f"got '{self.importance_sampling_level}', choose one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
        need(self.clip_ratio_c is None or self.clip_ratio_c > 1.0, "clip_ratio_c",
             f"must be > 1 (the cap -A x c must lie above the clipped loss), got {self.clip_ratio_c}")
        need(self.max_generation_rounds >= 1, "max_generation_rounds", "must be >= 1")
        need(self.rollout_is_cap >= 1.0, "rollout_is_cap", "must be >= 1")
        self._check_loss_and_correction()

    def _check_loss_and_correction(self) -> None:
        """--loss_type and its settings, and --rollout_correction's band."""
        need(self.loss_type in LOSS_TYPES, "loss_type",
             f"got '{self.loss_type}', choose one of {', '.join(LOSS_TYPES)}")
        need(self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0, "sapo_tau_pos",
             f"SAPO's temperatures must be > 0, got --sapo_tau_pos {self.sapo_tau_pos} --sapo_tau_neg "
             f"{self.sapo_tau_neg}")
        loss = POLICY_LOSSES[self.loss_type]
        need(self.importance_sampling_level == "token" or loss.sequence_ratio, "importance_sampling_level",
             f"'sequence' goes with --loss_type {' or '.join(policy_losses_taking('sequence_ratio'))}; "
             f"{self.loss_type} takes token ratios (gmpo forms its own geometric mean): drop "
             f"--importance_sampling_level or choose another loss")
        need(self.clip_ratio_c is None or loss.dual_clip, "clip_ratio_c",
             f"the dual clip applies to --loss_type {' / '.join(policy_losses_taking('dual_clip'))} only; drop it "
             f"with --loss_type {self.loss_type}")
        mode = self.rollout_correction
        need(mode is None or mode in ROLLOUT_CORRECTIONS, "rollout_correction",
             f"got '{mode}', choose one of {', '.join(ROLLOUT_CORRECTIONS)}")
        need(mode is None or self.rollout_is_correction is not None or self.is_correction, "rollout_correction",
             f"'{mode}' corrects only with --rollout_is_correction (on by default with --async_rollout / "
             f"--max_staleness only): add --rollout_is_correction true")
        bands = rollout_mask_bands()  # the masking corrections' default bands; the others truncate at the cap
        given = [name for name in ("rollout_mask_low", "rollout_mask_high") if getattr(self, name) is not None]
        for name in given:
            need(mode in bands, name,
                 f"sets the band of --rollout_correction {' / '.join(bands)}; the truncating ones "
                 f"(--rollout_correction {mode or DEFAULT_ROLLOUT_CORRECTION}) use --rollout_is_cap")
        if mode in bands:
            low = bands[mode][0] if self.rollout_mask_low is None else self.rollout_mask_low
            high = bands[mode][1] if self.rollout_mask_high is None else self.rollout_mask_high
            need(0.0 <= low < high, "rollout_mask_low" if self.rollout_mask_low is not None else "rollout_mask_high",
                 f"the band needs 0 <= low < high (ratios), got {low} .. {high}")
