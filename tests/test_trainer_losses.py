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
