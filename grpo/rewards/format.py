"""Built-in shape rewards: the completion matches a format (regex), penalties on length (characters, tokens)."""
from __future__ import annotations

import re
from typing import Optional

from grpo.errors import RewardError
from grpo.rewards.registry import register_reward


DEFAULT_FORMAT_PATTERN = r"<think>.*?</think>\s*.*\S.*"  # a think block, then a non-empty answer


@register_reward("format")
def format_reward(completions: list[str], answers: list, pattern: str = DEFAULT_FORMAT_PATTERN,
                  **_) -> list[float]:
    """1.0 when the whole stripped completion matches `pattern` (re.DOTALL, fullmatch), else 0.0."""
    try:
        regex = re.compile(pattern, re.DOTALL)
    except (re.error, TypeError) as exc:
        raise RewardError(f"format: invalid \"pattern\" {pattern!r} ({exc}); fix it in the dataset's "
                          f"\"reward_kwargs\"") from exc
    return [1.0 if regex.fullmatch(c.strip()) else 0.0 for c in completions]


@register_reward("length_penalty")
def length_penalty(completions: list[str], answers: list, target_chars: int = 1000,
                   max_chars: Optional[int] = None, **_) -> list[float]:
    """0 up to `target_chars` characters, falling linearly to -1 at `max_chars` (default 2 x target), -1 beyond.

    penalty(L) = -clip((L - target) / (max - target), 0, 1)
    """
    max_chars = 2 * target_chars if max_chars is None else max_chars
    if not 0 <= target_chars < max_chars:
        raise RewardError(f"length_penalty: need 0 <= target_chars < max_chars, got target_chars={target_chars}, "
                          f"max_chars={max_chars}; fix them in the dataset's \"reward_kwargs\"")
    span = max_chars - target_chars
    return [-min(max(len(c) - target_chars, 0) / span, 1.0) for c in completions]


def overlong_penalty_value(length: int, max_length: int, buffer_length: int, penalty_factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) of a completion of `length` tokens:

        0                                                  L <= max_length - buffer_length
        (max_length - buffer_length - L) / buffer_length * penalty_factor      inside the buffer
        -penalty_factor                                    L > max_length
    """
    start = max_length - buffer_length
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer_length * penalty_factor
    return -penalty_factor


@register_reward("overlong_penalty")
def overlong_penalty(completions: list[str], answers: list, completion_ids: Optional[list] = None,
                     max_length: Optional[int] = None, buffer_length: Optional[int] = None,
                     penalty_factor: float = 1.0, **_) -> list[float]:
    """DAPO's overlong shaping on the completion's length in tokens (see overlong_penalty_value); kwargs
    max_length (usually --rollout_max_new_tokens), buffer_length and penalty_factor from "reward_kwargs"."""
    if max_length is None or buffer_length is None:
        raise RewardError("overlong_penalty: set \"max_length\" and \"buffer_length\" (completion tokens) in the "
                          "dataset's \"reward_kwargs\", e.g. {\"max_length\": 256, \"buffer_length\": 64}")
    if not 0 < buffer_length <= max_length:
        raise RewardError(f"overlong_penalty: need 0 < buffer_length <= max_length, got buffer_length="
                          f"{buffer_length}, max_length={max_length}; fix them in the dataset's \"reward_kwargs\"")
    if not penalty_factor >= 0:
        raise RewardError(f"overlong_penalty: penalty_factor must be >= 0, got {penalty_factor}")
    if completion_ids is None:
        raise RewardError("overlong_penalty needs the completions' token ids (the trainer passes completion_ids; "
                          "when calling a router yourself, pass completion_ids=...)")
    return [overlong_penalty_value(len(ids), max_length, buffer_length, penalty_factor) for ids in completion_ids]
