"""Two DeepSpeed ranks on CPU (gloo), launched as a user would: `deepspeed --num_gpus 2 train_grpo.py ...`."""
import json
import os
import re
import shutil
import subprocess
import time

import pytest

from grpo.checkpoint.manifest import MANIFEST_FILE

from .tiny_models import make_tiny_model_dir
from .trainer_setup import ROOT, child_env, deepspeed_launcher, train_rows, write_prompt_registry

REWARD_MODULE = '''
from grpo import register_reward

@register_reward("says_seven")
def says_seven(completions, answers, **row):
    return [c.split().count("7") / max(len(c.split()), 1) for c in completions]
'''
FAILING_REWARD_MODULE = '''
import os
import re
from grpo import register_reward

calls = 0  # counts training steps: the tests turn the eval at step 0 off

@register_reward("says_seven")
def says_seven(completions, answers, **row):
    global calls
    calls += 1
    if calls == 2 and os.environ["RANK"] == "1":
        raise ValueError("judge model returned HTTP 503")
    return [0.0] * len(completions)
'''
KILLED_REWARD_MODULE = FAILING_REWARD_MODULE.replace(
    'raise ValueError("judge model returned HTTP 503")', 'os.kill(os.getpid(), 9)  # as the OOM killer would')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mp")
    model = make_tiny_model_dir(str(folder / "model"))
    registry = write_prompt_registry(str(folder / "data"), reward="says_seven")
    (folder / "rewards.py").write_text(REWARD_MODULE)
    (folder / "failing_rewards.py").write_text(FAILING_REWARD_MODULE)
    (folder / "killed_rewards.py").write_text(KILLED_REWARD_MODULE)
    return folder, model, registry


def launch_command(model, registry, out, port, *flags, where=("--num_gpus", "2")) -> list[str]:
    """`deepspeed <where> train_grpo.py ...` on the tiny model and the toy data (`where`: the launcher's choice of
    ranks, by default 2 on this machine)."""
    return [*deepspeed_launcher(), *where, "--master_port", str(port),
            os.path.join(ROOT, "train_grpo.py"), "--model_name_or_path", model, "--dataset_config_path", registry,
            "--dataset_names", "toy", "--output_dir", str(out), "--k_samples", "4",
            "--per_device_train_batch_size", "2", "--rollout_max_new_tokens", "8", "--max_prompt_length", "32",
            "--max_seq_length", "48", "--learning_rate", "1e-3", "--eval_max_prompts", "4", *flags]


