"""End to end on CPU with a tiny random model: it learns, resumes exactly, skips bad steps, saves what it should."""
import json
import os
import signal

import pytest
import torch

from grpo.train import update as optimize
from grpo.checkpoint.store import list_checkpoints
from grpo.errors import ConfigError, DatasetError, TrainingError
from grpo.rollout.engine import RolloutEngine
from grpo.train.reporting import read_metrics
from grpo.train.trainer import GRPOTrainer

from .trainer_setup import (PROMPTS, add_dataset, assert_same_weights, deepspeed_adamw_config, even_tokens,
                            tiny_config, trainable_weights, write_prompt_registry)


def target_token_reward(target_id):
    """Pays the fraction of completion tokens that are `target_id`: a signal any policy can learn."""
    def emits_target(completions, answers, completion_ids, **row):
        return [sum(t == target_id for t in ids) / max(len(ids), 1) for ids in completion_ids]
    return emits_target


def pick_target(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.convert_tokens_to_ids(tok.tokenize("7")[0])


def training_forward_saved_bytes(config, monkeypatch) -> int:
    """Bytes the training forward of a one-step run saves for backward; fails unless every module is training then."""
    trainer = GRPOTrainer(config)
    real_score, saved = optimize.score, []

    def measured(model, *args, **kwargs):
        if not torch.is_grad_enabled():
            return real_score(model, *args, **kwargs)  # a no-grad scoring pass
        assert all(m.training for m in model.modules())
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = real_score(model, *args, **kwargs)
        saved.append(total[0])
        return out
    monkeypatch.setattr(optimize, "score", measured)
    trainer.train()
    assert saved
    return sum(saved)


@pytest.mark.parametrize("strategy", ["full", "lora", "qlora"])
def test_training_forward_runs_in_training_mode_and_checkpoints(strategy, tiny_model, registry, tmp_path,
                                                                 monkeypatch):
    """from_pretrained hands over a model in eval mode, where gradient checkpointing keeps every activation and LoRA
    dropout drops nothing: the training forward must run in training mode, and --gradient_checkpointing must cut
    what it saves for backward."""
    def run(checkpointing):
        return training_forward_saved_bytes(tiny_config(
            tiny_model, registry, str(tmp_path / f"{strategy}-{checkpointing}"), tuning_strategy=strategy,
            max_steps=1, lora_dropout=0.0, gradient_checkpointing=checkpointing), monkeypatch)
    kept, checkpointed = run(False), run(True)
    assert checkpointed < 0.5 * kept, (checkpointed, kept)


@pytest.mark.parametrize("strategy", ["full", "lora", "qlora"])
def test_it_learns(strategy, tiny_model, registry, tmp_path):
    target = pick_target(tiny_model)
    steps = 30
    config = tiny_config(tiny_model, registry, str(tmp_path / strategy), tuning_strategy=strategy, max_steps=steps,
                         per_device_train_batch_size=4, k_samples=16, rollout_max_new_tokens=16, temperature=1.0,
                         learning_rate=1e-3 if strategy == "full" else 2e-2, lora_rank=8, lora_alpha=16)
    GRPOTrainer(config, reward_funcs=[target_token_reward(target)]).train()
    rows = [r for r in read_metrics(str(tmp_path / strategy / "metrics.jsonl")) if "rewards/emits_target" in r]
    first = sum(r["rewards/emits_target"] for r in rows[:5]) / 5
    last = sum(r["rewards/emits_target"] for r in rows[-5:]) / 5
    assert len(rows) == steps
    assert last >= 3 * first and last > 0.3, (first, last)


def test_notebook_run_writes_every_output(tiny_model, registry, tmp_path):
    out = tmp_path / "run"
    config = tiny_config(tiny_model, registry, str(out), max_steps=2, save_steps=1, save_total_limit=1,
                         eval_steps=1, save_merged_model=True)
    result = GRPOTrainer(config).train()
    assert os.path.isfile(result["saved"]["lora_adapter"] + "/adapter_config.json")
    rows = read_metrics(str(out / "metrics.jsonl"))
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for key in ["reward/mean", "reward/std", "reward/zero_std_group_frac", "rewards/boxed_accuracy", "loss", "kl",
                "clip_frac_low", "clip_frac_high", "entropy", "completion/length_mean", "completion/truncated_frac",
                "lr", "grad_norm", "time/rollout", "time/reward", "time/logprobs", "time/train", "time/sync",
                "throughput/rollout_tokens_per_s", "rollout/logprob_diff_mean", "rollout/logprob_diff_max"]:
        assert key in train_rows[0], key
    # the rollout phase's parts: they cover its time, and generation is most of it
    for row in train_rows:
        parts = [row[f"time/rollout_{p}"] for p in ("wake", "images", "generate", "sleep", "decode")]
        assert min(parts) >= 0 and sum(parts) <= row["time/rollout"] + 1e-6
        assert row["time/rollout_generate"] >= 0.5 * row["time/rollout"]
    # the HF engine samples from the trained model itself, in fp32: rollout and trainer log-probs agree
    assert train_rows[0]["rollout/logprob_diff_max"] < 1e-3
    eval_rows = [r for r in rows if "eval/reward/mean" in r]
    assert [r["step"] for r in eval_rows] == [0, 1, 2]  # --eval_on_start (default on): step 0 comes first
    assert rows[0] is eval_rows[0]
    assert os.path.isfile(out / "eval" / "samples_step0.jsonl") and os.path.isfile(out / "eval" / "samples_step2.jsonl")
    assert "eval at step 0" in (out / "train.log").read_text()
    assert os.path.isfile(out / "training_curves.png") and os.path.getsize(out / "training_curves.png") > 10_000
    assert os.path.isfile(out / "train.log") and "step 2" in (out / "train.log").read_text()
    assert [step for step, _ in list_checkpoints(str(out))] == [2]  # save_total_limit=1 removed checkpoint-1
    assert os.path.isdir(out / "merged_model")
    sample = json.loads((out / "completions" / "rank0.jsonl").read_text().splitlines()[0])
    assert {"prompt", "completion", "reward", "index"} <= set(sample)


@pytest.mark.parametrize("strategy", ["full", "lora", "qlora-loftq-kl"])
def test_resume_is_exact(strategy, tiny_model, registry, tmp_path):
    common = dict(tuning_strategy=strategy, max_steps=4, save_steps=2, lora_dropout=0.1)
    if strategy == "qlora-loftq-kl":  # loftq's frozen rounding correction, recomputed on resume; the KL reference
        common.update(tuning_strategy="qlora", qlora_init="loftq", kl_beta=0.1)
    rewards = [even_tokens]  # non-zero advantages: the weights move, so exactness means something
    straight = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path / "a"), **common), reward_funcs=rewards)
    straight.train()
    expected = trainable_weights(straight)

    first_half = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path / "b"), **{**common, "max_steps": 2}),
                             reward_funcs=rewards)
    first_half.train()
    resumed = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path / "b"), resume_from_checkpoint="latest",
                                      **common), reward_funcs=rewards)
    assert resumed.state.step == 2
    resumed.train()
    assert_same_weights(trainable_weights(resumed), expected)
    rows_a = [r for r in read_metrics(str(tmp_path / "a" / "metrics.jsonl")) if "loss" in r]
    rows_b = [r for r in read_metrics(str(tmp_path / "b" / "metrics.jsonl")) if "loss" in r]
    assert [r["reward/mean"] for r in rows_a] == [r["reward/mean"] for r in rows_b]
    assert all(r["reward/std"] > 0 for r in rows_a)
    if strategy == "qlora-loftq-kl":  # the policy moved away from its corrected start, so it has a KL to it
        assert rows_a[-1]["kl"] > 0


