"""The command line: every flag is listed, and bad input fails fast with one clear message and no traceback."""
import json
import os
import subprocess
import sys
import time

import pytest

from .trainer_setup import ROOT, child_env, one_dataset_registry

REQUIRED_FLAGS = """--model_name_or_path --output_dir --resume_from_checkpoint --dataset_config_path --dataset_names
--train_split_ratio --epochs --max_steps --per_device_train_batch_size --gradient_accumulation_steps
--learning_rate --rollout_mode --max_seq_length --max_prompt_length --k_samples --rollout_max_new_tokens
--temperature --top_p --kl_beta --clip_epsilon_low --clip_epsilon_high --loss_aggregation
--scale_rewards --num_iterations --tuning_strategy --lora_rank --lora_alpha --lora_dropout
--lora_target_modules --lora_adapter_path --trust_remote_code --gradient_checkpointing --save_steps
--save_total_limit --eval_steps --logging_steps --use_wandb --wandb_project --log_to_file --deepspeed
--rollout_engine --vllm_tp --vllm_gpu_memory_utilization --reward_module --seed --warmup_ratio
--max_grad_norm --eval_dataset_names --filter_overlong_prompts --lora_exclude_modules --eval_max_prompts""".split()


def run_cli(*args, env=None, timeout=120):
    # a process group started earlier in this test session must not leak its port into the child
    full_env = child_env(**(env or {}))
    start = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=full_env, timeout=timeout)
    return proc, time.time() - start


def assert_clean_failure(proc, *fragments):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, f"{fragment!r} not in:\n{proc.stderr}"


def test_help_lists_every_flag():
    proc, _ = run_cli("--help")
    assert proc.returncode == 0
    for flag in REQUIRED_FLAGS + ["--config"]:
        assert flag in proc.stdout, flag
    assert "{qlora,lora,full}" in proc.stdout
    # grouped as docs/flags.md is: each group's title, its flags after it
    from grpo.config.cli import GROUP_TITLES

    positions = [proc.stdout.index(title + ":") for title in GROUP_TITLES.values()]
    assert positions == sorted(positions)
    assert positions[0] < proc.stdout.index("\n  --tuning_strategy") < positions[1]
    assert positions[-2] < proc.stdout.index("\n  --qlora_block_size") < positions[-1]


def test_boolean_flags_read_right_both_ways_and_abbreviations_are_refused():
    from grpo.config import parse_args
    from grpo.config.cli import build_parser

    help_text = build_parser().format_help()
    negative = help_text[help_text.index("\n  --no_eval_on_start"):]
    assert negative.split("\n  --")[1].split("no_eval_on_start")[1].split() == \
        "Turn --eval_on_start off (the same as --eval_on_start false).".split()
    assert parse_args(["--no_eval_on_start"]).eval_on_start is False
    assert parse_args([]).eval_on_start is True
    with pytest.raises(SystemExit):  # --max_step is not --max_steps
        parse_args(["--max_step", "2"])


def test_runs_saved_with_the_guides_spellings_resume_with_the_options_they_had():
    from grpo.config import GRPOConfig, upgrade_saved_options

    old = {"tuning_strategy": "lora", "learning_rate": 1e-6, "learning_rate_lora": 3e-4, "use_kl_penalty": False,
           "kl_beta": 0.04, "use_vllm_rollout": True, "vllm_mode": "colocate"}
    assert upgrade_saved_options(old) == {"tuning_strategy": "lora", "learning_rate": 3e-4, "kl_beta": 0.0,
                                          "rollout_engine": "vllm", "rollout_mode": "colocate"}
    # today's saved runs hold them as null: nothing changes
    saved = GRPOConfig(kl_beta=0.1).to_dict()
    assert saved["use_kl_penalty"] is None and upgrade_saved_options(saved)["kl_beta"] == 0.1


def test_learning_rate_defaults_by_strategy():
    from grpo.config import GRPOConfig

    assert GRPOConfig(tuning_strategy="lora").learning_rate == 2e-5
    assert GRPOConfig(tuning_strategy="full").learning_rate == 1e-6
    assert GRPOConfig(tuning_strategy="full", learning_rate=3e-5).learning_rate == 3e-5


@pytest.mark.parametrize("args, fragments", [
    (["--k_samples", "1"], ["--k_samples", "at least 2"]),
    (["--tuning_strategy", "lora", "--lora_rank", "0"], ["--lora_rank", "> 0"]),
    (["--tuning_strategy", "dora"], ["--tuning_strategy", "invalid choice"]),
    (["--temperature", "0"], ["--temperature"]),
    (["--no_such_flag", "1"], ["unrecognized arguments", "--no_such_flag"]),
    (["--max_seq_length", "100", "--max_prompt_length", "80", "--rollout_max_new_tokens", "40"],
     ["--max_seq_length", "80 + 40"]),
    (["--dataset_names", "gsm8k", "--eval_dataset_names", "gsm8k_test,gsm8k"],
     ["--eval_dataset_names", "gsm8k is also in --dataset_names"]),
    (["--tuning_strategy", "full", "--lora_exclude_modules", "down_proj"], ["--lora_exclude_modules", "lora or qlora"]),
])
def test_bad_flags_fail_fast(args, fragments):
    proc, seconds = run_cli(*args)
    assert_clean_failure(proc, *fragments)
    assert seconds < 60


