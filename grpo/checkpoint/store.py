"""Checkpoints: DeepSpeed engine state + trainer state, written atomically, the newest K kept.

Layout of one checkpoint folder (`output_dir/checkpoint-<step>`):
    engine/            DeepSpeed's files (module, optimizer, scheduler), per rank; lora / qlora: the trainable
                       weights only (the frozen base is rebuilt from the model at resume)
    trainer_state.json step, epoch, data position, metrics needed to continue
    grpo_config.json   the options this checkpoint was trained with (a resume starts from them)
    base_model.json    lora / qlora: the base model's files it was trained on (see base_model.py)
    rng_rank<R>.pt     python / numpy / torch RNG states of each rank
    manifest.json      size and checksum of every file above (all ranks'), written last; see manifest.py
A checkpoint is first written to `checkpoint-<step>.tmp` and renamed when every rank is done, so a crash mid-save
never leaves a folder that looks complete. All ranks must see the same output_dir (one node, or a shared disk).
Resuming verifies the manifest first: a damaged checkpoint stops the run naming the file (or, with 'latest', is
skipped for the newest intact one). Rotation never removes the newest intact checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
from contextlib import contextmanager, nullcontext
from functools import partial
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch

from grpo.runtime import distributed as dist_utils
from grpo.errors import CheckpointError, ConfigError
from grpo.checkpoint.base_model import write_base_model_record
from grpo.checkpoint.layout import (CONFIG_FILE, ENGINE_TAG, STATE_FILE, list_checkpoints,  # noqa: F401 (read here too)
                                    resume_source_problem)
from grpo.checkpoint.manifest import MANIFEST_FILE, has_manifest, quick_problem, verify_checkpoint, write_manifest

logger = logging.getLogger("grpo")



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


def resolve_resume_path(resume: str, output_dir: str) -> str:
    """The verified checkpoint to resume from. Collective: every rank gets the same answer before any loads.

    'latest' -> the newest intact checkpoint in output_dir (damaged newer ones are skipped with a warning);
    a path must be a checkpoint folder, and intact: a damaged one raises CheckpointError naming the file and the
    checkpoint to use instead. Checkpoints without a manifest (older versions) load unverified.
    """
    problem = resume_source_problem(resume, output_dir)
    if problem is not None:
        raise ConfigError(problem)
    if resume == "latest":
        found = list_checkpoints(output_dir)
        skipped = []
        for _, path in reversed(found):
            problem = verify_checkpoint(path)
            if problem is None:
                for bad, why in skipped:
                    logger.warning(f"checkpoint {bad} is damaged ({why}); skipped. Resuming from the newest intact "
                                   f"checkpoint, {path}; {bad} is replaced when its step is saved again")
                _note_unverified(path)
                return path
            skipped.append((path, problem))
        bad, why = skipped[0]
        raise CheckpointError(f"--resume_from_checkpoint latest: every checkpoint in {output_dir} is damaged; the "
                              f"newest, {bad}: {why}. Start again with --overwrite_output_dir "
                              f"(or give a folder of your own with --resume_from_checkpoint)")
    resume = resume.rstrip("/")
    problem = verify_checkpoint(resume)
    if problem is not None:
        raise CheckpointError(f"--resume_from_checkpoint: checkpoint {resume} is damaged: {problem}. "
                              + _intact_advice(resume))
    _note_unverified(resume)
    return resume


def _intact_advice(damaged: str) -> str:
    """Names the newest intact checkpoint beside `damaged` (collective: verifies them in turn)."""
    folder = os.path.dirname(os.path.abspath(damaged))
    for _, path in reversed(list_checkpoints(folder)):
        if os.path.abspath(path) != os.path.abspath(damaged) and verify_checkpoint(path) is None:
            return f"The newest intact checkpoint is {path}: resume with --resume_from_checkpoint {path}"
    return (f"No intact checkpoint is left in {folder}: start again with --overwrite_output_dir "
            f"(the damaged checkpoint is not deleted)")


def _note_unverified(path: str) -> None:
    if not has_manifest(path):
        logger.warning(f"checkpoint {path} has no {MANIFEST_FILE} (saved by an older version): loading it unverified")


def save_checkpoint(engine, state: TrainerState, output_dir: str, keep: int, frozen_excluded: bool, config,
                    base_record: Optional[dict] = None) -> str:
    """Write checkpoint-<step> atomically on every rank; returns its path. Collective: all ranks call it.

    `config` (the options trained with) and `base_record` (lora / qlora: base_model.base_model_record) are saved
    with it. Rotation keeps the newest `keep` checkpoints and, besides them, the last good one.
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
    # frozen base weights (lora/qlora) are not saved: they are rebuilt from the model path on resume
    with trainable_state_dict_only(engine.module) if frozen_excluded else nullcontext():
        engine.save_checkpoint(tmp, tag=ENGINE_TAG, exclude_frozen_parameters=frozen_excluded)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{dist_utils.rank()}.pt"))
    dist_utils.barrier()
    if dist_utils.is_main():
        with open(os.path.join(tmp, STATE_FILE), "w") as fh:
            json.dump(asdict(state), fh, indent=2)
        config.save(os.path.join(tmp, CONFIG_FILE))
        if base_record is not None:
            write_base_model_record(tmp, base_record)
    write_manifest(tmp)  # last: sizes and checksums of every rank's files
    if dist_utils.is_main():
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        rotate_checkpoints(output_dir, keep, protect=state.last_good_checkpoint)
    dist_utils.barrier()
    return final