def test_fresh_run_refuses_a_folder_with_checkpoints(tiny_model, registry, tmp_path):
    GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path), max_steps=1, save_steps=1)).train()
    with pytest.raises(Exception, match="resume_from_checkpoint latest"):
        GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path), max_steps=1))


def test_non_finite_loss_skips_then_stops(tiny_model, registry, tmp_path, monkeypatch):
    real_loss = optimize.policy_loss
    calls = {"n": 0}

    def nan_after_first_step(*args, **kwargs):
        calls["n"] += 1
        loss, metrics = real_loss(*args, **kwargs)
        return (loss * float("nan") if calls["n"] > 1 else loss), metrics

    monkeypatch.setattr(optimize, "policy_loss", nan_after_first_step)
    trainer = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path), tuning_strategy="full", max_steps=6,
                                      save_steps=1, save_total_limit=1))
    after_first_step = {}

    def remember_weights(*args, **kwargs):
        if not after_first_step and trainer.state.step == 1:
            after_first_step.update(trainable_weights(trainer))
        return real_save(*args, **kwargs)

    real_save = trainer._save_checkpoint
    trainer._save_checkpoint = remember_weights
    # step 1 is fine; steps 2, 3, 4 are non-finite: skipped, and the third stops the run
    with pytest.raises(TrainingError, match="last good checkpoint is .*checkpoint-1"):
        trainer.train()
    assert trainer.state.step == 3
    # skipped updates left the weights as they were after step 1; checkpoint-1 survived rotation
    for name, value in trainable_weights(trainer).items():
        torch.testing.assert_close(value, after_first_step[name], rtol=0, atol=0)
    assert [step for step, _ in list_checkpoints(str(tmp_path))] == [1, 3]


