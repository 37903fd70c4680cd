"""A resume is the same run: train_grpo.py and GRPOConfig.from_run take the options the checkpoint was trained with,
the options given override them and are listed once, and nothing a resume does rewrites what a checkpoint saved."""
import json
import logging
import os
import subprocess
import sys

import pytest

from grpo.config import GRPOConfig, parse_args
from grpo.errors import ConfigError

from .trainer_setup import ROOT, child_env, tiny_config

# run_grpo.sh's CPU settings, scaled to the tiny model: none of them is train_grpo.py's default
RUN_OPTIONS = ["--per_device_train_batch_size", "4", "--learning_rate", "6e-4", "--rollout_max_new_tokens", "6",
               "--max_prompt_length", "32", "--max_seq_length", "38", "--k_samples", "4", "--lora_rank", "4",
               "--lora_alpha", "8", "--temperature", "0.9", "--seed", "3", "--save_steps", "1",
               "--save_total_limit", "5", "--eval_on_start", "false", "--eval_max_prompts", "4",
               "--train_split_ratio", "0.9"]


def train_grpo(*args):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=child_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def saved(path) -> dict:
    with open(path) as fh:
        return json.load(fh)


def test_train_grpo_resumes_with_the_runs_options_and_lists_the_ones_given(tiny_model, registry, tmp_path):
    out = str(tmp_path / "run")
    train_grpo("--model_name_or_path", tiny_model, "--dataset_config_path", registry, "--dataset_names", "toy",
               "--output_dir", out, "--max_steps", "2", *RUN_OPTIONS)
    first_checkpoint = open(os.path.join(out, "checkpoint-2", "grpo_config.json"), "rb").read()
    run_options = open(os.path.join(out, "grpo_config.json"), "rb").read()

    log = train_grpo("--output_dir", out, "--resume_from_checkpoint", "latest", "--max_steps", "3")

    resumed = saved(os.path.join(out, "checkpoint-3", "grpo_config.json"))
    options = saved(os.path.join(out, "checkpoint-2", "grpo_config.json"))
    for key in ("per_device_train_batch_size", "learning_rate", "rollout_max_new_tokens", "max_seq_length",
                "k_samples", "lora_rank", "temperature", "seed", "model_name_or_path", "dataset_config_path"):
        assert resumed[key] == options[key], key
    assert (resumed["per_device_train_batch_size"], resumed["learning_rate"], resumed["rollout_max_new_tokens"]) \
        == (4, 6e-4, 6)
    assert resumed["max_steps"] == 3  # the override, applied: the run went on to step 3
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["completion/length_max"] for r in rows) <= 6
    # listed once, alone: the options not given are the run's, so nothing else differs
    listed = [line for line in log.splitlines() if "resumed from" in line]
    assert len(listed) == 1 and listed[0].endswith(
        f"resumed from {out}/checkpoint-2 at step 2 with the run's options ({out}/checkpoint-2/grpo_config.json); "
        f"given here: --max_steps 2 -> 3"), listed
    assert "WARNING" not in listed[0]
    # nothing a resume does rewrites what was saved before it
    assert open(os.path.join(out, "checkpoint-2", "grpo_config.json"), "rb").read() == first_checkpoint
    assert open(os.path.join(out, "grpo_config.json"), "rb").read() == run_options
    assert saved(os.path.join(out, "grpo_config.resumed_at_step2.json"))["max_steps"] == 3


@pytest.fixture
def saved_run(tmp_path):
    """A run folder as a lora run leaves it, without the weights: its options and two checkpoints."""
    out = tmp_path / "run"
    options = tiny_config("model", "registry.json", str(out), per_device_train_batch_size=4, learning_rate=6e-4,
                          rollout_max_new_tokens=6, max_seq_length=38, max_steps=4)
    for step in (2, 4):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"step": step}))
        options.save(str(out / f"checkpoint-{step}" / "grpo_config.json"))
    options.save(str(out / "grpo_config.json"))
    return out


def test_the_command_line_takes_the_checkpoints_options_and_the_flags_given(saved_run, tmp_path):
    (saved_run / "checkpoint-4" / "grpo_config.json").write_text(json.dumps(
        {**saved(saved_run / "checkpoint-4" / "grpo_config.json"), "temperature": 0.7}))
    config = parse_args(["--output_dir", str(saved_run), "--resume_from_checkpoint", "latest", "--max_steps", "9"])
    assert (config.per_device_train_batch_size, config.learning_rate, config.rollout_max_new_tokens,
            config.max_steps, config.temperature) == (4, 6e-4, 6, 9, 0.7)  # the newest checkpoint's options
    assert config.resumes_saved_options == str(saved_run / "checkpoint-4" / "grpo_config.json")
    # a named checkpoint: its own options; --config values count as given, and flags win over them
    (tmp_path / "more.json").write_text(json.dumps({"max_steps": 7, "learning_rate": 1e-4}))
    config = parse_args(["--resume_from_checkpoint", str(saved_run / "checkpoint-2"), "--config",
                         str(tmp_path / "more.json"), "--learning_rate", "2e-4"])
    assert (config.output_dir, config.temperature, config.max_steps, config.learning_rate) == \
        (str(saved_run), 1.0, 7, 2e-4)
    assert parse_args(["--max_steps", "3"]).resumes_saved_options is None  # a fresh run: the defaults


