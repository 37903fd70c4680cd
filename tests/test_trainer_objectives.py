"""End to end on CPU with the tiny model: each objective option on (GSPO, dual-clip, KL estimators / KL in reward,
entropy bonus, dynamic sampling, overlong shaping, math-verify, reward models), and dynamic sampling's exact resume."""
import json
import math

import pytest
import torch

from grpo.train.step_data import StepData
from grpo.train.trainer import GRPOTrainer

from .test_trainer import pick_target
from .tiny_models import make_tiny_reward_model_dir
from .trainer_setup import even_tokens, tiny_config, train_rows, trainable_weights, write_prompt_registry


def test_gspo_dual_clip_entropy_and_kl_estimator(tiny_model, registry, tmp_path):
    config = tiny_config(tiny_model, registry, str(tmp_path), max_steps=2, importance_sampling_level="sequence",
                         clip_epsilon_low=3e-4, clip_epsilon_high=4e-4, clip_ratio_c=3.0, entropy_coef=0.01,
                         kl_beta=0.1, kl_estimator="k2", num_iterations=2,
                         eval_on_start=False)
    GRPOTrainer(config).train()
    rows = train_rows(tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert all(torch.isfinite(torch.tensor([row["loss"], row["kl"], row["entropy"], row["grad_norm"]])))
        assert 0.0 <= row["clip_frac_dual"] <= 1.0
        # the entropy term is in the loss: -0.01 x the aggregated entropy
        assert row["entropy_loss"] == pytest.approx(-0.01 * row["entropy"], rel=1e-4)
        assert row["kl"] >= 0.0  # k2 = 0.5 d^2


def test_cli_run_with_kl_in_reward_reward_model_overlong_and_math_verify(tiny_model, tmp_path):
    pytest.importorskip("math_verify")
    import train_grpo

    rm = make_tiny_reward_model_dir(str(tmp_path / "tiny_rm"))
    registry = write_prompt_registry(str(tmp_path / "data"))
    with open(registry) as fh:
        entries = json.load(fh)
    entries["toy"]["rewards"] = {"math_verify_accuracy": 1.0, "tiny_rm": 0.5, "overlong_penalty": 1.0}
    entries["toy"]["reward_kwargs"] = {"overlong_penalty": {"max_length": 8, "buffer_length": 4}}
    with open(registry, "w") as fh:
        json.dump(entries, fh)
    out = tmp_path / "run"
    argv = ["--model_name_or_path", tiny_model, "--dataset_config_path", registry, "--dataset_names", "toy",
            "--output_dir", str(out), "--per_device_train_batch_size", "2", "--k_samples", "4",
            "--rollout_max_new_tokens", "8", "--max_prompt_length", "32", "--max_seq_length", "48",
            "--max_steps", "2", "--save_steps", "0", "--eval_max_prompts", "2", "--lora_rank", "4",
            "--lora_alpha", "8", "--reward_model", rm, "--kl_beta", "0.1", "--kl_in_reward",
            "--eval_on_start", "false"]
    assert train_grpo.main(argv) == 0
    rows = train_rows(out)
    assert len(rows) == 2
    for row in rows:
        assert {"rewards/tiny_rm", "rewards/math_verify_accuracy", "rewards/overlong_penalty",
                "reward/kl_penalized_mean"} <= set(row)
        assert row["rewards/overlong_penalty"] <= 0.0
    # the first step samples from the base policy: lp = ref, so the KL penalty is 0 and rewards are unchanged
    assert rows[0]["reward/kl_penalized_mean"] == pytest.approx(rows[0]["reward/mean"], abs=1e-5)
    # the KL is not in the loss (beta 0 there) but still logged: after one update the policy has moved
    assert rows[1]["kl"] > 0.0


def contains_target(target_id):
    """1 when the completion has token `target_id`: most groups of a random policy are all 0 (uniform)."""
    def has_target(completions, answers, completion_ids, **row):
        return [float(target_id in ids) for ids in completion_ids]
    return has_target


def test_dynamic_sampling_draws_more_rounds_and_resumes_exactly(tiny_model, registry, tmp_path):
    reward = contains_target(pick_target(tiny_model))
    common = dict(max_steps=4, save_steps=2, filter_zero_std_groups=True, max_generation_rounds=3,
                  per_device_train_batch_size=2, k_samples=4, eval_on_start=False, train_split_ratio=1.0,
                  logprob_check_steps=1)
    straight = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path / "a"), **common), reward_funcs=[reward])
    straight.train()
    rows_a = train_rows(tmp_path / "a")
    assert [r["step"] for r in rows_a] == [1, 2, 3, 4]
    assert max(r["dynamic_sampling/rounds"] for r in rows_a) > 1
    assert all(r["dynamic_sampling/rounds"] <= 3 for r in rows_a)
    assert sum(r["dynamic_sampling/prompts_drawn"] for r in rows_a) > 4 * 2
    # every kept completion is scored after its own prompt: the trainer's log-probs are the sampler's
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows_a)
    # the data position counts every prompt drawn, in every round
    assert straight.state.epoch * straight.rollouts.order.steps_per_epoch * 2 + straight.state.position == \
        sum(r["dynamic_sampling/prompts_drawn"] for r in rows_a)

    first_half = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path / "b"), **{**common, "max_steps": 2}),
                             reward_funcs=[reward])
    first_half.train()
    resumed = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path / "b"), resume_from_checkpoint="latest",
                                      **common), reward_funcs=[reward])
    assert resumed.state.step == 2
    resumed.train()
    expected, got = trainable_weights(straight), trainable_weights(resumed)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    rows_b = train_rows(tmp_path / "b")
    for key in ("reward/mean", "dynamic_sampling/rounds", "dynamic_sampling/prompts_drawn",
                "dynamic_sampling/groups_kept"):
        assert [r[key] for r in rows_a] == [r[key] for r in rows_b], key


