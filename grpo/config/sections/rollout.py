"""The rollout engine's options."""
from __future__ import annotations

from typing import Optional


def routing_replay_conflict(config, agent_datasets=()) -> Optional[str]:
    """Why the step cannot carry the engine's routing to the trainer's forward with these options (and these datasets
    played by agents), or None."""
    if config.sequence_parallel_size > 1:
        return (f"--sequence_parallel_size {config.sequence_parallel_size} shards every row over the group's ranks, "
                "and the sharded forward does not take the routing of its share")
    if config.rollout_mode == "server":
        return "--rollout_mode server: the rollout ranks do not send the routing back with the completions"
    played = sorted(set(config.dataset_names) & set(agent_datasets))
    if played:
        return (f"dataset(s) {', '.join(played)} are played by agents, whose calls do not bring back the routing of "
                "their tokens")
    return None