def test_from_run_continues_a_run_in_python(saved_run):
    config = GRPOConfig.from_run(str(saved_run), max_steps=10)
    assert (config.per_device_train_batch_size, config.learning_rate, config.max_steps,
            config.resume_from_checkpoint) == (4, 6e-4, 10, "latest")
    assert config.resumes_saved_options == str(saved_run / "checkpoint-4" / "grpo_config.json")
    config = GRPOConfig.from_run(str(saved_run), str(saved_run / "checkpoint-2"))
    assert config.resume_from_checkpoint == str(saved_run / "checkpoint-2") and config.max_steps == 4
    with pytest.raises(ConfigError, match="no checkpoint-\\* folder; give every option with GRPOConfig"):
        GRPOConfig.from_run(str(saved_run / "elsewhere"))


def test_options_saved_by_older_versions_still_load(saved_run):
    # checkpoints without their own copy: the run's, beside them, with options renamed and predated since
    os.remove(saved_run / "checkpoint-4" / "grpo_config.json")
    old = saved(saved_run / "grpo_config.json")
    old["learning_rate_lora"] = old.pop("learning_rate")
    old["use_vllm_rollout"] = False
    old["an_option_gone_since"] = 1
    del old["qlora_block_size"], old["qlora_block_scale"]
    (saved_run / "grpo_config.json").write_text(json.dumps(old))
    config = GRPOConfig.from_run(str(saved_run))
    assert (config.learning_rate, config.rollout_engine, config.per_device_train_batch_size) == (6e-4, "hf", 4)
    assert (config.qlora_block_size, config.qlora_block_scale) == (64, "absmax")  # bitsandbytes', as then
    assert config.resumes_saved_options == str(saved_run / "grpo_config.json")


def test_a_plain_config_resumes_as_given_and_names_what_differs(saved_run, caplog):
    from grpo.checkpoint.resume import log_resumed_options

    checkpoint = str(saved_run / "checkpoint-4")
    saved_path = os.path.join(checkpoint, "grpo_config.json")
    logger = logging.getLogger("grpo")  # once the console is set up it does not propagate to caplog's root logger
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="grpo")
    try:
        plain = tiny_config("model", "registry.json", str(saved_run), max_steps=4, resume_from_checkpoint="latest",
                            rollout_max_new_tokens=6, max_seq_length=38)
        assert log_resumed_options(checkpoint, 4, saved_path, plain) == ["per_device_train_batch_size",
                                                                         "learning_rate"]
        from_run = GRPOConfig.from_run(str(saved_run), learning_rate=1e-3)
        assert log_resumed_options(checkpoint, 4, saved_path, from_run) == ["learning_rate"]
    finally:
        logger.removeHandler(caplog.handler)
    (warning, info) = list({id(r): r for r in caplog.records}.values())
    assert warning.levelname == "WARNING" and warning.getMessage() == (
        f"resumed from {checkpoint} at step 4 with the options of this GRPOConfig, which differ from the run's "
        f"({saved_path}): --per_device_train_batch_size 4 -> 2; --learning_rate 0.0006 -> 0.01. "
        f"GRPOConfig.from_run({str(saved_run)!r}) continues with the run's own options (keyword arguments override "
        f"them)")
    assert info.levelname == "INFO" and info.getMessage() == (
        f"resumed from {checkpoint} at step 4 with the run's options ({saved_path}); given here: --learning_rate "
        f"0.0006 -> 0.001")


def test_what_is_compared_on_resume(tmp_path):
    from grpo.checkpoint.resume import changed_options, log_resumed_options

    # a lora run saved before defaults changed (scale_rewards) and before qlora's options had today's values
    saved_path = str(tmp_path / "grpo_config.json")
    tiny_config("model", "registry.json", str(tmp_path), scale_rewards="group", max_steps=2, qlora_block_size=64,
                qlora_block_scale="absmax").save(saved_path)
    now = tiny_config("model", "registry.json", str(tmp_path), max_steps=10, resume_from_checkpoint="latest",
                      local_rank=0)
    # a default that changed is named; qlora's options shape nothing in a lora run; per-start options are not options
    assert changed_options(saved_path, now) == ["max_steps", "scale_rewards"]
    assert log_resumed_options(str(tmp_path), 2, str(tmp_path / "missing.json"), now) == []  # nothing to compare with