def launch(folder, model, registry, out, port, *flags, timeout=600, ranks=2):
    """`deepspeed --num_gpus 2 train_grpo.py ...` on CPU, with this checkout first on PYTHONPATH."""
    cmd = launch_command(model, registry, out, port, *flags, where=("--num_gpus", str(ranks)))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=timeout)


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
@pytest.mark.parametrize("zero, strategy", [("zero2", "full"), ("zero3", "lora")])
def test_two_ranks(zero, strategy, setup):
    folder, model, registry = setup
    out = folder / f"out_{zero}"
    proc = launch(folder, model, registry, out, 29500 + (7 if zero == "zero3" else 3),
                  "--reward_module", str(folder / "rewards.py"), "--tuning_strategy", strategy, "--deepspeed", zero,
                  "--max_steps", "2", "--gradient_accumulation_steps", "2", "--save_steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 rank(s)" in proc.stderr + proc.stdout
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    # every rank trained on its own prompts: 2 steps x 4 prompts each, no prompt on both ranks
    seen = {}
    for rank in (0, 1):
        with open(out / "completions" / f"rank{rank}.jsonl") as fh:
            seen[rank] = [json.loads(line)["index"] for line in fh]
        assert len(seen[rank]) == 2 * 4
    assert not set(seen[0]) & set(seen[1])
    assert os.path.isdir(out / "checkpoint-2" / "engine")
    # the manifest covers both ranks' DeepSpeed files
    manifest = json.loads((out / "checkpoint-2" / MANIFEST_FILE).read_text())["files"]
    on_disk = {os.path.relpath(os.path.join(root, n), out / "checkpoint-2")
               for root, _, names in os.walk(out / "checkpoint-2") for n in names if n != MANIFEST_FILE}
    assert set(manifest) == on_disk
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= on_disk
    assert any("zero_pp_rank_1" in name for name in on_disk) and any("zero_pp_rank_0" in name for name in on_disk)
    final = out / ("model" if strategy == "full" else "lora_adapter")
    assert os.path.isfile(final / ("model.safetensors" if strategy == "full" else "adapter_model.safetensors"))


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
def test_two_ranks_share_a_warm_start(tmp_path):
    """ZeRO-3 lora on 2 ranks, 3 warm-start steps on 8 calculator demonstrations: each rank takes 4 of them a step
    (the logged token count is both ranks' 8 rows), the likelihood rises, and GRPO's step follows."""
    from .test_warm_start import demonstration_rows, demonstrations_registry

    model = make_tiny_model_dir(str(tmp_path / "model"))
    registry = demonstrations_registry(tmp_path / "data", demonstration_rows(8))
    cmd = [*deepspeed_launcher(), "--num_gpus", "2", "--master_port", "29521", os.path.join(ROOT, "train_grpo.py"),
           "--model_name_or_path", model, "--dataset_config_path", registry, "--dataset_names", "calc_toy,toy",
           "--output_dir", str(tmp_path / "out"), "--k_samples", "4", "--per_device_train_batch_size", "2",
           "--rollout_max_new_tokens", "8", "--max_prompt_length", "224", "--max_seq_length", "320", "--max_turns",
           "2", "--learning_rate", "1e-2", "--eval_on_start", "false", "--eval_max_prompts", "4", "--max_steps", "1",
           "--save_steps", "0", "--warm_start_steps", "3", "--deepspeed", "zero3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logged = re.findall(r"warm start (\d)/3: loss=([0-9.]+) \(negative log-likelihood per model token, (\d+) tokens",
                        proc.stdout + proc.stderr)
    single_rank = demonstrations_token_count(model, registry)
    assert [int(step) for step, _, _ in logged] == [1, 2, 3]
    assert all(int(tokens) == single_rank for _, _, tokens in logged)
    assert float(logged[-1][1]) < float(logged[0][1])
    assert [r["step"] for r in train_rows(tmp_path / "out")] == [1]


def demonstrations_token_count(model, registry) -> int:
    """The model tokens of all 8 demonstrations, laid out in this process (what both ranks' shares add up to)."""
    from transformers import AutoTokenizer

    from grpo.data import load_demonstrations, render_prompts
    from grpo.rollout.episodes import EpisodeLimits
    from grpo.data.episode_datasets import EpisodeDataset, prompts_with_tools
    from grpo.tools import check_tools, get_environment
    from grpo.train.warm_start import demonstration_batch

    tokenizer = AutoTokenizer.from_pretrained(model)
    calc = EpisodeDataset(["calculator"], get_environment("tools"), [t.schema for t in check_tools(["calculator"])])
    rows, tools = prompts_with_tools(load_demonstrations(registry, ["calc_toy"]), tokenizer, {"calc_toy": calc})
    rows = render_prompts(rows, tokenizer, 224, tools_by_source=tools)
    batch = demonstration_batch(list(rows), tokenizer, {"calc_toy": calc}, EpisodeLimits(2, 320 - 224))
    return int(batch.completion_mask.sum())


def launch_with_reward(setup, reward_file: str, out_name: str, port: int, **kw):
    """A 4-step lora run on 2 ranks whose reward module is `reward_file` (no eval at step 0: the module counts
    reward calls as training steps)."""
    folder, model, registry = setup
    out = folder / out_name
    proc = launch(folder, model, registry, out, port, "--reward_module", str(folder / reward_file),
                  "--eval_on_start", "false", "--tuning_strategy", "lora", "--max_steps", "4",
                  "--ddp_timeout_minutes", "10", **kw)
    return out, proc


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
def test_a_rank_that_fails_stops_the_job_with_its_error(setup):
    out, proc = launch_with_reward(setup, "failing_rewards.py", "out_failing", 29511)
    ended = time.time()
    assert proc.returncode != 0
    record = json.loads((out / "failures" / "rank1.json").read_text())
    assert (record["rank"], record["step"], record["phase"], record["primary"]) == (1, 2, "rewards", True)
    # the job ended soon after rank 1 failed, not at the collective timeout
    assert ended - record["time"] < 60, ended - record["time"]
    # the last line the job printed (the launcher's own bookkeeping aside) is rank 1's error
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.strip() and "launch.py" not in line and "[launch" not in line]
    expected = "error: rank 1 failed at step 2 (rewards): reward 'says_seven' (dataset 'toy') raised ValueError: " \
               "judge model returned HTTP 503"
    # (printed by rank 1, or logged by rank 0 as it stops: whichever the launcher lets finish last)
    assert expected[len("error: "):] in lines[-1], (proc.stdout + proc.stderr)[-4000:]
    # rank 0 stopped too, naming rank 1's error, and train.log holds rank 1's traceback
    assert "rank 0 stopped: " + expected[len("error: "):] in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]
    log = (out / "train.log").read_text()
    assert "rank 1 traceback" in log and "judge model returned HTTP 503" in log


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
def test_two_ranks_verify_before_resuming(setup):
    folder, model, registry = setup
    out = folder / "out_damaged"
    common = ["--reward_module", str(folder / "rewards.py"), "--tuning_strategy", "full", "--save_steps", "1",
              "--save_total_limit", "2"]
    proc = launch(folder, model, registry, out, 29515, *common, "--max_steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # rank 1's optimizer shard of the newest checkpoint is cut short
    engine = out / "checkpoint-2" / "engine"
    shard = next(name for name in os.listdir(engine) if "zero_pp_rank_1" in name and "optim" in name)
    with open(engine / shard, "r+b") as fh:
        fh.truncate(100)

    proc = launch(folder, model, registry, out, 29517, *common, "--max_steps", "3",
                  "--resume_from_checkpoint", str(out / "checkpoint-2"))
    assert proc.returncode != 0
    both = proc.stdout + proc.stderr
    expected = f"error: --resume_from_checkpoint: checkpoint {out / 'checkpoint-2'} is damaged: engine/{shard} is 100 bytes"
    assert both.count(expected) == 2, both[-4000:]  # the same verdict on both ranks, before either loaded
    assert f"--resume_from_checkpoint {out / 'checkpoint-1'}" in both

    proc = launch(folder, model, registry, out, 29519, *common, "--max_steps", "3", "--resume_from_checkpoint",
                  "latest")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "train.log").read_text()
    assert "checkpoint-2 is damaged" in log and f"resumed from {out / 'checkpoint-1'} at step 1" in log
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
def test_a_rank_killed_without_an_error_is_named(setup):
    out, proc = launch_with_reward(setup, "killed_rewards.py", "out_killed", 29513, timeout=300)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.strip() and "launch.py" not in line and "[launch" not in line]
    assert "rank 1 (pid " in lines[-1] and "died without reporting an error" in lines[-1], \
        (proc.stdout + proc.stderr)[-4000:]
