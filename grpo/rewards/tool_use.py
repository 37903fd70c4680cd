"""Built-in reward for tool use: the episode made a tool call that ran.

A model that never calls its tools gives GRPO no episode with a call to prefer; a small weight on this reward makes
the first well-formed calls stand out in their group until the answers they lead to can carry the signal alone.
"""
from __future__ import annotations

from typing import Optional

from grpo.errors import RewardError
from grpo.rewards.registry import register_reward

ERROR_PREFIX = "Error:"  # how the tools environment words every failed call (grpo.tools.execute)


def ran_a_tool(conversation: list[dict]) -> bool:
    """Whether a `tool` message of the conversation is a result, not an error (a call that parsed, named an offered
    tool, fit its arguments and returned)."""
    return any(m.get("role") == "tool" and not str(m.get("content", "")).lstrip().startswith(ERROR_PREFIX)
               for m in conversation)


def attempted_a_tool(conversation: list[dict]) -> bool:
    """Whether the conversation holds a `tool` message at all: a call was written, even one that failed."""
    return any(m.get("role") == "tool" for m in conversation)


@register_reward("tool_call")
def tool_call_reward(completions: list[str], answers: list, messages: Optional[list] = None, attempt: float = 0.0,
                     **_) -> list[float]:
    """1.0 when the episode holds a tool call that ran (its result is not an error); `attempt` (0 by default) when it
    holds calls that all failed (each answered with an error: bad JSON, a tool not offered, wrong arguments), a step
    towards a call that runs for a model that has yet to write one (a negative `attempt` instead penalises failed
    calls, below writing none); else 0.0.

    Reads the whole conversation (`messages`), which the trainer passes for every row; a one-turn completion has
    no tool messages and gets 0.0."""
    if messages is None:
        raise RewardError("tool_call reads the conversation (`messages`), which the trainer passes; when calling a "
                          "reward router yourself, pass messages=[...] (one conversation per completion)")
    if len(messages) != len(completions):
        raise RewardError(f"tool_call: got {len(messages)} conversations for {len(completions)} completions")
    return [1.0 if ran_a_tool(conversation) else float(attempt) if attempted_a_tool(conversation) else 0.0
            for conversation in messages]


def tool_reward_overrides(routes: dict[str, dict[str, float]], reward_kwargs: dict[str, dict[str, dict]],
                          tool_datasets: list[str], weight: Optional[float] = None,
                          penalty: Optional[float] = None) -> tuple[dict, dict]:
    """(routes, reward_kwargs) with --tool_call_reward / --tool_failure_penalty applied to the datasets that offer
    tools: tool_call's weight set to `weight` (added where a dataset has no tool_call), its `attempt` to -`penalty`.
    New dicts; the registry's stay as they are. A penalty needs a tool_call route to act through."""
    if weight is None and penalty is None:
        return routes, reward_kwargs
    if not tool_datasets:
        raise RewardError("--tool_call_reward / --tool_failure_penalty act on datasets that offer tools, and none of "
                          f"the named datasets ({', '.join(routes)}) does: drop them, or name a dataset with \"tools\"")
    routes = {source: dict(weights) for source, weights in routes.items()}
    reward_kwargs = {source: {name: dict(kw) for name, kw in by_name.items()}
                     for source, by_name in reward_kwargs.items()}
    for source in tool_datasets:
        if weight is not None:
            routes[source]["tool_call"] = float(weight)
        if penalty is not None:
            if "tool_call" not in routes[source]:
                raise RewardError(f"--tool_failure_penalty: dataset '{source}' has no tool_call reward for the penalty "
                                  "to act through: give --tool_call_reward too, or add tool_call to its \"rewards\"")
            reward_kwargs.setdefault(source, {}).setdefault("tool_call", {})["attempt"] = -float(penalty)
    return routes, reward_kwargs