def test_skipped_step_keeps_the_learning_rate_of_a_deepspeed_optimizer(tiny_model, registry, tmp_path, monkeypatch):
    """A DeepSpeed config that brings its own "optimizer" and no "scheduler": the step with a non-finite loss is
    skipped (lr 0 for it), and the next steps train at the configured learning rate again."""
    ds_path = deepspeed_adamw_config(tmp_path / "ds.json")
    real_loss = optimize.policy_loss

    def nan_in_second_step(*args, **kwargs):
        loss, metrics = real_loss(*args, **kwargs)
        return (loss * float("nan") if trainer.state.step == 1 else loss), metrics

    monkeypatch.setattr(optimize, "policy_loss", nan_in_second_step)
    trainer = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path / "out"), tuning_strategy="full",
                                      max_steps=3, deepspeed=str(ds_path), eval_on_start=False),
                          reward_funcs=[even_tokens])
    weights = []
    real_sync = trainer._sync_rollout_weights

    def remember_weights(*args, **kwargs):
        weights.append(trainable_weights(trainer))
        return real_sync(*args, **kwargs)

    trainer._sync_rollout_weights = remember_weights
    trainer.train()
    rows = [r for r in read_metrics(str(tmp_path / "out" / "metrics.jsonl")) if "loss" in r or "lr" in r]
    assert [r["lr"] for r in rows] == [1e-3] * 3, rows
    after = weights[-3:]  # after steps 1, 2 and 3
    assert all(torch.equal(after[0][n], after[1][n]) for n in after[0])  # step 2 was skipped
    assert any(not torch.equal(after[1][n], after[2][n]) for n in after[1])  # step 3 trained again


def test_sigterm_saves_a_checkpoint(tiny_model, registry, tmp_path):
    def stop_at_second_step(completions, answers, **row):
        stop_at_second_step.calls += 1
        if stop_at_second_step.calls == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return [0.0] * len(completions)
    stop_at_second_step.calls = 0

    # no eval at step 0: it would call the reward too and move the signal one step earlier
    trainer = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path), max_steps=5, eval_on_start=False),
                          reward_funcs=[stop_at_second_step])
    with pytest.raises(TrainingError, match="resume_from_checkpoint latest"):
        trainer.train()
    assert [step for step, _ in list_checkpoints(str(tmp_path))] == [2]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_kl_reference_reused_rollouts_and_is_correction(tiny_model, registry, tmp_path):
    # full fine-tuning with the KL term (frozen reference copy), two updates per rollout from stored old log-probs,
    # the truncated importance-sampling correction and truncated completions masked out
    config = tiny_config(tiny_model, registry, str(tmp_path), tuning_strategy="full", max_steps=3,
                         kl_beta=0.1, num_iterations=2, rollout_is_correction=True,
                         mask_truncated_completions=True, rollout_max_new_tokens=8, temperature=1.0,
                         per_device_train_batch_size=4, k_samples=8, learning_rate=1e-2,
                         loss_aggregation="seq_mean_token_sum_norm")
    trainer = GRPOTrainer(config, reward_funcs=[target_token_reward(pick_target(tiny_model))])
    assert trainer.reference is not None
    trainer.train()
    rows = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if "loss" in r]
    assert len(rows) == 3
    assert all(torch.isfinite(torch.tensor([r["loss"], r["kl"], r["grad_norm"]])).all() for r in rows)
    # the second update of each rollout starts from a moved policy: its KL to the frozen reference is positive
    assert all(r["kl"] > 0 for r in rows)


