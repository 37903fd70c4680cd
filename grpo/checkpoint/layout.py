"""Names of a checkpoint's files and what a run folder holds, with nothing heavier than `os` imported: the command
line checks a resume and an output folder from here before torch or DeepSpeed load. The checkpoints' folders and the
files that make one are named in grpo/config/run_layout.py, where the command line reads a run's saved options."""
from __future__ import annotations

import os

from grpo.config.run_layout import CONFIG_FILE, MANIFEST_FILE, STATE_FILE, list_checkpoints  # noqa: F401 (also here)

ENGINE_TAG = "engine"                  # DeepSpeed's files, in checkpoint-<step>/engine/
BASE_FILE = "base_model.json"          # lora / qlora: which base model files the adapter was trained on
METRICS_FILE = "metrics.jsonl"         # a run's metrics, one row per step and evaluation
FINAL_MODEL_FOLDERS = ("lora_adapter", "model", "merged_model")  # the final model, as save_final_model writes it


def earlier_results(output_dir: str) -> list[str]:
    """What an earlier run left in output_dir that a new run there would replace: its checkpoints, its final model
    and its metrics (names relative to output_dir, folders with a trailing slash); empty for a new or unused
    folder (a log or saved options alone are no result)."""
    found = [f"{os.path.basename(path)}/" for _, path in list_checkpoints(output_dir)]
    for name in FINAL_MODEL_FOLDERS:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and os.listdir(path):
            found.append(f"{name}/")
    metrics = os.path.join(output_dir, METRICS_FILE)
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append(METRICS_FILE)
    return found


def resume_source_problem(resume: str, output_dir: str) -> str | None:
    """Why `resume` ('latest' or a folder) cannot be resumed from, judged from the folder names and files alone
    (cheap: before anything loads); None when it may be (whether it is intact is checked as it loads)."""
    if resume == "latest":
        if list_checkpoints(output_dir):
            return None
        if not os.path.isdir(output_dir):
            return f"--resume_from_checkpoint latest: {output_dir} does not exist, so there is no run to continue"
        why = (f"the run there saved none ({', '.join(earlier_results(output_dir))} only; --save_steps sets how "
               f"often a run saves)" if earlier_results(output_dir) else "it holds no run")
        return (f"--resume_from_checkpoint latest: no checkpoint-* folder with {STATE_FILE} in {output_dir}: {why}; "
                f"start a new run without --resume_from_checkpoint")
    resume = resume.rstrip("/")
    if os.path.isfile(os.path.join(resume, STATE_FILE)) or os.path.isfile(os.path.join(resume, MANIFEST_FILE)):
        return None
    return (f"--resume_from_checkpoint: {resume} is not a checkpoint folder (no {STATE_FILE}); give a "
            f"checkpoint-<step> folder or 'latest'")


def folder_bytes(folder: str) -> int:
    """The size of every file under `folder`."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def readable_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
