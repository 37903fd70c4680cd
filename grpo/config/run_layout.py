"""Where a run's checkpoints are in its --output_dir and the names of the files that make one (the options it was
trained with among them), with nothing heavier than `os` imported: the command line reads a run's saved options
(grpo/config/saved.py) before torch or DeepSpeed load. grpo/checkpoint/layout.py names the rest of a run's files."""
from __future__ import annotations

import os
import re

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "grpo_config.json"       # the options the checkpoint was trained with (also the run's, beside them)
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