def test_rollout_logprobs_every_n_steps(tiny_model, registry, tmp_path):
    # without IS correction the engine's log-probs only feed the mismatch metric: steps 1, 3, 5 with N = 2
    config = tiny_config(tiny_model, registry, str(tmp_path / "every2"), max_steps=4, logprob_check_steps=2,
                         eval_on_start=False)
    GRPOTrainer(config).train()
    rows = [r for r in read_metrics(str(tmp_path / "every2" / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in rows if "rollout/logprob_diff_mean" in r] == [1, 3]
    # with the correction they are needed every step
    config = tiny_config(tiny_model, registry, str(tmp_path / "is"), max_steps=2, logprob_check_steps=5,
                         rollout_is_correction=True, eval_on_start=False)
    GRPOTrainer(config).train()
    rows = [r for r in read_metrics(str(tmp_path / "is" / "metrics.jsonl")) if "loss" in r]
    assert all("rollout/logprob_diff_mean" in r for r in rows) and len(rows) == 2


# 32 words + 5 chat-template tokens = 37 prompt tokens, over tiny_config's --max_prompt_length 32 (short ones: 11)
LONG = "What is " + " + ".join(["1"] * 15) + " ?"


@pytest.fixture
def eval_registry(tmp_path):
    """`wordy` (20 short + 4 overlong prompts) to train on, `toy_test` (6 short + 2 overlong) to evaluate on, scored
    by its own reward: format with pattern '.*', which pays 1 for every completion."""
    registry = write_prompt_registry(str(tmp_path / "data"))
    add_dataset(registry, "wordy", [(q, "0") for q in PROMPTS[:20]] + [(LONG, "15")] * 4)
    add_dataset(registry, "toy_test", [(f"What is {a} * 2 ?", str(2 * a)) for a in range(1, 7)] + [(LONG, "15")] * 2,
                rewards={"format": 1.0}, reward_kwargs={"format": {"pattern": ".*"}})
    return registry


def eval_config(tiny_model, registry, output_dir, **overrides):
    return tiny_config(tiny_model, registry, output_dir, **{
        "dataset_names": ["wordy"], "eval_dataset_names": ["toy_test"], "train_split_ratio": None,
        "eval_max_prompts": -1, "max_steps": 1, **overrides})


def test_eval_dataset_and_overlong_prompts(tiny_model, eval_registry, tmp_path, monkeypatch):
    import grpo.train.trainer as trainer_module

    # without --filter_overlong_prompts an overlong prompt stops the run, before any model loads
    with monkeypatch.context() as patched:
        patched.setattr(trainer_module, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
        with pytest.raises(DatasetError, match=r"dataset\(s\) wordy: 4 prompt\(s\) are longer than "
                                               r"--max_prompt_length 32"):
            GRPOTrainer(eval_config(tiny_model, eval_registry, str(tmp_path / "refused")))
    out = tmp_path / "run"
    trainer = GRPOTrainer(eval_config(tiny_model, eval_registry, str(out), filter_overlong_prompts=True))
    # with an eval dataset the training data is not split; overlong prompts are gone from both sets
    assert len(trainer.train_set) == 20 and set(trainer.train_set["data_source"]) == {"wordy"}
    assert list(trainer.eval_set["data_source"]) == ["toy_test"] * 6
    trainer.train()
    log = (out / "train.log").read_text()
    assert "train dataset 'wordy': dropped 4 of 24 prompts longer than --max_prompt_length 32; the longest kept " \
           "has 11 tokens" in log
    assert "eval dataset 'toy_test': dropped 2 of 8 prompts" in log
    evaluations = [r for r in read_metrics(str(out / "metrics.jsonl")) if "eval/reward/mean" in r]
    assert [r["step"] for r in evaluations] == [0, 1]  # --eval_on_start, and the end of training
    evaluation = evaluations[-1]
    assert evaluation["eval/toy_test/prompts"] == 6
    # scored by toy_test's own reward (format, 1 for every completion), not by wordy's boxed_accuracy
    assert evaluation["eval/reward/mean"] == evaluation["eval/toy_test/reward/mean"] == 1.0
    assert evaluation["eval/toy_test/rewards/format"] == 1.0 and "eval/rewards/boxed_accuracy" not in evaluation
    assert "eval/toy_test/completion/length_mean" in evaluation and "eval/completion/length_mean" in evaluation
    assert not any(key.startswith("eval/wordy/") for key in evaluation)  # nothing held out of wordy
    samples = [json.loads(line) for line in (out / "eval" / "samples_step1.jsonl").read_text().splitlines()]
    assert [s["data_source"] for s in samples] == ["toy_test"] * 6 and all(s["reward"] == 1.0 for s in samples)


def test_held_out_split_and_eval_dataset_are_reported_apart(tiny_model, eval_registry, tmp_path):
    # an explicit --train_split_ratio below 1 holds out part of wordy as well: 24 rows -> 18 + 6 (at most 4 overlong)
    trainer = GRPOTrainer(eval_config(tiny_model, eval_registry, str(tmp_path), train_split_ratio=0.75,
                                      filter_overlong_prompts=True, eval_max_prompts=2))
    metrics = trainer.evaluate()
    assert metrics["eval/wordy/prompts"] == metrics["eval/toy_test/prompts"] == 2  # --eval_max_prompts per dataset
    assert "eval/wordy/rewards/boxed_accuracy" in metrics and "eval/wordy/rewards/format" not in metrics
    assert metrics["eval/toy_test/reward/mean"] == 1.0
    # the total is over every eval prompt: here the mean of two equally sized datasets
    assert metrics["eval/reward/mean"] == pytest.approx(
        (metrics["eval/wordy/reward/mean"] + metrics["eval/toy_test/reward/mean"]) / 2)


def test_out_of_memory_names_phase_sizes_and_knobs(tiny_model, registry, tmp_path, monkeypatch):
    import grpo.train.trainer as trainer_module

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 1.2 GiB is free.")

    monkeypatch.setattr(trainer_module, "update", out_of_memory)
    # checkpointing off (auto turns it on on CPU), so that the message suggests it
    trainer = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path), max_steps=2, eval_on_start=False,
                                      gradient_checkpointing=False))
    with pytest.raises(TrainingError) as caught:
        trainer.train()
    message = str(caught.value)
    assert message.startswith("step 1 (optimize): out of GPU memory (CUDA out of memory) with prompts per rank 2, "
                              "completions per rank 8, --rollout_max_new_tokens 8, longest completion"), message
    for part in ("micro-batches 1", "tokens per micro-batch (padded, largest)", "--max_tokens_per_micro_batch 16384",
                 "--gradient_checkpointing", "--vllm_gpu_memory_utilization", "no checkpoint was saved yet"):
        assert part in message, (part, message)
    assert "Traceback" not in message and "Traceback" in (tmp_path / "train.log").read_text()
    # what the run already does is not suggested; a vLLM engine that keeps its weights through training is
    from grpo.runtime.failures import out_of_memory_message

    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    qlora = out_of_memory_message("optimize", {}, None, error, {"checkpointing": True, "strategy": "qlora",
                                                                "engine_keeps_weights": True})
    assert "--gradient_checkpointing" not in qlora and "--tuning_strategy" not in qlora, qlora
    assert "--vllm_sleep_level 2" in qlora and "--deepspeed zero3 (several GPUs)" in qlora, qlora
    assert "--vllm_sleep_level" not in out_of_memory_message("rollout", {}, None, error, {"engine_keeps_weights": True})
    assert "--rollout_weights in_place" not in qlora  # lora's alone: a qlora trainer holds no 16-bit base to share
    lora = out_of_memory_message("optimize", {}, None, error, {"strategy": "lora", "engine_keeps_weights": True})
    assert "--rollout_weights in_place (vLLM and the trainer share one 16-bit base)" in lora, lora


