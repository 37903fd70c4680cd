"""End to end on CPU with the tiny model: each --loss_type trains, and the mismatch corrections' metrics (share
masked, mean weight) reach metrics.jsonl."""
import math

import pytest
import torch

from grpo.train.trainer import GRPOTrainer

from .trainer_setup import even_tokens, tiny_config, train_rows, trainable_weights


@pytest.mark.parametrize("loss_type,extra", [("cispo", {"clip_epsilon_high": 4.0}),
                                             ("sapo", {}),
                                             ("gmpo", {"clip_epsilon_low": 0.4, "clip_epsilon_high": 0.4,
                                                       "loss_aggregation": "seq_mean_token_mean"})])
def test_each_loss_type_trains(tiny_model, registry, tmp_path, loss_type, extra):
    # two updates per batch, so the second one sees ratios away from 1
    config = tiny_config(tiny_model, registry, str(tmp_path), max_steps=2, num_iterations=2, eval_on_start=False,
                         loss_type=loss_type, **extra)
    trainer = GRPOTrainer(config, reward_funcs=[even_tokens])
    before = trainable_weights(trainer)
    trainer.train()
    rows = train_rows(tmp_path)
    assert len(rows) == 2 and all(r["reward/std"] > 0 for r in rows)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows), rows
    after = trainable_weights(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_masking_corrections_log_the_share_masked_and_the_mean_weight(tiny_model, registry, tmp_path):
    """The fp32 HF engine samples the trainer's own policy (ratios 1): a sequence_mask band of 1.5 .. 3 masks every
    token (weight 0, nothing to learn), and the step says so."""
    config = tiny_config(tiny_model, registry, str(tmp_path), max_steps=2, eval_on_start=False,
                         rollout_is_correction=True, rollout_correction="sequence_mask", rollout_mask_low=1.5)
    GRPOTrainer(config, reward_funcs=[even_tokens]).train()
    rows = train_rows(tmp_path)
    assert len(rows) == 2
    assert all(r["rollout/is_masked_frac"] == 1.0 and r["rollout/is_weight_mean"] == 0.0 for r in rows), rows
    assert all(r["pg_loss"] == 0.0 for r in rows)


def test_geometric_mask_keeps_a_matching_engine(tiny_model, registry, tmp_path):
    config = tiny_config(tiny_model, registry, str(tmp_path), max_steps=1, eval_on_start=False,
                         rollout_is_correction=True, rollout_correction="geometric_mask")
    GRPOTrainer(config, reward_funcs=[even_tokens]).train()
    (row,) = train_rows(tmp_path)
    assert row["rollout/is_masked_frac"] == 0.0 and row["rollout/is_weight_mean"] == pytest.approx(1.0)


def test_loss_and_correction_flags_parse():
    from grpo.config import parse_args

    cfg = parse_args(["--loss_type", "sapo", "--sapo_tau_pos", "0.5", "--sapo_tau_neg", "2", "--rollout_is_correction",
                      "--rollout_correction", "icepop", "--rollout_mask_low", "0.4", "--rollout_mask_high", "4"])
    assert (cfg.loss_type, cfg.sapo_tau_pos, cfg.sapo_tau_neg) == ("sapo", 0.5, 2.0)
    assert (cfg.is_correction, cfg.rollout_correction, cfg.rollout_mask_low, cfg.rollout_mask_high) == \
        (True, "icepop", 0.4, 4.0)
    assert parse_args([]).loss_type == "ppo_clip" and parse_args([]).rollout_correction is None


@pytest.mark.parametrize("args, message", [
    (["--loss_type", "cispo", "--importance_sampling_level", "sequence"], "--importance_sampling_level: 'sequence' goes"),
    (["--loss_type", "gmpo", "--clip_ratio_c", "3"], "--clip_ratio_c: the dual clip applies to --loss_type ppo_clip"),
    (["--loss_type", "sapo", "--sapo_tau_neg", "0"], "--sapo_tau_pos: SAPO's temperatures must be > 0"),
    (["--rollout_correction", "icepop"], "add --rollout_is_correction true"),
    (["--rollout_is_correction", "--rollout_mask_high", "4"], "--rollout_mask_high: sets the band"),
    (["--rollout_is_correction", "--rollout_correction", "geometric_mask", "--rollout_mask_low", "1.2"],
     "0 <= low < high"),
])
def test_loss_and_correction_flags_are_validated(args, message):
    from grpo.config import parse_args
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_args(args)


def test_a_bad_loss_flag_fails_before_any_model_loads():
    from .test_cli import assert_clean_failure, run_cli

    proc, seconds = run_cli("--loss_type", "geo_mean")
    assert_clean_failure(proc, "--loss_type", "invalid choice")
    proc, seconds = run_cli("--loss_type", "gmpo", "--clip_ratio_c", "3")
    assert_clean_failure(proc, "--clip_ratio_c", "ppo_clip only")
    assert seconds < 60


def test_a_registered_correction_trains_through_the_config(tiny_model, registry, tmp_path):
    """A correction of one's own, registered by name, is what --rollout_correction names in the trainer's update."""
    from grpo.algorithm import register_rollout_correction
    from grpo.algorithm.registry import ROLLOUT_CORRECTIONS

    calls = []

    @register_rollout_correction("quarter")
    def quarter(c):
        calls.append(c.log_ratio.shape)
        return c.mask * 0.25, None, None                                         # w_t = 1/4 on every token

    try:
        config = tiny_config(tiny_model, registry, str(tmp_path), max_steps=1, eval_on_start=False,
                             rollout_is_correction=True, rollout_correction="quarter")
        GRPOTrainer(config, reward_funcs=[even_tokens]).train()
    finally:
        del ROLLOUT_CORRECTIONS["quarter"]
    (row,) = train_rows(tmp_path)
    assert calls and row["rollout/is_weight_mean"] == pytest.approx(0.25)
    assert row["rollout/is_masked_frac"] == 0.0 and row["rollout/is_capped_frac"] == 0.0