def test_policy_and_reference_logprobs_are_taken_without_a_graph(tiny_model, registry, tmp_path):
    config = tiny_config(tiny_model, registry, str(tmp_path), kl_beta=0.1, kl_in_reward=True,
                         eval_on_start=False)
    trainer = GRPOTrainer(config)
    rollout, _ = trainer._collect_rollouts()
    batch = trainer._rollout_batch(rollout)
    old, ref, _ = trainer._policy_and_reference_logprobs(batch, trainer._micro_batches(batch))
    assert old.shape == ref.shape == batch.completion_ids.shape
    assert not old.requires_grad and not ref.requires_grad  # scored under no_grad: no graph kept for the step


def test_later_updates_of_a_rollout_reuse_the_first_updates_logprobs(tiny_model, registry, tmp_path, monkeypatch):
    """num_iterations 2: no separate scoring pass; the first update's own (detached) log-probs are the old policy's,
    so its ratio is exactly 1, and the second update reads them back."""
    import grpo.train.trainer as trainer_module

    config = tiny_config(tiny_model, registry, str(tmp_path), num_iterations=2, eval_on_start=False,
                         lora_dropout=0.0)
    trainer = GRPOTrainer(config)
    rollout, _ = trainer._collect_rollouts()
    batch = trainer._rollout_batch(rollout)
    micro_batches = trainer._micro_batches(batch)
    old, ref, _ = trainer._policy_and_reference_logprobs(batch, micro_batches)
    assert old is None and ref is None  # nothing scored up front
    expected = torch.zeros(batch.completion_ids.shape)
    for mb in micro_batches:  # the policy before any update
        with torch.no_grad():
            mb.scatter(trainer_module.score(trainer.engine, mb, config)[0], into=expected)

    calls, real_update = [], trainer_module.update

    def recording_update(engine, step, cfg, first_pass=True):
        calls.append((first_pass, step.fill_old, step.old_logprobs))
        result = real_update(engine, step, cfg, first_pass=first_pass)
        calls[-1] += (step.old_logprobs.clone(),)
        return result

    monkeypatch.setattr(trainer_module, "update", recording_update)
    step = StepData(batch, micro_batches, trainer._advantages(rollout.rewards))
    trainer._optimize(step)
    (first, fills, kept, filled), (second, fills_again, read, _) = calls
    assert first and fills and not second and not fills_again  # the first update writes, the second only reads
    assert read is kept  # the second update reads what the first one wrote
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(filled[mask], expected[mask], rtol=0, atol=1e-5)  # the policy before the update


def simulate_second_rank(monkeypatch, rewards: list[float]) -> list[float]:
    """all_sum as two ranks would return it, the other holding `rewards`; returns the step means it computed."""
    from grpo.runtime import distributed as dist_utils

    other = torch.tensor(rewards, dtype=torch.float64)
    means = []

    def all_sum(values):
        if len(values) == 2:  # [sum, count]
            means.append((values[0] + other.sum().item()) / (values[1] + len(other)))
            return [values[0] + other.sum().item(), values[1] + len(other)]
        return [values[0] + ((other - means[-1]) ** 2).sum().item()]  # squared deviations about the step's mean

    monkeypatch.setattr(dist_utils, "all_sum", all_sum)
    return means