def test_resume_refuses_options_that_rebuild_another_policy(tmp_path):
    from grpo.checkpoint.resume import check_resume_keeps_policy, saved_config_path

    saved = tiny_config("model", "registry.json", str(tmp_path), tuning_strategy="qlora", qlora_quant_type="nf4")
    saved.save(str(tmp_path / "grpo_config.json"))
    path = saved_config_path("latest", str(tmp_path))
    assert path == saved_config_path(str(tmp_path / "checkpoint-4") + "/", "elsewhere")  # beside the checkpoint
    resume = dict(resume_from_checkpoint="latest", max_steps=10)
    check_resume_keeps_policy(path, tiny_config("model", "registry.json", str(tmp_path), tuning_strategy="qlora",
                                                lora_dropout=0.1, **resume))  # training options may change
    listed = tiny_config("model", "registry.json", str(tmp_path), tuning_strategy="qlora",
                         qlora_skip_modules="down_proj,v_proj")
    listed.save(str(tmp_path / "listed.json"))  # the same modules written another way are the same policy
    check_resume_keeps_policy(str(tmp_path / "listed.json"), tiny_config(
        "model", "registry.json", str(tmp_path), tuning_strategy="qlora", qlora_skip_modules=" v_proj, down_proj",
        **resume))
    for change, named in [(dict(tuning_strategy="qlora", qlora_quant_type="fp4"), "--qlora_quant_type 'nf4' -> 'fp4'"),
                          (dict(tuning_strategy="qlora", qlora_block_size=64), "--qlora_block_size 32 -> 64"),
                          (dict(tuning_strategy="qlora", qlora_block_scale="absmax"),
                           "--qlora_block_scale 'mse' -> 'absmax'"),
                          (dict(tuning_strategy="qlora", lora_alpha=16), "--lora_alpha 8 -> 16"),
                          (dict(tuning_strategy="lora"), "--tuning_strategy 'qlora' -> 'lora'")]:
        with pytest.raises(ConfigError, match="other model options") as info:
            check_resume_keeps_policy(path, tiny_config("model", "registry.json", str(tmp_path), **change, **resume))
        assert named in str(info.value) and "--output_dir" in str(info.value)
    older = json.loads((tmp_path / "grpo_config.json").read_text())
    del older["qlora_block_size"], older["qlora_block_scale"]  # saved before the options: bitsandbytes' rounding
    (tmp_path / "older.json").write_text(json.dumps(older))
    with pytest.raises(ConfigError, match="--qlora_block_size 64 -> 32; --qlora_block_scale 'absmax' -> 'mse'.*"
                                          "Resume with the saved values \\(--qlora_block_size 64 --qlora_block_scale "
                                          "absmax; see .*older.json\\)"):
        check_resume_keeps_policy(str(tmp_path / "older.json"), tiny_config("model", "registry.json", str(tmp_path),
                                                                            tuning_strategy="qlora", **resume))
    check_resume_keeps_policy(str(tmp_path / "older.json"), tiny_config(
        "model", "registry.json", str(tmp_path), tuning_strategy="qlora", qlora_block_size=64,
        qlora_block_scale="absmax", **resume))
    with pytest.raises(ConfigError, match="--qlora_block_size 64 -> 32"):
        check_resume_keeps_policy(str(tmp_path / "older.json"), tiny_config(
            "model", "registry.json", str(tmp_path), tuning_strategy="qlora", qlora_block_size=32, **resume))
    with pytest.raises(ConfigError, match="--qlora_block_scale 'absmax' -> 'mse'"):
        check_resume_keeps_policy(str(tmp_path / "older.json"), tiny_config(
            "model", "registry.json", str(tmp_path), tuning_strategy="qlora", qlora_block_scale="mse", **resume))
    full = tiny_config("model", "registry.json", str(tmp_path), tuning_strategy="full")
    full.save(str(tmp_path / "grpo_config.json"))  # full fine-tuning has no adapter: LoRA options do not matter
    check_resume_keeps_policy(path, tiny_config("model", "registry.json", str(tmp_path), tuning_strategy="full",
                                                lora_rank=64, **resume))
    check_resume_keeps_policy(str(tmp_path / "missing.json"), full)  # nothing saved to compare with: no error


