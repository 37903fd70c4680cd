"""Nothing of an earlier run is lost, and a refused start leaves nothing behind: a fresh run refuses a folder that
holds an earlier run's checkpoints, trained model or metrics; a start refused by its checks makes no folder; one that
stops after its folder exists says why in train.log."""
import json
import os
import subprocess
import sys

import pytest

from grpo.errors import ConfigError
from grpo.train.setup import check_no_earlier_run

from .trainer_setup import ROOT, child_env

# train_grpo.main in a fresh interpreter: its exit code, and whether torch was imported (a start refused before
# anything heavy loads imports none)
PROBE = """
import json, sys
import train_grpo
code = train_grpo.main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def run_main(*args):
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(), timeout=600)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def tiny_run(tiny_model, registry, out, *more):
    """One step on the tiny model: every sized option given."""
    return ("--model_name_or_path", tiny_model, "--dataset_config_path", registry, "--dataset_names", "toy",
            "--output_dir", str(out), "--max_steps", "1", "--per_device_train_batch_size", "2", "--k_samples", "2",
            "--rollout_max_new_tokens", "4", "--max_prompt_length", "32", "--max_seq_length", "40",
            "--eval_on_start", "false", "--eval_max_prompts", "2", "--lora_rank", "4", "--lora_alpha", "8",
            "--learning_rate", "1e-2", *more)


def snapshot(folder) -> dict:
    """Every file under `folder`, with its bytes."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = fh.read()
    return out


def test_a_fresh_run_refuses_a_folder_holding_an_earlier_runs_adapter_and_metrics(tiny_model, registry, tmp_path):
    out = tmp_path / "run"
    first, stderr = run_main(*tiny_run(tiny_model, registry, out, "--save_steps", "0"))
    assert first["code"] == 0, stderr[-3000:]
    assert (out / "lora_adapter" / "adapter_config.json").is_file() and (out / "metrics.jsonl").is_file()
    assert not [name for name in os.listdir(out) if name.startswith("checkpoint-")]  # nothing to resume from
    before = snapshot(out)

    again, stderr = run_main(*tiny_run(tiny_model, registry, out, "--save_steps", "0", "--seed", "7"))

    assert again == {"code": 1, "torch": False}  # refused before anything heavy loads
    assert f"--output_dir {out} holds the results of an earlier run (lora_adapter/, metrics.jsonl)" in stderr
    assert "--overwrite_output_dir" in stderr and "Traceback" not in stderr
    assert snapshot(out) == before  # the adapter, the metrics and the log as the first run left them

    over, stderr = run_main(*tiny_run(tiny_model, registry, out, "--save_steps", "0", "--overwrite_output_dir"))
    assert over["code"] == 0, stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [1]  # started over: one run's rows


@pytest.mark.parametrize("left", ["metrics", "model", "merged_model", "checkpoint"])
def test_each_kind_of_result_is_refused_and_a_log_alone_is_not(tmp_path, left):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.log").write_text("12:00:00 INFO a start that stopped\n")
    (out / "grpo_config.json").write_text("{}")
    check_no_earlier_run(str(out))  # a log and saved options are no result: the folder may be used
    if left == "metrics":
        (out / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    elif left == "checkpoint":
        (out / "checkpoint-3").mkdir()
        (out / "checkpoint-3" / "trainer_state.json").write_text("{}")
    else:
        (out / left).mkdir()
        (out / left / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as refused:
        check_no_earlier_run(str(out))
    if left == "checkpoint":
        assert "holds checkpoints of an earlier run" in str(refused.value)
        assert "--resume_from_checkpoint latest" in str(refused.value)
    else:
        assert "holds the results of an earlier run" in str(refused.value)
        assert ("metrics.jsonl" if left == "metrics" else f"{left}/") in str(refused.value)


def test_a_wrong_model_path_makes_no_folder(registry, tmp_path):
    out = tmp_path / "run"
    result, stderr = run_main("--model_name_or_path", str(tmp_path / "no_such_model"), "--dataset_config_path",
                              registry, "--dataset_names", "toy", "--output_dir", str(out))
    assert result["code"] == 1 and "no_such_model" in stderr
    assert not out.exists()


@pytest.mark.parametrize("where", ["missing", "empty", "not_a_checkpoint"])
def test_a_resume_from_nothing_is_refused_before_anything_is_made(registry, tmp_path, where):
    out = tmp_path / "run"
    resume = "latest"
    if where == "empty":
        out.mkdir()
    elif where == "not_a_checkpoint":
        (out / "checkpoint-1").mkdir(parents=True)  # no trainer_state.json: a save that never finished
        resume = str(out / "checkpoint-1")
    result, stderr = run_main("--dataset_config_path", registry, "--dataset_names", "toy", "--output_dir", str(out),
                              "--resume_from_checkpoint", resume)
    assert result == {"code": 1, "torch": False}
    assert "--resume_from_checkpoint" in stderr and "Traceback" not in stderr
    if where == "missing":
        assert f"{out} does not exist" in stderr and not out.exists()
    else:
        assert sorted(os.listdir(out)) == (["checkpoint-1"] if where == "not_a_checkpoint" else [])
        assert ("is not a checkpoint folder" if where == "not_a_checkpoint" else "no checkpoint-* folder") in stderr


def test_a_start_that_stops_after_its_folder_exists_says_why_in_train_log(tiny_model, registry, tmp_path):
    out = tmp_path / "run"
    first, stderr = run_main(*tiny_run(tiny_model, registry, out, "--save_steps", "1"))
    assert first["code"] == 0, stderr[-3000:]
    state = out / "checkpoint-1" / "trainer_state.json"
    state.write_text(state.read_text() + " ")  # one byte more than the manifest says

    resumed, stderr = run_main("--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-1"))

    assert resumed["code"] == 1 and "is damaged" in stderr
    log = (out / "train.log").read_text()
    stopped = [line for line in log.splitlines() if "the run stopped before its first step" in line]
    assert len(stopped) == 1 and "is damaged" in stopped[0] and " ERROR " in stopped[0], log[-2000:]