def test_batch_scaled_advantages_use_every_ranks_rewards(monkeypatch, tmp_path):
    """This rank holds the group [3, 5, 3, 5], a second (simulated) rank [0, 1, 0, 1]. Step: [0, 1, 0, 1, 3, 5, 3, 5],
    mean 2.25, squared deviations 2 x (5.0625 + 1.5625 + 0.5625 + 7.5625) = 29.5, std sqrt(29.5 / 7) = 2.05287;
    this rank's advantages: ([3, 5, 3, 5] - 4) / (2.05287 + 1e-4)."""
    from types import SimpleNamespace

    means = simulate_second_rank(monkeypatch, [0.0, 1.0, 0.0, 1.0])
    host = SimpleNamespace(config=tiny_config("unused", "unused", str(tmp_path)))  # k_samples 4, default scaling
    adv = GRPOTrainer._advantages(host, torch.tensor([3.0, 5.0, 3.0, 5.0]))
    s = math.sqrt(29.5 / 7) + 1e-4
    torch.testing.assert_close(adv, torch.tensor([-1 / s, 1 / s, -1 / s, 1 / s]))
    assert means == [2.25]


def test_the_logged_reward_std_is_the_whole_steps(monkeypatch):
    """The same two ranks as above: reward/std is sqrt(29.5 / 7) on this rank too, not the std of its own [3, 5, 3, 5]
    (1.1547) averaged with the other rank's."""
    from grpo.train.metrics import step_std

    simulate_second_rank(monkeypatch, [0.0, 1.0, 0.0, 1.0])
    assert step_std(torch.tensor([3.0, 5.0, 3.0, 5.0])) == pytest.approx(math.sqrt(29.5 / 7))


def test_the_first_updates_ratio_is_one_under_lora_dropout_and_kl_in_reward(tiny_model, registry, tmp_path):
    """The KL penalty scores the policy in a pass of its own (its own dropout masks); the ratio must not take its
    old log-probs from that pass, or dropout noise alone would clip."""
    config = tiny_config(tiny_model, registry, str(tmp_path), lora_dropout=0.3, kl_beta=0.1,
                         kl_in_reward=True, max_steps=2, eval_on_start=False)
    GRPOTrainer(config).train()
    rows = train_rows(tmp_path)
    assert len(rows) == 2 and all("reward/kl_penalized_mean" in r for r in rows)
    assert all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and r["clip_frac"] == 0.0 for r in rows), rows


def test_the_engine_gap_is_measured_against_the_policy_without_dropout(tiny_model, registry, tmp_path):
    """The HF engine samples the fp32 policy in eval mode (no dropout): once the adapter has moved, train-mode
    log-probs differ from its by the dropout noise alone, which is no sync error; the logged gap leaves it out."""
    config = tiny_config(tiny_model, registry, str(tmp_path), lora_dropout=0.3, max_steps=4, eval_on_start=False,
                         logprob_check_steps=1)
    GRPOTrainer(config, reward_funcs=[even_tokens]).train()
    rows = train_rows(tmp_path)
    assert len(rows) == 4 and all(r["reward/std"] > 0 for r in rows)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
    assert all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-6) for r in rows)  # the loss still uses its own pass


def test_importance_weights_compare_the_engine_with_the_policy_without_dropout(tiny_model, registry, tmp_path):
    """fp32 HF engine, no dropout when sampling: the truncated IS weight exp(trainer - engine) is 1 on every pass of
    every step when the trainer's side is the dropout-free old policy, whatever the adapter's dropout noise."""
    config = tiny_config(tiny_model, registry, str(tmp_path), lora_dropout=0.3, max_steps=3, eval_on_start=False,
                         rollout_is_correction=True, num_iterations=2)
    GRPOTrainer(config, reward_funcs=[even_tokens]).train()
    # the ratio of the second update does carry dropout noise: the run says so up front
    assert "--num_iterations 2 with --lora_dropout 0.3" in (tmp_path / "train.log").read_text()
    rows = train_rows(tmp_path)
    assert len(rows) == 3 and all(r["reward/std"] > 0 for r in rows)
    assert all(r["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-4) for r in rows), rows
    assert all(r["rollout/is_capped_frac"] == 0.0 for r in rows)