def load_checkpoint(engine, path: str, frozen_excluded: bool) -> TrainerState:
    """Restore engine (weights, optimizer, scheduler), trainer state and this rank's RNG.

    Call it on a path from resolve_resume_path (verified); a file that still fails to load (e.g. a checkpoint
    without a manifest) raises CheckpointError naming the checkpoint.
    """
    try:
        load_trainable = partial(_load_trainable, path) if frozen_excluded else None  # the base is the model's
        load_path, _ = engine.load_checkpoint(path, tag=ENGINE_TAG, load_module_strict=not frozen_excluded,
                                              load_optimizer_states=True, load_lr_scheduler_states=True,
                                              custom_load_fn=load_trainable)
        if load_path is None:
            raise CheckpointError(f"--resume_from_checkpoint: DeepSpeed found no engine state in "
                                  f"{path}/{ENGINE_TAG}")
        with open(os.path.join(path, STATE_FILE)) as fh:
            state = TrainerState(**json.load(fh))
        rng_file = os.path.join(path, f"rng_rank{dist_utils.rank()}.pt")
        if os.path.isfile(rng_file):
            _set_rng_state(torch.load(rng_file, weights_only=False))
    except CheckpointError:
        raise
    except Exception as exc:  # torch.load / DeepSpeed / JSON errors do not name the checkpoint
        raise CheckpointError(f"--resume_from_checkpoint: checkpoint {path} could not be loaded "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                              f"{_intact_hint(path)}") from exc
    return state


@contextmanager
def trainable_state_dict_only(module):
    """Within: `module.state_dict()` holds its trainable parameters only. DeepSpeed's exclude_frozen_parameters
    leaves the frozen tensors that are not a parameter under their own name: a tied output layer (SmolLM2's is
    its 113 MB embedding again) and a 4-bit layer's quantization state."""
    trainable = _trainable_names(module)

    def keep_trainable(_module, state_dict, prefix, _metadata):
        for key in [k for k in state_dict if k[len(prefix):] not in trainable]:
            del state_dict[key]

    handle = module.register_state_dict_post_hook(keep_trainable)
    try:
        yield
    finally:
        handle.remove()


def _trainable_names(module) -> set[str]:
    return {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}


def _load_trainable(path: str, src: dict, dst) -> None:
    """The module state of a lora / qlora checkpoint into the model: every trainable parameter must be in it; the
    frozen base is the model's own (a checkpoint saved before frozen weights were left out still restores them)."""
    result = dst.load_state_dict(src, strict=False)
    missing = sorted(_trainable_names(dst) & set(result.missing_keys))
    if missing or result.unexpected_keys:
        what = (f"no {missing[0]} (of {len(missing)} trainable weights missing)" if missing
                else f"{result.unexpected_keys[0]}, which this model does not have")
        raise CheckpointError(f"--resume_from_checkpoint: the weights of {path} do not fit this model: it holds "
                              f"{what}; resume with the model and adapter options it was trained with")


def _intact_hint(path: str) -> str:
    """Not collective (a load error may hit one rank only): points at the other checkpoints by name."""
    others = [p for _, p in list_checkpoints(os.path.dirname(os.path.abspath(path)))
              if os.path.abspath(p) != os.path.abspath(path)]
    if others:
        return f"resume from an earlier checkpoint instead, e.g. --resume_from_checkpoint {others[-1]}"
    return "no other checkpoint is in that folder: start again with --overwrite_output_dir"


def rotate_checkpoints(output_dir: str, keep: int, protect: Optional[str] = None) -> list[str]:
    """Remove checkpoints older than the newest `keep` intact ones; returns the removed paths.

    Intact here means the manifest's files are all present with their sizes (no hashing; legacy checkpoints
    count as intact). Damaged checkpoints newer than the kept ones stay (never delete the last intact one for a
    damaged one), and so does `protect` (the last good checkpoint before a streak of non-finite steps).
    """
    found = list_checkpoints(output_dir)
    intact = [(step, path) for step, path in found if quick_problem(path) is None]
    kept = intact[-keep:]
    if not kept:
        return []
    oldest_kept = kept[0][0]
    removed = []
    for step, path in found:
        if step < oldest_kept and (protect is None or os.path.abspath(path) != os.path.abspath(protect)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


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