def test_a_resume_with_another_4bit_type_stops_before_any_model_loads(tiny_model, registry, tmp_path, monkeypatch):
    import grpo.train.trainer as trainer_module

    out = str(tmp_path / "run")
    GRPOTrainer(tiny_config(tiny_model, registry, out, tuning_strategy="qlora", max_steps=1, save_steps=1)).train()
    monkeypatch.setattr(trainer_module, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match="--qlora_quant_type 'nf4' -> 'fp4'"):
        GRPOTrainer(tiny_config(tiny_model, registry, out, tuning_strategy="qlora", qlora_quant_type="fp4",
                                max_steps=2, resume_from_checkpoint="latest"))
    assert [step for step, _ in list_checkpoints(out)] == [1]  # the checkpoint is kept


class ForgetfulEngine(RolloutEngine):
    """The HF engine behind the interface of an engine whose sleep drops its weights (vLLM's level 2): it records
    what syncs load, and refuses to wake on dropped weights, as VLLMRolloutEngine does."""
    needs_every_weight = True

    def __init__(self, engine):
        self.engine, self.loaded, self.weights_dropped = engine, [], False

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)

    def load_weights(self, named, complete=True):
        self.loaded += [name for name, _ in named]
        self.weights_dropped = not complete

    def sleep(self, keep_weights=False):
        self.weights_dropped = not keep_weights

    def wake(self):
        assert not self.weights_dropped, "woken on dropped weights"


