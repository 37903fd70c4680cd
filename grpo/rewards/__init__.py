"""Reward registry, built-in verifiable rewards, and routing of rewards per dataset (one file each).

A reward is a batched function `fn(completions: list[str], answers: list, **row_fields) -> list[float]`.
row_fields always hold `prompts` and `data_source` (lists, one entry per completion), whatever else the caller
passes per row (the trainer adds `completion_ids`), and the extra keyword arguments configured for that reward
in the dataset registry. Built-ins accept **kwargs and ignore what they do not use.
"""

from grpo.rewards.agent import agent_reward
from grpo.rewards.format import (DEFAULT_FORMAT_PATTERN, format_reward, length_penalty, overlong_penalty,
                                 overlong_penalty_value)
from grpo.rewards.math import (boxed_accuracy, extract_gsm8k_prediction, gsm8k_accuracy, last_boxed, last_number,
                               math_equal, normalize_math, number_accuracy, numbers_equal, parse_number)
from grpo.rewards.registry import RewardFn, get_reward, load_reward_module, register_reward, registered_rewards
from grpo.rewards.routing import RewardResult, RewardRouter
from grpo.rewards.tool_use import ran_a_tool, tool_call_reward
from grpo.rewards.verified_math import math_verify_accuracy
from grpo.rewards.vision import (box_iou, choice_accuracy, iou_reward, normalize_text, parse_box, parse_choice,
                                 vqa_accuracy)

__all__ = [
    "RewardFn", "register_reward", "registered_rewards", "get_reward", "load_reward_module", "RewardRouter",
    "RewardResult", "parse_number", "last_number", "extract_gsm8k_prediction", "numbers_equal", "last_boxed",
    "normalize_math", "math_equal", "gsm8k_accuracy", "boxed_accuracy", "number_accuracy", "format_reward",
    "length_penalty", "DEFAULT_FORMAT_PATTERN", "vqa_accuracy", "choice_accuracy", "iou_reward", "normalize_text",
    "parse_choice", "parse_box", "box_iou", "overlong_penalty", "overlong_penalty_value", "math_verify_accuracy",
    "tool_call_reward", "ran_a_tool", "agent_reward",
]
