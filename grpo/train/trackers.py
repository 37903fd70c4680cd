"""Experiment trackers: the rows rank 0 writes to metrics.jsonl, also sent to Weights & Biases, TensorBoard, trackio
or MLflow, as `--report_to` names them (transformers' convention: a list, `none`, `all` for every installed one).

Each tracker is its library's own, an optional extra (`pip install grpo[tensorboard]`), imported only when named; a
named one that is not installed stops the run before any model loads. `--use_wandb` (the guide's flag) adds wandb.
Where each writes, and how to open it: docs/checkpoints.md, "Logs and trackers".
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os

from grpo.config.choices import TRACKERS
from grpo.errors import ConfigError

logger = logging.getLogger("grpo")

# name -> (the module that must import, the extra that installs it: pip install 'grpo[tensorboard]')
MODULES = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard"),
           "trackio": ("trackio", "trackio"), "mlflow": ("mlflow", "mlflow")}


def installed(name: str) -> bool:
    return importlib.util.find_spec(MODULES[name][0]) is not None


def chosen_trackers(report_to: list[str], use_wandb: bool = False) -> list[str]:
    """The trackers a run sends its metrics to: --report_to's (checked names; `all`: those installed here), with
    wandb for --use_wandb."""
    chosen = [n for n in TRACKERS if installed(n)] if report_to == ["all"] else list(report_to)
    if use_wandb and "wandb" not in chosen:
        chosen.append("wandb")
    return chosen


def check_trackers(config) -> None:
    """Before any model loads: each tracker --report_to names is installed (wandb through --use_wandb only warns:
    grpo.train.setup runs without it)."""
    missing = [n for n in chosen_trackers(config.report_to) if not installed(n)]
    if missing:
        extras = ",".join(MODULES[n][1] for n in missing)
        raise ConfigError(f"--report_to {' '.join(missing)}: not installed here; pip install 'grpo[{extras}]' "
                          f"(or leave {'it' if len(missing) == 1 else 'them'} out of --report_to)")


def run_name(config) -> str:
    """The run's name in every tracker: --wandb_run_name, else the output folder's name."""
    return config.wandb_run_name or os.path.basename(os.path.abspath(config.output_dir))


def numbers(metrics: dict) -> dict:
    """The metrics a tracker plots: numbers only (no flags, no text)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbTracker:
    def __init__(self, config, start_step: int):
        import wandb

        self.run = wandb.init(project=config.wandb_project, name=run_name(config), config=config.to_dict(),
                              dir=config.output_dir)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """Event files in <output_dir>/tensorboard (`tensorboard --logdir <output_dir>/tensorboard`); a resumed run
    drops the events past its checkpoint, as metrics.jsonl does."""

    def __init__(self, config, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = os.path.join(config.output_dir, "tensorboard")
        self.writer = SummaryWriter(log_dir=self.folder, purge_step=start_step + 1 if start_step else None)
        if not start_step:
            self.writer.add_text("options", "```json\n" + json.dumps(config.to_dict(), indent=1, default=str)
                                 + "\n```", 0)

    def log(self, metrics: dict, step: int) -> None:
        for key, value in numbers(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class TrackioTracker:
    """trackio's local store (TRACKIO_DIR, by default ~/.cache/huggingface/trackio), project --wandb_project
    (`trackio show --project grpo`)."""

    def __init__(self, config, start_step: int):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=config.wandb_project, name=run_name(config), config=config.to_dict(),
                                resume="allow" if start_step else "never", embed=False)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(numbers(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """MLflow's tracking store: MLFLOW_TRACKING_URI where set (a server), else a local database,
    <output_dir>/mlflow.db (`mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`); the experiment is
    MLFLOW_EXPERIMENT_NAME, else --wandb_project."""

    def __init__(self, config, start_step: int):
        import mlflow

        self.mlflow = mlflow
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or \
            "sqlite:///" + os.path.join(os.path.abspath(config.output_dir), "mlflow.db")
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or config.wandb_project
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name(config)).info.run_id
        # values as text, each within MLflow's length limit for a parameter
        params = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in sorted(config.to_dict().items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, metrics: dict, step: int) -> None:
        import time

        now = int(time.time() * 1000)
        values = [self.mlflow.entities.Metric(k, v, now, step) for k, v in numbers(metrics).items()]
        for i in range(0, len(values), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=values[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_CLASSES = {"wandb": WandbTracker, "tensorboard": TensorBoardTracker, "trackio": TrackioTracker,
            "mlflow": MlflowTracker}


def start_trackers(config, start_step: int = 0) -> list:
    """The trackers of this run, started (rank 0 only); each has log(metrics, step) and close()."""
    chosen = chosen_trackers(config.report_to, config.use_wandb)
    if chosen:
        logger.info(f"metrics also go to {', '.join(chosen)}")
    return [_CLASSES[name](config, start_step) for name in chosen]
