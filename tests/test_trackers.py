"""--report_to (transformers' convention): the names it takes, a missing library refused before anything loads, and
two steps of train_grpo.py whose TensorBoard events, MLflow run and trackio run, read back with each library's own
reader, hold the loss curve of metrics.jsonl."""
import json
import os
import subprocess
import sys

import pytest

from grpo.config import GRPOConfig, parse_args
from grpo.errors import ConfigError
from grpo.train import trackers
from grpo.train.reporting import read_metrics

from .trainer_setup import ROOT, child_env, tiny_config


def test_report_to_takes_a_list_none_or_all_as_transformers_does():
    assert parse_args(["--report_to", "tensorboard", "mlflow"]).report_to == ["tensorboard", "mlflow"]
    assert parse_args(["--report_to", "wandb,trackio"]).report_to == ["wandb", "trackio"]
    assert parse_args(["--report_to", "none"]).report_to == []
    assert parse_args(["--report_to", "all"]).report_to == ["all"]
    assert parse_args([]).report_to == []
    assert GRPOConfig(report_to="TensorBoard").report_to == ["tensorboard"]
    with pytest.raises(ConfigError, match="--report_to: unknown tracker 'tb'; choose from wandb, tensorboard"):
        parse_args(["--report_to", "tb"])
    with pytest.raises(ConfigError, match="'none' and 'all' stand alone"):
        GRPOConfig(report_to=["none", "wandb"])


def test_all_is_each_installed_tracker_and_use_wandb_adds_wandb(monkeypatch):
    monkeypatch.setattr(trackers, "installed", lambda name: name in ("tensorboard", "mlflow"))
    assert trackers.chosen_trackers(["all"]) == ["tensorboard", "mlflow"]
    assert trackers.chosen_trackers([], use_wandb=True) == ["wandb"]
    assert trackers.chosen_trackers(["trackio", "wandb"], use_wandb=True) == ["trackio", "wandb"]
    # the guide's --use_wandb without wandb runs on (grpo.train.setup says so); a tracker named is checked
    trackers.check_trackers(GRPOConfig(use_wandb=True))
    with pytest.raises(ConfigError, match=r"--report_to trackio wandb: not installed here; "
                                          r"pip install 'grpo\[trackio,wandb\]'"):
        trackers.check_trackers(GRPOConfig(report_to=["tensorboard", "trackio", "wandb"]))


def test_a_tracker_that_is_not_installed_stops_the_trainer_before_the_data_or_a_model_loads(monkeypatch, tmp_path):
    from grpo.train import trainer as trainer_module

    monkeypatch.setattr(trackers, "installed", lambda name: False)
    monkeypatch.setattr(trainer_module, "prepare_run", lambda *a, **k: pytest.fail("the run's data was prepared"))
    with pytest.raises(ConfigError, match="--report_to tensorboard: not installed here"):
        trainer_module.GRPOTrainer(GRPOConfig(report_to=["tensorboard"], output_dir=str(tmp_path / "out")))


def test_numbers_only_reach_the_trackers():
    assert trackers.numbers({"loss": 0.5, "step_skipped": True, "note": "x", "count": 3}) == {"loss": 0.5, "count": 3.0}


def test_train_grpo_reports_the_loss_curve_to_tensorboard_trackio_and_mlflow(tiny_model, registry, tmp_path):
    for module in ("tensorboard", "trackio", "mlflow"):
        pytest.importorskip(module, reason=f"{module} is not installed: pip install 'grpo[{module}]'")
    out, store = tmp_path / "run", tmp_path / "trackio"
    config = tiny_config(tiny_model, registry, str(out))
    flags = ["--model_name_or_path", tiny_model, "--dataset_config_path", registry, "--dataset_names", "toy",
             "--output_dir", str(out), "--wandb_project", "trackers-test"]
    for name in ("per_device_train_batch_size", "k_samples", "rollout_max_new_tokens", "max_prompt_length",
                 "max_seq_length", "max_steps", "save_steps", "eval_max_prompts", "lora_rank", "lora_alpha",
                 "lora_dropout", "learning_rate", "seed"):
        flags += [f"--{name}", str(getattr(config, name))]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), *flags,
                           "--report_to", "tensorboard", "trackio", "mlflow"], capture_output=True, text=True,
                          cwd=ROOT, env=child_env(TRACKIO_DIR=str(store)), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "metrics also go to tensorboard, trackio, mlflow" in proc.stderr
    expected = {r["step"]: r["loss"] for r in read_metrics(str(out / "metrics.jsonl")) if "loss" in r}
    assert sorted(expected) == [1, 2]

    # TensorBoard's own event reader (float32 in the event file)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert {"loss", "reward/mean", "eval/reward/mean"} <= set(events.Tags()["scalars"])
    assert {e.step: e.value for e in events.Scalars("loss")} == pytest.approx(expected, rel=1e-6)

    # MLflow's store: the local database in the run's folder
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    experiment = client.get_experiment_by_name("trackers-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["k_samples"] == str(config.k_samples)
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == expected

    # trackio's local store (TRACKIO_DIR), read in a process of its own: trackio reads the folder at import
    read = ("import json, sys\nfrom trackio.sqlite_storage import SQLiteStorage\n"
            "print(json.dumps(SQLiteStorage.get_logs('trackers-test', 'run')))")
    logs = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True,
                          env=child_env(TRACKIO_DIR=str(store)), timeout=120)
    rows = json.loads(logs.stdout.strip().splitlines()[-1])
    assert {r["step"]: r["loss"] for r in rows if "loss" in r} == expected
