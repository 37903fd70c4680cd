"""Names of a checkpoint's files and where the checkpoints of a run are, with nothing heavier than `os` imported: the
command line reads a run's saved options from here before torch or DeepSpeed load."""
from __future__ import annotations

import os
import re

ENGINE_TAG = "engine"                  # DeepSpeed's files, in checkpoint-<step>/engine/
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "grpo_config.json"       # the options the checkpoint was trained with (also the run's, beside them)
BASE_FILE = "base_model.json"          # lora / qlora: which base model files the adapter was trained on
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete (renamed) checkpoints in output_dir as (step, path), oldest first; intact or not."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT_RE.match(name)
        path = os.path.join(output_dir, name)
        if m and (os.path.isfile(os.path.join(path, STATE_FILE)) or os.path.isfile(os.path.join(path, MANIFEST_FILE))):
            found.append((int(m.group(1)), path))
    return sorted(found)


def folder_bytes(folder: str) -> int:
    """The size of every file under `folder`."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def readable_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