def test_vllm_tp_must_divide_world_size():
    proc, _ = run_cli("--vllm_tp", "3", env={"WORLD_SIZE": "4"})
    assert_clean_failure(proc, "--vllm_tp", "WORLD_SIZE=4")


def test_config_file_supplies_values_and_flags_win(tmp_path):
    from grpo.config import parse_args

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"k_samples": 6, "temperature": 0.7, "dataset_names": ["gsm8k"]}))
    cfg = parse_args(["--config", str(path), "--temperature", "0.9"])
    assert (cfg.k_samples, cfg.temperature, cfg.dataset_names) == (6, 0.9, ["gsm8k"])


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"k_samples": 4,\n "oops"}')
    proc, _ = run_cli("--config", str(bad))
    assert_clean_failure(proc, "--config", "not valid JSON", "line 2")
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"k_sample": 4}')
    proc, _ = run_cli("--config", str(unknown))
    assert_clean_failure(proc, "unknown option", "k_sample")


def test_dataset_names_accept_commas_and_spaces():
    from grpo.config import parse_args

    assert parse_args(["--dataset_names", "arith,gsm8k", "extra"]).dataset_names == ["arith", "gsm8k", "extra"]
    config = parse_args(["--dataset_names", "gsm8k", "--eval_dataset_names", "gsm8k_test,arith_test", "x"])
    assert config.eval_dataset_names == ["gsm8k_test", "arith_test", "x"]
    assert config.train_split_ratio is None and config.effective_train_split_ratio == 1.0  # no split by default
    assert parse_args(["--eval_dataset_names", "t", "--train_split_ratio", "0.9"]).effective_train_split_ratio == 0.9
    assert parse_args([]).effective_train_split_ratio == 0.95 and parse_args([]).eval_dataset_names == []
    assert parse_args(["--eval_max_prompts", "-1"]).eval_max_prompts == -1


def test_unknown_dataset_fails_before_model_loads(tmp_path):
    proc, seconds = run_cli("--dataset_names", "nope", "--output_dir", str(tmp_path / "o"))
    assert_clean_failure(proc, "nope", "arith", "gsm8k")
    assert seconds < 60


def test_malformed_registry_fails_with_line(tmp_path):
    registry = tmp_path / "datasets.json"
    registry.write_text('{\n  "arith": {"path": "x.jsonl",\n}')
    proc, _ = run_cli("--dataset_config_path", str(registry), "--output_dir", str(tmp_path / "o"))
    assert_clean_failure(proc, str(registry), "line")


def test_missing_data_file_and_field(tmp_path):
    registry = one_dataset_registry(tmp_path / "datasets.json", "missing.jsonl", {"boxed_accuracy": 1.0})
    proc, _ = run_cli("--dataset_config_path", registry, "--dataset_names", "mine",
                      "--output_dir", str(tmp_path / "o"))
    assert_clean_failure(proc, "mine", "missing.jsonl")
    (tmp_path / "missing.jsonl").write_text('{"question": "1+1?", "a": "2"}\n')
    proc, _ = run_cli("--dataset_config_path", registry, "--dataset_names", "mine",
                      "--output_dir", str(tmp_path / "o"))
    assert_clean_failure(proc, "mine", "'q'", "question")


def test_unknown_reward_name_fails_fast(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"q": "1+1?", "a": "2"}\n' * 4)
    registry = one_dataset_registry(tmp_path / "datasets.json", "d.jsonl", {"no_such_reward": 1.0})
    proc, seconds = run_cli("--dataset_config_path", registry, "--dataset_names", "mine",
                            "--output_dir", str(tmp_path / "o"))
    assert_clean_failure(proc, "no_such_reward", "gsm8k_accuracy", "--reward_module")
    assert seconds < 60


def test_reward_module_registers_a_reward(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"q": "1+1?", "a": "2"}\n' * 4)
    registry = one_dataset_registry(tmp_path / "datasets.json", "d.jsonl", {"my_reward": 1.0})
    module = tmp_path / "my_rewards.py"
    module.write_text("from grpo import register_reward\n\n@register_reward('my_reward')\n"
                      "def my_reward(completions, answers, **kw):\n    return [0.0] * len(completions)\n")
    # the reward resolves, so the run gets past the registry and fails later on the model path (no download)
    proc, _ = run_cli("--dataset_config_path", registry, "--dataset_names", "mine", "--reward_module",
                      str(module), "--model_name_or_path", str(tmp_path / "no_model"),
                      "--output_dir", str(tmp_path / "o"), env={"HF_HUB_OFFLINE": "1"})
    assert_clean_failure(proc, "--model_name_or_path", "no_model")
    assert "my_reward" not in proc.stderr


