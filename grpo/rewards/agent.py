"""Built-in reward for agents that score their own episodes: the reward an agent returned (docs/agents.md).

A dataset with an "agent" is scored by its registry "rewards" like any other: they read the agent's result as text
(`completions`), the conversation (`messages`) and what the agent returned (`agent_results`). An agent that knows its
episode's reward (it ran the tests, asked its environment) returns it, and `agent_reward` passes it on.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

from grpo.errors import RewardError
from grpo.rewards.registry import register_reward


@register_reward("agent_reward")
def agent_reward(completions: list[str], answers: list, agent_results: Optional[list] = None, key: str = "reward",
                 **_) -> list[float]:
    """What each episode's agent returned as its reward: a number, or a dict's `key` ("reward" by default); 0.0 for
    an episode whose agent returned neither, failed, or is not an agent's."""
    if agent_results is None:
        raise RewardError("agent_reward reads what the agents returned (`agent_results`), which the trainer passes for "
                          "datasets that name an \"agent\"; give it to such a dataset only")
    if len(agent_results) != len(completions):
        raise RewardError(f"agent_reward: got {len(agent_results)} agent results for {len(completions)} completions")
    return [_reward_of(result, key) for result in agent_results]


def _reward_of(result, key: str) -> float:
    value = result.get(key) if isinstance(result, dict) else result
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0
