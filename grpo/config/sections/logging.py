"""Eval, checkpoints and logging: when a run evaluates and saves, what it keeps, the console and train.log, the
trackers (--report_to, the guide's --use_wandb), pushing to the Hugging Face Hub, and the checks of those options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo.config.choices import TRACKERS
from grpo.config.sections.option import need, option, option_list


@dataclass
class LoggingOptions:
    eval_steps: int = option(0, "Evaluate on the held-out split every N steps (0: only at the end).", "logging")
    eval_on_start: bool = option(True, "Evaluate before the first step (logged as step 0) when there is an eval set.",
                               "logging")
    eval_max_prompts: int = option(64, "Prompts of each eval dataset (and held-out split) per evaluation; -1: all.",
                                 "logging")
    eval_greedy: bool = option(True, "Greedy decoding in eval (else sampled with --temperature).", "logging")
    save_steps: int = option(50, "Save a checkpoint every N steps (0 disables).", "logging")
    save_total_limit: int = option(2, "Checkpoints kept in output_dir (oldest removed first).", "logging")
    logging_steps: int = option(1, "Print a metrics line every N steps (metrics.jsonl gets every step).", "logging")
    log_to_file: bool = option(True, "Also write the console log to output_dir/train.log.", "logging")
    use_wandb: bool = option(False, "Log metrics to Weights & Biases (WANDB_MODE=offline works).", "logging")
    wandb_project: str = option("grpo", "W&B project name.", "logging")
    wandb_run_name: Optional[str] = option(None, "W&B run name (default: output_dir's name).", "logging")
    report_to: list[str] = option_list(
        [], "Trackers the metrics also go to, named as in transformers: wandb, tensorboard, trackio, mlflow "
            "(several, space or comma separated); 'all': each one installed; 'none'. --use_wandb adds wandb; "
            "--wandb_project names each one's project, --wandb_run_name the run (docs/checkpoints.md).", "logging")
    push_to_hub: bool = option(
        False, "Upload the final model (the adapter, or the full model) with its model card, the run's options and "
               "curves to the Hugging Face Hub; the token and the hub are checked before any weight loads.", "logging")
    hub_model_id: Optional[str] = option(
        None, "--push_to_hub: the repository, 'user/name' or 'name' (the token's user); default: output_dir's name.",
        "logging")
    hub_private_repo: bool = option(
        False, "--push_to_hub: make the repository private (else the hub's default for new ones).", "logging")
    hub_strategy: str = option("end", "--push_to_hub: 'end' (the final model), or 'every_save' (also the model as it "
                                    "is at each checkpoint).", "logging", choices=("end", "every_save"))

    def check_logging(self) -> None:
        need(self.save_steps >= 0, "save_steps", "must be >= 0")
        need(self.save_total_limit >= 1, "save_total_limit", "must be >= 1")
        need(self.eval_steps >= 0, "eval_steps", "must be >= 0")
        need(self.logging_steps >= 1, "logging_steps", "must be >= 1")
        tracker_names(self.report_to)  # (made the list of names at construction)
        need(self.hub_strategy in ("end", "every_save"), "hub_strategy",
             f"got '{self.hub_strategy}', choose one of end, every_save")
        need(self.eval_max_prompts == -1 or self.eval_max_prompts >= 1, "eval_max_prompts",
             f"must be >= 1, or -1 for all prompts; got {self.eval_max_prompts}")


def tracker_names(value) -> list[str]:
    """--report_to as tracker names: a list, or one string, space or comma separated, lower-cased; 'none' alone
    becomes the empty list, 'all' stays alone. Whether each is installed is checked when the run starts."""
    parts = [value] if isinstance(value, str) else list(value or [])
    names = [n.strip().lower() for part in parts for n in str(part).split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS and n not in ("none", "all")]
    need(not unknown, "report_to", f"unknown tracker {', '.join(repr(n) for n in unknown)}; choose from "
                                   f"{', '.join(TRACKERS)}, or 'none', or 'all' (each one installed)")
    need(len(names) <= 1 or not {"none", "all"} & set(names), "report_to",
         f"'none' and 'all' stand alone (got {' '.join(names)})")
    return [] if names == ["none"] else names
