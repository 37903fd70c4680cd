"""Run reporting on rank 0: console log + progress bar, train.log, metrics.jsonl, wandb, eval samples."""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Optional, Sequence

from tqdm.auto import tqdm

from grpo.config.options import GRPOConfig
from grpo.errors import ConfigError


logger = logging.getLogger("grpo")

# shown in the progress bar and in the console line, in this order, when present
_HEADLINE = [("reward/mean", "reward"), ("kl", "kl"), ("completion/length_mean", "len"), ("time/step", "s/step")]


def setup_console_logging(is_main: bool, log_file: Optional[str] = None, earlier: Sequence = ()) -> None:
    """Rank 0 logs INFO to stderr (and to log_file, which also gets the `earlier` records: what was logged before
    the run's folder existed); other ranks only warnings."""
    logger.setLevel(logging.INFO if is_main else logging.WARNING)
    logger.propagate = False
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    if is_main and log_file:
        for h in list(logger.handlers):
            if isinstance(h, logging.FileHandler):
                logger.removeHandler(h)
                h.close()
        handler = logging.FileHandler(log_file)
        handler.setFormatter(fmt)
        for record in earlier:
            handler.handle(record)
        logger.addHandler(handler)


class RunReporter:
    """Writes one metrics row per step; only rank 0 writes, other ranks keep silent."""

    def __init__(self, config: GRPOConfig, is_main: bool, total_steps: int, start_step: int = 0):
        self.config = config
        self.is_main = is_main
        self.metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
        self.eval_dir = os.path.join(config.output_dir, "eval")
        self._wandb = None
        self._bar = None
        if not is_main:
            return
        os.makedirs(config.output_dir, exist_ok=True)
        if start_step == 0 and os.path.exists(self.metrics_path):
            os.remove(self.metrics_path)  # a fresh run in a used folder starts a fresh log
        else:
            _truncate_after(self.metrics_path, start_step)  # a resumed run drops rows past its checkpoint
        if config.use_wandb:
            self._wandb = _start_wandb(config)
        self._bar = tqdm(total=total_steps, initial=start_step, desc="grpo", dynamic_ncols=True,
                         disable=not sys.stderr.isatty())

    def log_step(self, step: int, metrics: dict) -> None:
        if not self.is_main:
            return
        row = {"step": step, **metrics}
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
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
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        logger.info(f"eval at step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        return path

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _truncate_after(path: str, step: int) -> None:
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    if os.path.isfile(path):
        with open(path, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


def _start_wandb(config: GRPOConfig):
    try:
        import wandb
    except ImportError:
        raise ConfigError("--use_wandb needs wandb: pip install .[wandb] (or drop --use_wandb)")
    return wandb.init(project=config.wandb_project,
                      name=config.wandb_run_name or os.path.basename(os.path.abspath(config.output_dir)),
                      config=config.to_dict(), dir=config.output_dir)


# ---------------------------------------------------------------------------------------------------- plots
# Training curves as one PNG (reward, each reward function, KL / engine gap, completion length), drawn from
# metrics.jsonl rows.
_PANELS = [
    # eval: the total and each eval dataset's own line (eval/<dataset>/reward/mean)
    ("Reward", lambda k: k == "reward/mean" or (k.startswith("eval/") and k.endswith("/reward/mean"))),
    ("Reward per function", lambda k: k.startswith("rewards/") or k.startswith("eval/rewards/")),
    ("KL to reference, engine log-prob gap", lambda k: k in ("kl", "rollout/logprob_diff_mean")),
    ("Completion length (tokens)", lambda k: k in ("completion/length_mean", "eval/completion/length_mean")),
]


def panel_keys(rows: list[dict], wanted) -> list[str]:
    """The metrics a panel draws: those it wants that the rows hold, less a KL that is 0 throughout (no KL term)."""
    keys = sorted({k for r in rows for k in r if wanted(k)})
    return [k for k in keys if k != "kl" or any(r.get("kl") for r in rows)]


def plot_training_curves(rows: list[dict], path: str) -> str:
    """Write the 2x2 figure to `path` and return it. Rows are metrics.jsonl records (train and eval)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (title, wanted) in zip(axes.flat, _PANELS):
        keys = panel_keys(rows, wanted)
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, markersize=4,
                        linestyle="--" if key.startswith("eval/") else "-", label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if keys:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
