"""The guide's launch command is accepted as written: its spellings of merged options (--learning_rate_lora, bare
--use_kl_penalty and --use_vllm_rollout) set today's options on the command line, in --config JSON and in
GRPOConfig(...), and the shipped configs and registry are found from any folder."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from .trainer_setup import ROOT, child_env

# the guide's command, with the embedded model and a registered dataset in place of the user's
GUIDE_COMMAND = """deepspeed --master_port 12345 train_grpo.py \\
    --deepspeed ./configs/zero2.json --model_name_or_path smollm2-135m-instruct --output_dir ./output/run_1 \\
    --dataset_config_path ./configs/dataset_config.json --dataset_names "arith" --epochs 1 \\
    --per_device_train_batch_size 1 --gradient_accumulation_steps 8 --learning_rate_lora 2e-6 --max_seq_length 2048 \\
    --k_samples 4 --rollout_max_new_tokens 512 --temperature 0.7 --top_p 0.9 --tuning_strategy "qlora" \\
    --lora_rank 64 --lora_alpha 16 --use_kl_penalty --kl_beta 0.1 --save_steps 100 --eval_steps 100 \\
    --use_vllm_rollout --vllm_tp 1 --use_wandb --wandb_project "grpo_tuning" --log_to_file"""


def guide_arguments() -> list[str]:
    tokens = shlex.split(GUIDE_COMMAND.replace("\\\n", " "))
    return tokens[tokens.index("train_grpo.py") + 1:]


def test_the_guides_command_gives_the_options_it_names(tmp_path, monkeypatch):
    from grpo.config import parse_args
    from grpo.config.shipped import shipped_file

    monkeypatch.chdir(tmp_path)  # a folder of the user's own: no configs/ here
    config = parse_args(guide_arguments())
    assert (config.tuning_strategy, config.learning_rate, config.kl_beta) == ("qlora", 2e-6, 0.1)
    assert (config.rollout_engine, config.rollout_mode, config.vllm_tp) == ("vllm", "colocate", 1)
    assert (config.use_wandb, config.wandb_project, config.log_to_file) == (True, "grpo_tuning", True)
    assert (config.k_samples, config.rollout_max_new_tokens, config.max_seq_length) == (4, 512, 2048)
    assert (config.temperature, config.top_p, config.lora_rank, config.lora_alpha) == (0.7, 0.9, 64, 16)
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps, config.epochs) == (1, 8, 1)
    assert (config.save_steps, config.eval_steps, config.dataset_names) == (100, 100, ["arith"])
    assert config.deepspeed == shipped_file("configs/zero2.json")
    assert config.dataset_config_path == shipped_file("configs/dataset_config.json")
    # folded, then cleared: the config holds each setting once
    assert (config.learning_rate_lora, config.use_kl_penalty, config.use_vllm_rollout) == (None, None, None)


@pytest.mark.parametrize("args, expected", [
    (["--use_kl_penalty"], {"kl_beta": 0.04}),                          # the guide's beta when none is given
    (["--use_kl_penalty", "true", "--kl_beta", "0.2"], {"kl_beta": 0.2}),
    (["--use_kl_penalty", "false", "--kl_beta", "0.2"], {"kl_beta": 0.0}),  # off wins, as in the guide
    (["--use_vllm_rollout"], {"rollout_engine": "vllm"}),
    (["--use_vllm_rollout", "false"], {"rollout_engine": "hf"}),
    (["--use_vllm_rollout=true", "--vllm_mode", "server", "--rollout_gpus", "1"], {"rollout_mode": "server"}),
    (["--learning_rate_lora", "3e-4"], {"learning_rate": 3e-4}),
    # full fine-tuning keeps --learning_rate (the guide's lora rate is for lora and qlora)
    (["--tuning_strategy", "full", "--learning_rate_lora", "3e-4"], {"learning_rate": 1e-6}),
    (["--tuning_strategy", "full", "--learning_rate", "5e-6", "--learning_rate_lora", "3e-4"], {"learning_rate": 5e-6}),
])
def test_each_guide_spelling_sets_todays_option(args, expected, monkeypatch):
    from grpo.config import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")  # server mode needs a training rank beside the rollout rank
    config = parse_args(args)
    assert {key: getattr(config, key) for key in expected} == expected


@pytest.mark.parametrize("args, says", [
    (["--use_vllm_rollout", "--rollout_engine", "hf"],
     "--use_vllm_rollout true and --rollout_engine hf disagree (the first means --rollout_engine vllm)"),
    (["--use_vllm_rollout", "false", "--rollout_engine", "vllm"],
     "--use_vllm_rollout false and --rollout_engine vllm disagree (the first means --rollout_engine hf)"),
    (["--vllm_mode", "server", "--rollout_mode", "colocate"],
     "--vllm_mode server and --rollout_mode colocate disagree (the first means --rollout_mode server)"),
])
def test_a_guide_spelling_and_todays_option_that_disagree_are_refused(args, says):
    from grpo.config import parse_args
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError, match="give one of them") as refused:
        parse_args(args)
    assert says in str(refused.value)


def test_a_clash_between_config_json_and_a_flag_is_refused_and_agreement_passes(tmp_path):
    from grpo.config import parse_args
    from grpo.errors import ConfigError

    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps({"rollout_engine": "hf"}))
    with pytest.raises(ConfigError, match="--rollout_engine hf disagree"):
        parse_args(["--config", str(config_file), "--use_vllm_rollout"])
    # agreeing spellings pass
    assert parse_args(["--use_vllm_rollout", "--rollout_engine", "vllm"]).rollout_engine == "vllm"


def test_guide_spellings_in_config_json_and_in_python(tmp_path):
    from grpo.config import GRPOConfig, parse_args

    run = tmp_path / "run.json"
    run.write_text(json.dumps({"learning_rate_lora": 1e-4, "use_kl_penalty": True, "use_vllm_rollout": True}))
    config = parse_args(["--config", str(run)])
    assert (config.learning_rate, config.kl_beta, config.rollout_engine) == (1e-4, 0.04, "vllm")
    config = GRPOConfig(learning_rate_lora=1e-4, use_kl_penalty=True, kl_beta=0.1, use_vllm_rollout=False)
    assert (config.learning_rate, config.kl_beta, config.rollout_engine) == (1e-4, 0.1, "hf")
    # a copy with another KL setting keeps it: the guide's switch was folded away
    import dataclasses
    assert dataclasses.replace(config, kl_beta=0.0).kl_beta == 0.0


def test_help_lists_the_guides_spellings_and_each_flag_once():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "--help"], capture_output=True,
                          text=True, env=child_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    guide = proc.stdout[proc.stdout.index("The guide's spellings"):]
    for flag in ("--learning_rate_lora", "--use_kl_penalty", "--use_vllm_rollout", "--vllm_mode"):
        assert flag in guide
    assert "--lora-rank" not in proc.stdout and proc.stdout.count("--lora_rank ") == 1
    typo = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "--max_step", "3"],
                          capture_output=True, text=True, env=child_env(), timeout=120)
    assert typo.returncode == 2 and "did you mean --max_steps?" in typo.stderr
    assert len(typo.stderr.strip().splitlines()) <= 3  # the usage line and the error, not a page of flags


def test_max_seq_length_follows_the_new_tokens_unless_given():
    from grpo.config import GRPOConfig
    from grpo.errors import ConfigError

    assert GRPOConfig().max_seq_length == 768
    assert GRPOConfig(rollout_max_new_tokens=1024).max_seq_length == 256 + 1024
    assert GRPOConfig(max_prompt_length=512, rollout_max_new_tokens=4096).max_seq_length == 512 + 4096
    with pytest.raises(ConfigError, match="max_seq_length: must be >= "):
        GRPOConfig(rollout_max_new_tokens=1024, max_seq_length=768)


def test_shipped_files_are_found_from_any_folder_and_a_missing_one_says_where_it_looked(tmp_path, monkeypatch):
    from grpo.config import GRPOConfig
    from grpo.config.shipped import shipped_file
    from grpo.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    config = GRPOConfig(deepspeed="configs/zero3.json")
    assert config.deepspeed == shipped_file("configs/zero3.json") and os.path.isfile(config.deepspeed)
    assert os.path.isfile(GRPOConfig().dataset_config_path)
    (tmp_path / "configs").mkdir()
    own = tmp_path / "configs" / "dataset_config.json"
    own.write_text("{}")
    assert GRPOConfig().dataset_config_path == "configs/dataset_config.json"  # the current folder's wins
    missing = GRPOConfig(deepspeed="configs/nope.json")  # kept as given: reading it says what is wrong
    assert missing.deepspeed == "configs/nope.json"
    from grpo.runtime.deepspeed_config import resolve_deepspeed_path

    with pytest.raises(ConfigError, match="--deepspeed: file not found: .*nope.json, nor among the files"):
        resolve_deepspeed_path(missing.deepspeed)


def test_a_short_job_runs_from_a_folder_outside_the_repository(tiny_model, tmp_path):
    """The guide's relative ./configs paths and the shipped `arith` entry, from a folder that has neither."""
    work = tmp_path / "my_project"
    work.mkdir()
    args = ["--deepspeed", "./configs/zero2.json", "--dataset_config_path", "./configs/dataset_config.json",
            "--dataset_names", "arith", "--model_name_or_path", tiny_model, "--output_dir", "./output/run_1",
            "--max_steps", "1", "--per_device_train_batch_size", "2", "--k_samples", "2",
            "--rollout_max_new_tokens", "4", "--max_prompt_length", "96", "--eval_on_start", "false",
            "--eval_max_prompts", "2", "--save_steps", "0", "--learning_rate_lora", "1e-4", "--use_kl_penalty"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), *args], capture_output=True,
                          text=True, cwd=work, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = work / "output" / "run_1"
    saved = json.loads((run / "grpo_config.json").read_text())
    assert (saved["learning_rate"], saved["kl_beta"]) == (1e-4, 0.04)
    assert os.path.isfile(saved["dataset_config_path"]) and os.path.isfile(saved["deepspeed"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in rows] == [1]
    # the memory plan, made before loading, printed at the start and saved beside the options (a CPU run's, in RAM)
    plan = json.loads((run / "memory_plan.json").read_text())
    assert plan["table"].startswith("memory plan for a CPU run") and plan["table"] in proc.stderr + proc.stdout
    assert plan["micro_batch_tokens"] == 16384 and plan["gradient_checkpointing"] is True
    assert (run / "lora_adapter" / "adapter_config.json").is_file()
    card = (run / "lora_adapter" / "README.md").read_text()  # ours, not PEFT's empty template
    assert f"base model: `{tiny_model}`" in card and "datasets: arith" in card and "steps: 1;" in card
    assert "More Information Needed" not in card and "AutoPeftModelForCausalLM" in card


def test_model_paths_that_cannot_load_fail_at_once_saying_why(tmp_path, monkeypatch):
    from grpo.errors import ConfigError
    from grpo.model.model_source import check_model_source

    with pytest.raises(ConfigError, match=r"no folder .*no_model; give a model folder \(with config.json\)"):
        check_model_source(str(tmp_path / "no_model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no config.json"):
        check_model_source(str(tmp_path / "empty"))
    # a hub id, not cached, with the hub out of reach (a closed local port): refused in well under the retries' minute
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    with pytest.raises(ConfigError, match=r"not in the Hugging Face cache .* cannot be reached from here .*"
                                          r"--local-dir DIR"):
        check_model_source("Qwen/Qwen2.5-0.5B-Instrct")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        check_model_source("Qwen/Qwen2.5-0.5B-Instruct")


def test_a_max_seq_length_past_the_models_positions_is_refused_for_vllm_before_loading(tiny_model):
    from transformers import AutoConfig

    from grpo.config import GRPOConfig
    from grpo.errors import ConfigError
    from grpo.model.model_source import check_positions

    positions = AutoConfig.from_pretrained(tiny_model).max_position_embeddings
    fits = GRPOConfig(max_prompt_length=64, rollout_max_new_tokens=positions - 64, rollout_engine="vllm")
    assert fits.max_seq_length == 768  # the default's floor, more than the model's 256 positions
    check_positions(tiny_model, fits)
    assert fits.max_seq_length == positions  # a default: shrunk to the model's positions
    longer = GRPOConfig(max_prompt_length=64, rollout_max_new_tokens=positions, rollout_engine="vllm")
    with pytest.raises(ConfigError, match=rf"--max_seq_length {longer.max_seq_length} .* more than the {positions} "
                                          r"positions .*vLLM refuses"):
        check_positions(tiny_model, longer)
    with pytest.raises(ConfigError, match="vLLM refuses"):  # given: kept, so refused
        check_positions(tiny_model, GRPOConfig(max_prompt_length=64, rollout_max_new_tokens=64,
                                               max_seq_length=positions + 1, rollout_engine="vllm"))
    import logging

    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("grpo").addHandler(handler)  # (an earlier run's console set-up may stop propagation)
    try:
        check_positions(tiny_model, GRPOConfig(max_prompt_length=64, rollout_max_new_tokens=positions))
    finally:
        logging.getLogger("grpo").removeHandler(handler)
    assert any(f"not trained on positions past {positions}" in message for message in warned), warned


def test_plan_only_refuses_a_length_past_the_models_positions_as_the_run_does(capsys):
    """--plan_only says what the run would: Gemma-2-9B allows 8,192 positions, so 256 + 8,192 tokens with vLLM are
    refused (before any plan is printed), while 4,096 new tokens plan."""
    import os

    from grpo.entry.train import main

    gemma = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_configs", "gemma-2-9b")
    flags = ["--model_name_or_path", gemma, "--tuning_strategy", "qlora", "--rollout_engine", "vllm",
             "--per_device_train_batch_size", "4", "--k_samples", "8", "--gpu_memory_gib", "24", "--plan_only"]
    assert main(flags + ["--rollout_max_new_tokens", "8192"]) == 1
    out, err = capsys.readouterr()
    assert "memory plan" not in out
    assert ("error: --max_seq_length 8448 (--max_prompt_length 256 + up to --rollout_max_new_tokens 8192) is more "
            "than the 8192 positions the model's config.json allows (max_position_embeddings); vLLM refuses") in err
    assert main(flags + ["--rollout_max_new_tokens", "4096"]) == 0
    assert capsys.readouterr().out.startswith("memory plan for a 24 GiB card")
