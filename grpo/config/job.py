"""The job the launcher started, which the options are checked against (--rollout_gpus takes some of its ranks):
every rank of it, training and rollout, from the launcher's RANK / WORLD_SIZE. A training rank of server mode narrows
WORLD_SIZE to the training ranks before its process group starts (grpo.runtime.roles.enter_training_world); the job's
own values are kept here first."""
from __future__ import annotations

import os

_job: dict = {}  # the launcher's RANK / WORLD_SIZE, kept once a training rank narrows its own WORLD_SIZE


def job_world_size() -> int:
    """Every rank the launcher started, training and rollout."""
    return _job.get("world", int(os.environ.get("WORLD_SIZE", "1")))


def job_rank() -> int:
    return _job.get("rank", int(os.environ.get("RANK", "0")))


def keep_job() -> bool:
    """Keep the launcher's values before WORLD_SIZE is narrowed; False where they were kept already."""
    if _job:
        return False
    _job.update(world=job_world_size(), rank=job_rank())
    return True
