"""Reward registry, built-in verifiable rewards, and routing of rewards per dataset.

A reward is a batched function `fn(completions: list[str], answers: list, **row_fields) -> list[float]`.
row_fields always hold `prompts` and `data_source` (lists, one entry per completion), `completion_ids`, and the
extra keyword arguments configured for that reward in the dataset registry.
"""
from __future__ import annotations

import importlib.util
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .errors import RewardError

RewardFn = Callable[..., list]
_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str):
    """Decorator: make `fn` usable by name in dataset_config.json's "rewards"."""
    def decorator(fn: RewardFn) -> RewardFn:
        existing = _REGISTRY.get(name)
        if existing is not None and _qualname(existing) != _qualname(fn):
            raise RewardError(f"reward name '{name}' is already registered by {_qualname(existing)}; "
                              f"pick another name for {_qualname(fn)}")
        _REGISTRY[name] = fn
        return fn
    return decorator


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFn:
    if name not in _REGISTRY:
        raise RewardError(f"unknown reward '{name}'. Registered: {', '.join(registered_rewards())}. Add one with "
                          f"@register_reward(\"{name}\") in a Python file passed with --reward_module")
    return _REGISTRY[name]


def load_reward_module(path: str) -> None:
    """Import a user's file so that its @register_reward decorators run."""
    if not os.path.isfile(path):
        raise RewardError(f"--reward_module: file not found: {path}")
    module_name = "grpo_user_rewards_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise RewardError(f"--reward_module: importing {path} failed: {type(exc).__name__}: {exc}") from exc


# ----------------------------------------------------------------------------------------- parsing helpers
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_number(text) -> Optional[float]:
    """'1,000' -> 1000.0, '$18' -> 18.0, '-3.50' -> -3.5, '1/2' -> 0.5; None when it is not a number."""
    if text is None:
        return None
    s = str(text).strip().replace(",", "").replace("$", "").rstrip(".").strip()
    s = s.replace("\\$", "").replace("%", "")
    frac = re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)", s)
    if frac:
        den = float(frac.group(2))
        return float(frac.group(1)) / den if den else None
    try:
        return float(s)
    except ValueError:
        return None


def last_number(text: str) -> Optional[str]:
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def extract_gsm8k_prediction(completion: str) -> Optional[str]:
    """The first number after the last '####' if there is one, else the last number in the text."""
    if "####" in completion:
        found = _NUMBER.search(completion.rsplit("####", 1)[1])  # the first number after the marker
        if found is not None:
            return found.group(0)
    return last_number(completion)


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces included; None when absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: the model stopped mid-answer


def normalize_math(answer: str) -> str:
    """Canonical string form of a math answer for exact comparison."""
    s = answer.strip()
    for wrapper in ("\\text", "\\mathrm", "\\textbf", "\\mathbf"):
        s = re.sub(re.escape(wrapper) + r"\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\ ", "").replace("$", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    return s


def _math_value(s: str) -> Optional[float]:
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}", s)
    if frac:
        den = float(frac.group(3))
        value = float(frac.group(2)) / den if den else None
        return -value if (value is not None and frac.group(1)) else value
    return parse_number(s)


def math_equal(predicted: str, gold: str) -> bool:
    a, b = normalize_math(predicted), normalize_math(gold)
    if a == b:
        return True
    va, vb = _math_value(a), _math_value(b)
    return va is not None and vb is not None and math.isclose(va, vb, rel_tol=1e-6, abs_tol=1e-9)


# ------------------------------------------------------------------------------------------------ built-ins
@register_reward("gsm8k_accuracy")
def gsm8k_accuracy(completions: list[str], answers: list, **_) -> list[float]:
    """1.0 when the predicted number (after '####', else the last number) equals the answer numerically."""
    scores = []
    for completion, answer in zip(completions, answers):
        pred = parse_number(extract_gsm8k_prediction(completion))
        gold = parse_number(answer)
        scores.append(1.0 if pred is not None and gold is not None and math.isclose(pred, gold, abs_tol=1e-6)
                      else 0.0)
    return scores


@register_reward("boxed_accuracy")
def boxed_accuracy(completions: list[str], answers: list, **_) -> list[float]:
    """1.0 when the last \\boxed{} equals the answer (normalized strings, or equal numbers/fractions)."""
    scores = []
    for completion, answer in zip(completions, answers):
        boxed = last_boxed(completion)
        scores.append(1.0 if boxed is not None and math_equal(boxed, str(answer)) else 0.0)
    return scores


@register_reward("number_accuracy")
def number_accuracy(completions: list[str], answers: list, **_) -> list[float]:
    """1.0 when the final number (the last \\boxed{} if any, else the last number) equals the answer.

    Partial credit for models that answer correctly but do not yet use the requested format.
    """
    scores = []
    for completion, answer in zip(completions, answers):
        boxed = last_boxed(completion)
        pred = parse_number(boxed) if boxed is not None else parse_number(last_number(completion))
        gold = parse_number(answer)
        scores.append(1.0 if pred is not None and gold is not None and math.isclose(pred, gold, abs_tol=1e-6)
                      else 0.0)
    return scores


