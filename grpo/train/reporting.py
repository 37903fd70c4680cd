"""Run reporting on rank 0: the progress bar and each step's console line, metrics.jsonl, the trackers (trackers.py),
eval samples. The console logging itself is grpo.runtime.console_log's."""
from __future__ import annotations

import json
import logging
import os
import sys

from tqdm.auto import tqdm

from grpo.config.options import GRPOConfig
from grpo.train.trackers import start_trackers
from grpo.train.plots import plot_training_curves  # noqa: F401  (the trainer draws through here)


logger = logging.getLogger("grpo")

# shown in the progress bar and in the console line, in this order, when present
_HEADLINE = [("reward/mean", "reward"), ("kl", "kl"), ("episodes/called_a_tool", "tool"),
             ("completion/length_mean", "len"), ("time/step", "s/step")]


class RunReporter:
    """Writes one metrics row per step; only rank 0 writes, other ranks keep silent."""

    def __init__(self, config: GRPOConfig, is_main: bool, total_steps: int, start_step: int = 0):
        self.config = config
        self.is_main = is_main
        self.metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
        self.eval_dir = os.path.join(config.output_dir, "eval")
        self._trackers: list = []
        self._bar = None
        if not is_main:
            return
        os.makedirs(config.output_dir, exist_ok=True)
        restart_logs(config.output_dir, start_step)
        self._trackers = start_trackers(config, start_step)  # --report_to (and --use_wandb)
        self._bar = tqdm(total=total_steps, initial=start_step, desc="grpo", dynamic_ncols=True,
                         disable=not sys.stderr.isatty())

    def log_step(self, step: int, metrics: dict) -> None:
        if not self.is_main:
            return
        row = {"step": step, **metrics}
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        for tracker in self._trackers:
            tracker.log(metrics, step)
        # kl is 0 by construction without a KL term (--kl_beta 0): not worth a column then
        headline = {short: metrics[key] for key, short in _HEADLINE
                    if key in metrics and (key != "kl" or self.config.kl_beta > 0)}
        if self._bar is not None and not self._bar.disable:
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in headline.items()}, refresh=False)
            self._bar.update(1)
        if step % self.config.logging_steps == 0:
            text = " ".join(f"{k}={v:.4g}" for k, v in headline.items())
            phases = " ".join(f"{k.split('/')[1]}={v:.2f}s" for k, v in metrics.items()  # not the rollout's parts
                              if k.startswith("time/") and k != "time/step" and not k.startswith("time/rollout_"))
            logger.info(f"step {step}: {text} | {phases}")

    def log_eval(self, step: int, metrics: dict, samples: list[dict]) -> str:
        """Append eval metrics to metrics.jsonl and write the sample rows; returns the samples file."""
        if not self.is_main:
            return ""
        os.makedirs(self.eval_dir, exist_ok=True)
        path = os.path.join(self.eval_dir, f"samples_step{step}.jsonl")
        with open(path, "w") as fh:
            for row in samples:
                fh.write(json.dumps(row) + "\n")
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps({"step": step, **metrics}) + "\n")
        for tracker in self._trackers:
            tracker.log(metrics, step)
        logger.info(f"eval at step {step}: {eval_line(metrics)}")
        return path

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def restart_logs(output_dir: str, step: int) -> None:
    """The run's logs as of `step`: a fresh run (0) in a used folder (--overwrite_output_dir) starts them empty; a
    resumed one drops what was logged past its checkpoint (metrics rows, per-rank completion samples, evaluation
    samples), which it logs again."""
    import glob

    logs = [os.path.join(output_dir, "metrics.jsonl")] + glob.glob(os.path.join(output_dir, "completions", "*.jsonl"))
    for path in logs:
        if step == 0 and os.path.exists(path):
            os.remove(path)
        else:
            _truncate_after(path, step)
    for path in glob.glob(os.path.join(output_dir, "eval", "samples_step*.jsonl")):
        logged = path.rsplit("samples_step", 1)[1].removesuffix(".jsonl")
        if not logged.isdigit() or int(logged) > step or step == 0:
            os.remove(path)


def _truncate_after(path: str, step: int) -> None:
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    if os.path.isfile(path):
        with open(path, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


def eval_line(metrics: dict) -> str:
    """The console's eval line: the figures without their eval/ prefix; per-dataset figures only with several eval
    datasets (with one they repeat the totals); sample counts are left to metrics.jsonl."""
    datasets = {k.split("/")[1] for k in metrics if k.startswith("eval/") and k.endswith("/prompts")}
    shown = {}
    for key, value in metrics.items():
        name = key.removeprefix("eval/")
        if key.endswith("/prompts") or (len(datasets) == 1 and name.split("/")[0] in datasets):
            continue
        shown[name] = value
    return " ".join(f"{k}={v:.4g}" for k, v in shown.items())
