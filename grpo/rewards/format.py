"""Built-in shape rewards: the completion matches a format (regex), and a penalty on length."""
from __future__ import annotations

import re
from typing import Optional

from ..errors import RewardError
from .registry import register_reward


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