def test_an_engine_left_without_weights_gets_the_policy_before_it_wakes(tiny_model, registry, tmp_path, monkeypatch):
    import grpo.train.trainer as trainer_module

    trainer = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path)))
    engine = trainer.rollouts.engine = ForgetfulEngine(trainer.rollout_engine)
    monkeypatch.setattr(trainer_module, "engine_holds_weights", lambda config: True)  # as for vLLM
    engine.sleep()  # as when a step stops between its rollout's sleep and its sync (e.g. interrupted in a notebook)
    trainer.evaluate()
    # the whole policy went in first: every tensor of the checkpoint, under the checkpoint's names
    from transformers import AutoModelForCausalLM

    assert sorted(engine.loaded) == sorted(n for n, _ in AutoModelForCausalLM.from_pretrained(tiny_model)
                                           .named_parameters())
    # an evaluation's own sleep keeps the weights: the next one needs no sync
    engine.loaded.clear()
    trainer.evaluate()
    assert engine.loaded == [] and not engine.weights_dropped


NOTEBOOK_TWICE = """
import json, os, sys
import torch.distributed as dist
sys.path.insert(0, {root!r})
from grpo.train.trainer import GRPOTrainer
from tests.trainer_setup import tiny_config

seen = []
for run in ("first", "second"):
    trainer = GRPOTrainer(tiny_config({model!r}, {registry!r}, os.path.join({out!r}, run), max_steps=1,
                                      eval_on_start=False, train_split_ratio=1.0))
    trainer.train()
    trainer.close()
    seen.append([dist.is_initialized(), "MASTER_PORT" in os.environ])
trainer.close()  # twice is harmless
print(json.dumps(seen))
"""


def test_close_ends_the_process_group_it_started_so_a_notebook_trains_twice(tiny_model, registry, tmp_path):
    """A notebook (one process, no launcher) trains, closes, and trains again without ending the group by hand."""
    import subprocess
    import sys

    from .trainer_setup import ROOT, child_env

    code = NOTEBOOK_TWICE.format(root=ROOT, model=tiny_model, registry=registry, out=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [[False, False], [False, False]]
    assert os.path.isfile(tmp_path / "second" / "metrics.jsonl")
