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