def test_flag_reference_documents_every_flag():
    from dataclasses import fields

    from grpo.config.options import GRPOConfig

    readme = open(os.path.join(ROOT, "docs", "flags.md")).read()
    missing = [f.name for f in fields(GRPOConfig) if f"`--{f.name}`" not in readme]
    assert not missing, f"docs/flags.md lacks {missing}; regenerate with python scripts/flag_table.py"


@pytest.mark.parametrize("args, message", [
    (["--clip_ratio_c", "1"], "--clip_ratio_c: must be > 1"),
    (["--kl_in_reward"], "--kl_in_reward: needs --kl_beta > 0"),
    (["--max_generation_rounds", "0"], "--max_generation_rounds: must be >= 1"),
    (["--entropy_coef", "-0.1"], "--entropy_coef: must be >= 0"),
    (["--reward_model", "a/rm", "b/rm"], "--reward_model: two folders are named rm"),
])
def test_objective_flags_are_validated(args, message):
    from grpo.config import parse_args
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_args(args)


def test_objective_flags_parse():
    from grpo.config import parse_args

    cfg = parse_args(["--importance_sampling_level", "sequence", "--clip_epsilon_low", "3e-4", "--clip_epsilon_high",
                      "4e-4", "--clip_ratio_c", "3", "--kl_estimator", "k1", "--kl_beta", "0.04", "--kl_in_reward",
                      "--entropy_coef", "0.01", "--filter_zero_std_groups", "--max_generation_rounds", "5",
                      "--reward_model", "rms/a,rms/b"])
    assert (cfg.importance_sampling_level, cfg.clip_epsilon_low, cfg.clip_epsilon_high, cfg.clip_ratio_c) == \
        ("sequence", 3e-4, 4e-4, 3.0)
    assert (cfg.kl_estimator, cfg.kl_in_reward, cfg.kl_beta, cfg.kl_loss_coef) == ("k1", True, 0.04, 0.0)
    assert (cfg.entropy_coef, cfg.filter_zero_std_groups, cfg.max_generation_rounds) == (0.01, True, 5)
    assert cfg.reward_model == ["rms/a", "rms/b"]


def test_server_mode_needs_rollout_and_training_ranks():
    proc, _ = run_cli("--rollout_mode", "server", "--rollout_gpus", "1")  # one process: nobody left to train
    assert_clean_failure(proc, "--rollout_gpus", "1 of the job's 1 ranks", "deepspeed --num_gpus")
    proc, _ = run_cli("--rollout_mode", "server", "--rollout_gpus", "3", "--vllm_tp", "2", env={"WORLD_SIZE": "4"})
    assert_clean_failure(proc, "--vllm_tp", "must divide --rollout_gpus 3")
    proc, _ = run_cli("--rollout_gpus", "2", env={"WORLD_SIZE": "4"})
    assert_clean_failure(proc, "--rollout_gpus", "--rollout_mode server")
    proc, _ = run_cli("--rollout_mode", "remote")
    assert_clean_failure(proc, "--rollout_mode", "invalid choice")
    proc, _ = run_cli("--async_rollout", "true")
    assert_clean_failure(proc, "--async_rollout", "needs --rollout_mode server")
    proc, _ = run_cli("--max_staleness", "2")
    assert_clean_failure(proc, "--max_staleness", "needs --rollout_mode server")
    proc, _ = run_cli("--rollout_mode", "server", "--rollout_gpus", "1", "--max_staleness", "0",
                      env={"WORLD_SIZE": "2"})
    assert_clean_failure(proc, "--max_staleness", "must be at least 1")
    proc, _ = run_cli("--rollout_mode", "server", "--rollout_gpus", "1", "--rollout_segment_tokens", "64",
                      env={"WORLD_SIZE": "2"})
    assert_clean_failure(proc, "--rollout_segment_tokens", "needs --max_staleness")


def test_micro_batch_token_budget_parses_auto_or_a_number(tmp_path):
    from grpo.config import parse_args
    from grpo.config.cli import build_parser
    from grpo.errors import ConfigError

    assert parse_args([]).max_tokens_per_micro_batch == "auto"
    assert parse_args(["--max_tokens_per_micro_batch", "AUTO"]).max_tokens_per_micro_batch == "auto"
    assert parse_args(["--max_tokens_per_micro_batch", "8192"]).max_tokens_per_micro_batch == 8192
    assert parse_args(["--max_tokens_per_micro_batch", "0"]).max_tokens_per_micro_batch == 0
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"max_tokens_per_micro_batch": 4096}))
    assert parse_args(["--config", str(path)]).max_tokens_per_micro_batch == 4096
    for bad in ("-1", "8k", "1e4"):
        with pytest.raises(ConfigError, match=f"--max_tokens_per_micro_batch: got '{bad}'; give auto"):
            parse_args(["--max_tokens_per_micro_batch", bad])
    help_text = " ".join(build_parser().format_help().split())
    start = help_text.index("--max_tokens_per_micro_batch MAX_TOKENS_PER_MICRO_BATCH Token budget")
    flag = help_text[start:help_text.index("--logprob_chunk_tokens", start)]
    assert "auto: 16384 on CPU" in flag and "(default: auto)" in flag
