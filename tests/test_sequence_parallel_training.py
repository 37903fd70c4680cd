"""GRPO training end to end with --sequence_parallel_size 2 on 2 gloo CPU ranks (one group, ZeRO-2 and ZeRO-3, the HF
engine): with --sequence_parallel_rollout first the group's first rank generates and shares its rollouts, both ranks
score and train 1/2 of every row, and each step's loss, rewards and advantages equal those of the same run on one
process (which draws the same prompts: one data-parallel rank either way); with share (the default) each rank
generates its share of every prompt's completions and the group gathers them in order."""
import json
import os

import pytest
import torch

from tests.spawn_ranks import join_world, spawn_ranks
from tests.tiny_models import make_tiny_model_dir
from tests.trainer_setup import (add_dataset, assert_same_weights, even_tokens, tiny_config, train_rows,
                                  trainable_weights, write_prompt_registry)

COMPARED = ("loss", "pg_loss", "reward/mean", "reward/std", "advantage/abs_mean", "completion/length_mean")


def _train(rank, port, world, model, registry, out, sp_size, zero):
    join_world(rank, port, world)  # GRPOTrainer starts the process group from it
    os.environ["WANDB_MODE"] = "disabled"
    from grpo.train.trainer import GRPOTrainer

    config = tiny_config(model, registry, out, sequence_parallel_size=sp_size, max_steps=2, scale_rewards="batch",
                         kl_beta=0.05, deepspeed=zero, sequence_parallel_rollout="first")
    trainer = GRPOTrainer(config, reward_funcs=[even_tokens])
    trainer.train()
    trainer.close()


def _run(tmp_path, name, world, sp_size, zero):
    out = str(tmp_path / name)
    spawn_ranks(_train, world, str(tmp_path / "model"), str(tmp_path / "data" / "registry.json"), out, sp_size, zero,
                nprocs=world)
    return out


