"""Checkpoints: DeepSpeed engine state + trainer state, written atomically, the newest K kept.

Layout of one checkpoint folder (`output_dir/checkpoint-<step>`):
    engine/            DeepSpeed's files (module, optimizer, scheduler), per rank
    trainer_state.json step, epoch, data position, metrics needed to continue
    rng_rank<R>.pt     python / numpy / torch RNG states of each rank
A checkpoint is first written to `checkpoint-<step>.tmp` and renamed when every rank is done, so a crash mid-save
never leaves a folder that looks complete. All ranks must see the same output_dir (one node, or a shared disk).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch

from . import distributed as dist_utils
from .errors import ConfigError

ENGINE_TAG = "engine"
STATE_FILE = "trainer_state.json"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class TrainerState:
    step: int = 0                # optimizer steps (rollout batches) completed
    epoch: int = 0               # current pass over the training prompts
    position: int = 0            # prompts of this epoch already consumed (per rank)
    consecutive_bad_steps: int = 0
    last_checkpoint: Optional[str] = None
    last_good_checkpoint: Optional[str] = None  # newest one saved outside a streak of non-finite steps
    best_eval_reward: Optional[float] = None
    extra: dict = field(default_factory=dict)


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in output_dir as (step, path), oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CKPT_RE.match(name)
        path = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def resolve_resume_path(resume: str, output_dir: str) -> str:
    """'latest' -> newest complete checkpoint in output_dir; a path must hold trainer_state.json."""
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise ConfigError(f"--resume_from_checkpoint latest: no checkpoint-* folder with {STATE_FILE} "
                              f"in {output_dir}")
        return found[-1][1]
    if not os.path.isfile(os.path.join(resume, STATE_FILE)):
        raise ConfigError(f"--resume_from_checkpoint: {resume} is not a checkpoint folder (no {STATE_FILE}); "
                          f"give a checkpoint-<step> folder or 'latest'")
    return resume


def save_checkpoint(engine, state: TrainerState, output_dir: str, keep: int, frozen_excluded: bool) -> str:
    """Write checkpoint-<step> atomically on every rank; returns its path. Collective: all ranks call it.

    Rotation keeps the newest `keep` checkpoints and, besides them, the last good one.
    """
    final = os.path.join(output_dir, f"checkpoint-{state.step}")
    state.last_checkpoint = final
    if state.consecutive_bad_steps == 0:
        state.last_good_checkpoint = final
    tmp = final + ".tmp"
    if dist_utils.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    dist_utils.barrier()
    # frozen base weights (lora/qlora) are not saved: they are reloaded from the model path on resume
    engine.save_checkpoint(tmp, tag=ENGINE_TAG, exclude_frozen_parameters=frozen_excluded)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{dist_utils.rank()}.pt"))
    dist_utils.barrier()
    if dist_utils.is_main():
        with open(os.path.join(tmp, STATE_FILE), "w") as fh:
            json.dump(asdict(state), fh, indent=2)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _rotate(output_dir, keep, protect=state.last_good_checkpoint)
    dist_utils.barrier()
    return final


def load_checkpoint(engine, path: str, frozen_excluded: bool) -> TrainerState:
    """Restore engine (weights, optimizer, scheduler), trainer state and this rank's RNG."""
    load_path, _ = engine.load_checkpoint(path, tag=ENGINE_TAG, load_module_strict=not frozen_excluded,
                                          load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise ConfigError(f"--resume_from_checkpoint: DeepSpeed found no engine state in {path}/{ENGINE_TAG}")
    with open(os.path.join(path, STATE_FILE)) as fh:
        state = TrainerState(**json.load(fh))
    rng_file = os.path.join(path, f"rng_rank{dist_utils.rank()}.pt")
    if os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def _rotate(output_dir: str, keep: int, protect: Optional[str]) -> None:
    for _, path in list_checkpoints(output_dir)[:-keep]:
        if protect is None or os.path.abspath(path) != os.path.abspath(protect):
            shutil.rmtree(path, ignore_errors=True)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