DEFAULT_FORMAT_PATTERN = r"<think>.*?</think>\s*.*\S.*"


@register_reward("format")
def format_reward(completions: list[str], answers: list, pattern: str = DEFAULT_FORMAT_PATTERN, **_) -> list[float]:
    """1.0 when the whole (stripped) completion matches `pattern` (re.DOTALL)."""
    regex = re.compile(pattern, re.DOTALL)
    return [1.0 if regex.fullmatch(c.strip()) else 0.0 for c in completions]


@register_reward("length_penalty")
def length_penalty(completions: list[str], answers: list, target_chars: int = 1000,
                   max_chars: Optional[int] = None, **_) -> list[float]:
    """0 up to target_chars characters, falling linearly to -1 at max_chars (default 2 x target), -1 beyond."""
    max_chars = max_chars or 2 * target_chars
    span = max(max_chars - target_chars, 1)
    return [-min(max(len(c) - target_chars, 0) / span, 1.0) for c in completions]


# ------------------------------------------------------------------------------------------------- routing
@dataclass
class RewardResult:
    total: list[float]                              # weighted sum per row
    per_function: dict[str, list[Optional[float]]]  # raw values; None where the function did not apply

    @property
    def reward_names(self) -> list[str]:
        return list(self.per_function)

    def means(self) -> dict[str, float]:
        out = {}
        for name, values in self.per_function.items():
            applied = [v for v in values if v is not None]
            if applied:
                out[name] = sum(applied) / len(applied)
        return out


class RewardRouter:
    """Applies each dataset's rewards (with their weights) to its own rows, plus extra callables to every row."""

    def __init__(self, routes: dict[str, dict[str, float]], reward_kwargs: Optional[dict] = None,
                 extra_funcs: Sequence[Callable] = ()):
        reward_kwargs = reward_kwargs or {}
        self.routes: dict[str, list[tuple[str, RewardFn, float, dict]]] = {}
        for source, rewards in routes.items():
            entries = []
            for name, weight in rewards.items():
                try:
                    fn = get_reward(name)
                except RewardError as exc:
                    raise RewardError(f"dataset '{source}': {exc}") from None
                entries.append((name, fn, float(weight), dict(reward_kwargs.get(source, {}).get(name, {}))))
            self.routes[source] = entries
        self.extra = [(getattr(fn, "__name__", f"reward_{i}"), fn) for i, fn in enumerate(extra_funcs)]

    def __call__(self, completions: list[str], answers: list, data_sources: list[str],
                 prompts: Optional[list[str]] = None, **row_fields) -> RewardResult:
        n = len(completions)
        prompts = prompts if prompts is not None else [""] * n
        total = [0.0] * n
        per_function: dict[str, list[Optional[float]]] = {}
        missing = sorted(set(data_sources) - set(self.routes))
        if missing:
            raise RewardError(f"rows from dataset(s) {', '.join(missing)} have no rewards configured "
                              f"(known: {', '.join(sorted(self.routes))})")
        for source, entries in self.routes.items():
            rows = [i for i, s in enumerate(data_sources) if s == source]
            if rows:
                for name, fn, weight, kwargs in entries:
                    self._apply(name, fn, weight, kwargs, rows, source, completions, answers, prompts,
                                data_sources, row_fields, total, per_function)
        everyone = list(range(n))
        for name, fn in self.extra:
            self._apply(name, fn, 1.0, {}, everyone, "all datasets", completions, answers, prompts,
                        data_sources, row_fields, total, per_function)
        return RewardResult(total, per_function)

    @staticmethod
    def _apply(name, fn, weight, kwargs, rows, source, completions, answers, prompts, data_sources, row_fields,
               total, per_function):
        pick = lambda values: [values[i] for i in rows]  # noqa: E731
        fields = {key: pick(values) for key, values in row_fields.items()}
        try:
            values = fn(pick(completions), pick(answers), prompts=pick(prompts), data_source=pick(data_sources),
                        **fields, **kwargs)
        except Exception as exc:
            raise RewardError(f"reward '{name}' (dataset {source}) raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(values, (list, tuple)) or len(values) != len(rows):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(f"reward '{name}' (dataset {source}) must return a list of {len(rows)} floats, "
                              f"one per completion; got {got}")
        column = per_function.setdefault(name, [None] * len(completions))
        for local, (row, value) in enumerate(zip(rows, values)):
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RewardError(f"reward '{name}' (dataset {source}) returned {value!r} for row {local} of its "
                                  f"batch (completion {row}); rewards must be finite numbers")
            column[row] = float(value)
            total[row] += weight * float(value)