def _completions(out, rank):
    with open(os.path.join(out, "completions", f"rank{rank}.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_two_ranks_in_one_group_train_as_one_process(tmp_path, zero):
    make_tiny_model_dir(str(tmp_path / "model"))
    write_prompt_registry(str(tmp_path / "data"))
    one = _run(tmp_path, "one", world=1, sp_size=1, zero=zero)
    sp = _run(tmp_path, "sp", world=2, sp_size=2, zero=zero)

    with open(os.path.join(sp, "train.log")) as fh:
        assert "sequence parallel: 1 group of 2 ranks" in fh.read()
    # the group's rollouts are the first rank's, written once (by it); the equal rewards and losses below show that
    # the second rank trained on them too
    assert _completions(sp, 0) == _completions(one, 0)
    assert not os.path.exists(os.path.join(sp, "completions", "rank1.jsonl"))
    expected, got = train_rows(one), train_rows(sp)
    assert [r["step"] for r in got] == [1, 2]
    assert any(r["loss"] != 0 for r in expected) and any(r["reward/std"] > 0 for r in expected)
    for mine, theirs in zip(got, expected):
        for key in COMPARED:
            assert abs(mine[key] - theirs[key]) < 1e-4, (mine["step"], key, mine[key], theirs[key])
    assert torch.isfinite(torch.tensor([r["grad_norm"] for r in got])).all()


def _train_and_keep_weights(rank, port, world, model, registry, out, overrides):
    join_world(rank, port, world)  # GRPOTrainer starts the process group from it
    os.environ["WANDB_MODE"] = "disabled"
    from grpo.train.trainer import GRPOTrainer

    trainer = GRPOTrainer(tiny_config(model, registry, out, **overrides), reward_funcs=[even_tokens])
    trainer.train()
    import deepspeed

    trained = [p for p in trainer.engine.module.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(trained):  # whole on every rank under ZeRO-3 (collective); else a no-op
        weights = trainable_weights(trainer)
    if rank == 0:
        torch.save(weights, os.path.join(out, "final_weights.pt"))
    trainer.close()


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_a_sequence_parallel_run_resumes_exactly(tmp_path, zero):
    """SP 2 on 2 ranks (LoRA dropout drawing from each rank's generator), 3 steps straight through against
    the same run stopped after step 1 and resumed from its checkpoint: same later steps, same adapter."""
    import shutil

    make_tiny_model_dir(str(tmp_path / "model"))
    write_prompt_registry(str(tmp_path / "data"))
    overrides = dict(sequence_parallel_size=2, max_steps=3, save_steps=1, save_total_limit=5, lora_dropout=0.1,
                     deepspeed=zero)
    args = (str(tmp_path / "model"), str(tmp_path / "data" / "registry.json"))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    spawn_ranks(_train_and_keep_weights, 2, *args, str(straight), overrides)
    os.makedirs(resumed)
    shutil.copytree(straight / "checkpoint-1", resumed / "checkpoint-1")
    spawn_ranks(_train_and_keep_weights, 2, *args, str(resumed), {**overrides, "resume_from_checkpoint": "latest"})

    expected, got = train_rows(straight), train_rows(resumed)
    assert [r["step"] for r in got] == [2, 3]
    for mine, theirs in zip(got, expected[1:]):
        for key in COMPARED:
            assert abs(mine[key] - theirs[key]) < 1e-6, (mine["step"], key, mine[key], theirs[key])
    assert_same_weights(torch.load(resumed / "final_weights.pt"), torch.load(straight / "final_weights.pt"))


def _warm_start_then_train(rank, port, world, model, registry, out):
    join_world(rank, port, world)  # GRPOTrainer starts the process group from it
    os.environ["WANDB_MODE"] = "disabled"
    from grpo.train.trainer import GRPOTrainer

    config = tiny_config(model, registry, out, sequence_parallel_size=world, dataset_names=["calc_toy", "toy"],
                         warm_start_steps=3, max_steps=1, max_prompt_length=224, max_seq_length=320, max_turns=2,
                         eval_on_start=False, deepspeed="zero2", sequence_parallel_rollout="first")
    trainer = GRPOTrainer(config, reward_funcs=[even_tokens])
    trainer.train()
    if rank == 0:
        with open(os.path.join(out, "warm_start_losses.json"), "w") as fh:
            json.dump(trainer.warm_start_losses, fh)
    trainer.close()


def test_a_warm_start_under_sequence_parallel_equals_one_process(tmp_path):
    """--warm_start_steps with SP 2 on 2 ranks: the group takes the demonstrations one data-parallel rank would, and
    each supervised step's loss (the demonstrations' negative log-likelihood) and the GRPO step after it equal those
    of one process."""
    from tests.test_warm_start import demonstration_rows, demonstrations_registry

    make_tiny_model_dir(str(tmp_path / "model"))
    registry = demonstrations_registry(tmp_path / "data", demonstration_rows(8))
    runs = {}
    for name, world in (("one", 1), ("sp", 2)):
        out = str(tmp_path / name)
        spawn_ranks(_warm_start_then_train, world, str(tmp_path / "model"), registry, out, nprocs=world)
        with open(os.path.join(out, "warm_start_losses.json")) as fh:
            runs[name] = (json.load(fh), train_rows(out))
    (one_losses, one_rows), (sp_losses, sp_rows) = runs["one"], runs["sp"]
    assert len(sp_losses) == 3 and sp_losses[-1] < sp_losses[0]  # the demonstrated turns became likelier
    assert sp_losses == pytest.approx(one_losses, abs=1e-5)
    assert [r["step"] for r in sp_rows] == [1]
    for key in COMPARED:
        assert abs(sp_rows[0][key] - one_rows[0][key]) < 1e-4, (key, sp_rows[0][key], one_rows[0][key])


def _collect_in_shares(rank, port, world, model, registry, out, overrides):
    """One step's rollouts of an SP 2 group with --sequence_parallel_rollout share, each rank's engine watched: what
    it was asked and what it generated, and the rollout the group ended with, saved by rank 0 for both ranks."""
    join_world(rank, port, world)  # GRPOTrainer starts the process group from it
    os.environ["WANDB_MODE"] = "disabled"
    import torch.distributed as dist

    from grpo.train.trainer import GRPOTrainer

    config = tiny_config(model, registry, out, sequence_parallel_size=2, k_samples=3, eval_on_start=False,
                         **overrides)
    trainer = GRPOTrainer(config, reward_funcs=[even_tokens])
    engine, asked = trainer.rollouts.engine, []
    generate = engine.generate

    def watched(prompt_token_ids, sampling, images=None):  # the real generate, its calls noted
        completions = generate(prompt_token_ids, sampling, images)
        asked.append({"prompts": len(prompt_token_ids), "n": sampling.n,
                      "token_ids": [c.token_ids for c in completions]})
        return completions

    engine.generate = watched
    kept, _ = trainer.rollouts.collect(trainer.state)
    mine = {"asked": asked, "prompts": [p["index"] for p in kept.prompts],
            "token_ids": [c.token_ids for c in kept.completions], "rewards": kept.result.total,
            "engine_tokens": kept.times["_rollout_tokens"], "sizes": trainer.rollouts.sizes}
    both = [None] * world
    dist.all_gather_object(both, mine)
    if rank == 0:
        with open(os.path.join(out, "shares.json"), "w") as fh:
            json.dump(both, fh)
    trainer.close()


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_a_group_s_ranks_generate_shares_of_every_prompt_s_completions(tmp_path, zero):
    """k = 3 over a group of 2: rank 0's engine samples 2 of every prompt's completions, rank 1's the third (under
    ZeRO-3 both take part in every forward anyway); both ranks end with the same rollout, each prompt's completions
    rank 0's then rank 1's, and the two engines' samples differ (each rank's own generator)."""
    make_tiny_model_dir(str(tmp_path / "model"))
    registry = write_prompt_registry(str(tmp_path / "data"))
    out = str(tmp_path / "out")
    spawn_ranks(_collect_in_shares, 2, str(tmp_path / "model"), registry, out, {"deepspeed": zero})
    with open(os.path.join(out, "shares.json")) as fh:
        first, second = json.load(fh)
    assert first["prompts"] == second["prompts"] and len(first["prompts"]) == 2  # one data-parallel rank's prompts
    assert first["token_ids"] == second["token_ids"] and first["rewards"] == second["rewards"]
    assert [(a["prompts"], a["n"]) for a in first["asked"]] == [(2, 2)]
    assert [(a["prompts"], a["n"]) for a in second["asked"]] == [(2, 1)]
    zeros, ones = first["asked"][0]["token_ids"], second["asked"][0]["token_ids"]
    expected = zeros[0:2] + ones[0:1] + zeros[2:4] + ones[1:2]  # prompt 0: rank 0's two, rank 1's one; then prompt 1
    assert first["token_ids"] == expected
    assert all(ids not in zeros for ids in ones)  # rank 1 drew samples of its own
    # the throughput metric counts each rank's own engine's tokens; the out-of-memory sizes name its share
    assert first["engine_tokens"] == sum(map(len, zeros)) and second["engine_tokens"] == sum(map(len, ones))
    assert first["sizes"]["completions per rank"] == 6 and first["sizes"]["generated per rank (its share)"] == 4
    assert second["sizes"]["generated per rank (its share)"] == 2


def test_a_group_s_ranks_play_shares_of_every_prompt_s_episodes(tmp_path):
    """Multi-turn rows (the calculator) in shares too: each rank plays its share of every prompt's episodes, turn by
    turn on its own engine, and the group ends with every prompt's k episodes on both ranks."""
    make_tiny_model_dir(str(tmp_path / "model"))
    registry = write_prompt_registry(str(tmp_path / "data"))
    add_dataset(registry, "calc_toy", [(f"What is {a} + 3?", str(a + 3)) for a in range(1, 9)], tools=["calculator"])
    out = str(tmp_path / "out")
    overrides = {"deepspeed": "zero2", "dataset_names": ["calc_toy"], "max_prompt_length": 224,
                 "max_seq_length": 320, "max_turns": 2}
    spawn_ranks(_collect_in_shares, 2, str(tmp_path / "model"), registry, out, overrides)
    with open(os.path.join(out, "shares.json")) as fh:
        first, second = json.load(fh)
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 2 * 3
    # the first turn asks each engine for its share of every prompt's episodes: 2 + 1
    assert (first["asked"][0]["prompts"], first["asked"][0]["n"]) == (2, 2)
    assert (second["asked"][0]["prompts"], second["asked"][0]["n"]) == (2, 1)
