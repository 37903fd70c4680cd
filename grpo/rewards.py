"""Reward registry, built-in verifiable rewards, and routing of rewards per dataset.

A reward is a batched function `fn(completions: list[str], answers: list, **row_fields) -> list[float]`.
row_fields always hold `prompts` and `data_source` (lists, one entry per completion), whatever else the caller
passes per row (the trainer adds `completion_ids`), and the extra keyword arguments configured for that reward
in the dataset registry. Built-ins accept **kwargs and ignore what they do not use.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

from .errors import RewardError

RewardFn = Callable[..., list]
_REGISTRY: dict[str, RewardFn] = {}


# ---------------------------------------------------------------------------------------------- registry
def register_reward(name: str):
    """Decorator: make the function usable by `name` in dataset_config.json's "rewards".

    Registering the same function again (same module and qualified name, e.g. a file imported twice or a
    notebook cell run again) replaces it; a different function under a taken name is an error.
    """
    if not isinstance(name, str) or not name.strip():
        hint = " (write @register_reward(\"name\"), with the name in parentheses)" if callable(name) else ""
        raise RewardError(f"register_reward needs a non-empty reward name, got {name!r}{hint}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise RewardError(f"@register_reward(\"{name}\") must decorate a function, got {type(fn).__name__}")
        existing = _REGISTRY.get(name)
        if existing is not None and _qualname(existing) != _qualname(fn):
            raise RewardError(f"reward name '{name}' is already registered by {_qualname(existing)}; "
                              f"pick another name for {_qualname(fn)}")
        _REGISTRY[name] = fn
        return fn
    return decorator


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def registered_rewards() -> list[str]:
    """Names usable in dataset_config.json's "rewards", sorted."""
    return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFn:
    """The function registered as `name`; RewardError listing the known names when there is none."""
    if name not in _REGISTRY:
        raise RewardError(f"unknown reward '{name}'. Registered: {', '.join(registered_rewards())}. Add one with "
                          f"@register_reward(\"{name}\") in a Python file passed with --reward_module")
    return _REGISTRY[name]


def load_reward_module(path: str) -> None:
    """Import a user's Python file by path so that its @register_reward decorators run."""
    if not os.path.isfile(path):
        raise RewardError(f"--reward_module: file not found: {path}")
    absolute = os.path.abspath(path)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    # The same file always gets the same module name (so importing it twice re-registers the same functions),
    # while two files that share a base name in different folders stay distinct (and clash if names collide).
    module_name = f"grpo_user_rewards_{stem}_{hashlib.sha1(absolute.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, absolute)
    if spec is None or spec.loader is None:
        raise RewardError(f"--reward_module: {path} is not an importable Python file (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up while it executes
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(module_name, None)
        raise RewardError(f"--reward_module: importing {path} failed: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------- number parsing
# A number as written in text: thousands groups only in threes (so "1,2,3" is three numbers, "1,000" one),
# optional decimals, optional "$". A "-" counts as a sign only when no word character precedes it, so the
# "4" of "10-4" is positive (subtraction, or a range), while "is -3.5" is negative.
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUMBER = re.compile(rf"(?:(?<![\w.])-)?\$?(?:{_UNSIGNED})")
_SIGNED_FULL = re.compile(rf"([+-]?)({_UNSIGNED})")
_FRACTION_FULL = re.compile(rf"([+-]?(?:{_UNSIGNED}))\s*/\s*([+-]?(?:{_UNSIGNED}))")


def parse_number(text) -> Optional[float]:
    """'1,000' -> 1000.0, '$18' -> 18.0, '-3.50' -> -3.5, '50%' -> 50.0, '1/2' -> 0.5; None if not a number."""
    if text is None or isinstance(text, bool):
        return None
    if isinstance(text, numbers.Real):
        return float(text) if math.isfinite(text) else None
    s = str(text).replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").strip()
    s = s.rstrip(".").strip()  # a sentence's full stop: "18." -> "18"
    fraction = _FRACTION_FULL.fullmatch(s)
    if fraction:
        numerator, denominator = parse_number(fraction.group(1)), parse_number(fraction.group(2))
        return numerator / denominator if denominator else None
    match = _SIGNED_FULL.fullmatch(s)
    if match is None:
        return None
    value = float(match.group(2).replace(",", ""))
    return -value if match.group(1) == "-" else value


def last_number(text: str) -> Optional[str]:
    """The last number written in `text` (as written, e.g. '$1,000'), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1] if matches else None


def extract_gsm8k_prediction(completion: str) -> Optional[str]:
    """The first number after the last '####' if there is one, else the last number in the text."""
    if "####" in completion:
        found = _NUMBER.search(completion.rsplit("####", 1)[1])
        if found is not None:
            return found.group(0)
    return last_number(completion)


def numbers_equal(a: Optional[float], b: Optional[float]) -> bool:
    """Both parsed and equal up to float round-off (0.1 + 0.2 == 0.3)."""
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


# ------------------------------------------------------------------------------------------- boxed math
_BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])")  # not the "\left" of "\leftarrow"
_FRAC = re.compile(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces included; None when absent."""
    opens = list(_BOXED_OPEN.finditer(text))
    if not opens:
        return None
    start = opens[-1].end()
    depth = 1
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start:j]
    return None  # unbalanced: the model stopped mid-answer


def normalize_math(answer: str) -> str:
    """Canonical string form of a math answer: no spaces, '$', trailing '.', \\text{} wrappers, \\left/\\right."""
    s = answer.replace("\\$", "").replace("$", "")
    previous = None
    while previous != s:  # innermost wrappers first, until none is left: \text{\mathrm{m}} -> m
        previous, s = s, _WRAPPERS.sub(r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT.sub("", s)
    for spacing in ("\\!", "\\,", "\\;", "\\:", "\\ "):
        s = s.replace(spacing, "")
    return re.sub(r"\s+", "", s).rstrip(".")


def _math_value(normalized: str) -> Optional[float]:
    """The number a normalized answer denotes: plain or '$'/comma numbers, 'a/b', or \\frac{a}{b}."""
    frac = _FRAC.fullmatch(normalized)
    if frac:
        numerator, denominator = parse_number(frac.group(2)), parse_number(frac.group(3))
        if numerator is None or not denominator:
            return None
        return -numerator / denominator if frac.group(1) == "-" else numerator / denominator
    return parse_number(normalized)


def math_equal(predicted: str, gold: str) -> bool:
    """Equal normalized strings, or equal numbers (\\frac{1}{2} == 1/2 == 0.5)."""
    a, b = normalize_math(predicted), normalize_math(gold)
    return a == b or numbers_equal(_math_value(a), _math_value(b))


# ---------------------------------------------------------------------------------------------- built-ins
@register_reward("gsm8k_accuracy")
def gsm8k_accuracy(completions: list[str], answers: list, **_) -> list[float]:
    """1.0 when the predicted number (after the last '####', else the last number) equals the answer."""
    scores = []
    for completion, answer in zip(completions, answers):
        gold = parse_number(answer)
        if gold is None and isinstance(answer, str):  # a full GSM8K solution ending in '#### 72'
            gold = parse_number(extract_gsm8k_prediction(answer))
        predicted = parse_number(extract_gsm8k_prediction(completion))
        scores.append(1.0 if numbers_equal(predicted, gold) else 0.0)
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
        predicted = _math_value(normalize_math(boxed)) if boxed is not None else \
            parse_number(last_number(completion))
        scores.append(1.0 if numbers_equal(predicted, parse_number(answer)) else 0.0)
    return scores


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


# ---------------------------------------------------------------------------------------------- routing
@dataclass
class RewardResult:
    """Rewards of one batch: the weighted total per row and each function's raw values."""
    total: list[float]                              # weighted sum per row
    per_function: dict[str, list[Optional[float]]]  # raw, unweighted; None where the function did not apply

    @property
    def reward_names(self) -> list[str]:
        """Every function the router knows, in route order, then extra functions."""
        return list(self.per_function)

    def means(self) -> dict[str, float]:
        """Mean raw value of each function over the rows it applied to (functions that applied to none: absent)."""
        out = {}
        for name, values in self.per_function.items():
            applied = [v for v in values if v is not None]
            if applied:
                out[name] = sum(applied) / len(applied)
        return out


class _Route(NamedTuple):
    name: str
    fn: RewardFn
    weight: float
    kwargs: dict


_ROW_ARGS = ("completions", "answers", "prompts", "data_source")  # passed by the router, never configurable


class RewardRouter:
    """Applies each dataset's rewards (with their weights) to its own rows, plus extra callables to every row.

    routes: {data_source: {reward_name: weight}}; reward_kwargs: {data_source: {reward_name: {kwarg: value}}};
    extra_funcs: callables applied to every row with weight 1.0, named by their __name__.
    """

    def __init__(self, routes: dict[str, dict[str, float]],
                 reward_kwargs: Optional[dict[str, dict[str, dict]]] = None, extra_funcs: Sequence[Callable] = ()):
        reward_kwargs = reward_kwargs or {}
        stray = sorted(set(reward_kwargs) - set(routes))
        if stray:
            raise RewardError(f"reward_kwargs name dataset(s) {', '.join(stray)} that have no rewards configured")
        self.routes: dict[str, list[_Route]] = {
            source: self._resolve(source, weights, reward_kwargs.get(source) or {})
            for source, weights in routes.items()}
        self.extra: list[_Route] = []
        taken = {route.name for entries in self.routes.values() for route in entries}
        for fn in extra_funcs:
            if not callable(fn):
                raise RewardError(f"extra reward functions must be callables, got {type(fn).__name__}")
            name = getattr(fn, "__name__", None) or type(fn).__name__
            if name in taken:
                raise RewardError(f"two reward functions are named '{name}' (its values would be logged under "
                                  f"one key); give the extra function another __name__")
            taken.add(name)
            self.extra.append(_Route(name, fn, 1.0, {}))

    @staticmethod
    def _resolve(source: str, weights, kwargs_by_reward) -> list[_Route]:
        """Look every name up now, so a typo fails before any model loads."""
        if not isinstance(weights, Mapping):
            raise RewardError(f"dataset '{source}': rewards must map reward names to weights, "
                              f"got {type(weights).__name__}")
        stray = sorted(set(kwargs_by_reward) - set(weights))
        if stray:
            raise RewardError(f"dataset '{source}': reward_kwargs given for {', '.join(stray)}, which is not among "
                              f"its rewards ({', '.join(weights)}); add it to \"rewards\" or drop its kwargs")
        entries = []
        for name, weight in weights.items():
            try:
                fn = get_reward(name)
            except RewardError as exc:
                raise RewardError(f"dataset '{source}': {exc}") from None
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise RewardError(f"dataset '{source}': the weight of '{name}' must be a finite number, "
                                  f"got {weight!r}")
            kwargs = dict(kwargs_by_reward.get(name) or {})
            reserved = sorted(set(kwargs) & set(_ROW_ARGS))
            if reserved:
                raise RewardError(f"dataset '{source}': reward_kwargs of '{name}' may not set {', '.join(reserved)}"
                                  f" (the router passes those per row)")
            entries.append(_Route(name, fn, float(weight), kwargs))
        return entries

    def __call__(self, completions: list[str], answers: list, data_sources: list[str],
                 prompts: Optional[list[str]] = None, **row_fields) -> RewardResult:
        """Score a batch: each function runs once per dataset on that dataset's rows (batched)."""
        n = len(completions)
        prompts = prompts if prompts is not None else [""] * n
        for field, values in {"answers": answers, "data_sources": data_sources, "prompts": prompts,
                              **row_fields}.items():
            if len(values) != n:
                raise RewardError(f"reward inputs: '{field}' has {len(values)} entries for {n} completions")
        unrouted = [i for i, source in enumerate(data_sources) if source not in self.routes]
        if unrouted:
            first = unrouted[0]
            raise RewardError(f"row {first} comes from dataset '{data_sources[first]}', which has no rewards "
                              f"configured (datasets with rewards: {', '.join(sorted(self.routes))})")
        total = [0.0] * n
        per_function: dict[str, list[Optional[float]]] = {}
        for route in [r for entries in self.routes.values() for r in entries] + self.extra:
            per_function.setdefault(route.name, [None] * n)
        columns = {"completions": completions, "answers": answers, "prompts": prompts, "data_source": data_sources,
                   **row_fields}
        for source, entries in self.routes.items():
            rows = [i for i, s in enumerate(data_sources) if s == source]
            if not rows:
                continue  # this dataset has no rows in the batch
            for route in entries:
                self._apply(route, source, rows, columns, total, per_function)
        if n:
            for route in self.extra:
                self._apply(route, "all datasets", list(range(n)), columns, total, per_function)
        return RewardResult(total, per_function)

    @staticmethod
    def _apply(route: _Route, source: str, rows: list[int], columns: dict, total: list[float],
               per_function: dict) -> None:
        """Call one function on `rows`, check what it returned, add weight * value to the totals."""
        picked = {key: [values[i] for i in rows] for key, values in columns.items()}
        clash = sorted(set(route.kwargs) & set(picked))
        if clash:
            raise RewardError(f"reward '{route.name}' (dataset '{source}'): its reward_kwargs {', '.join(clash)} "
                              f"clash with per-row fields of the same name; rename them")
        completions, answers = picked.pop("completions"), picked.pop("answers")
        try:
            values = route.fn(completions, answers, **picked, **route.kwargs)
        except Exception as exc:
            raise RewardError(f"reward '{route.name}' (dataset '{source}') raised {type(exc).__name__}: {exc} "
                              f"while scoring a batch of {len(rows)} rows") from exc
        if not isinstance(values, (list, tuple)) or len(values) != len(rows):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise RewardError(f"reward '{route.name}' (dataset '{source}') must return a list of {len(rows)} "
                              f"floats, one per completion; got {got}")
        column = per_function[route.name]
        for local, (row, value) in enumerate(zip(rows, values)):
            if not isinstance(value, numbers.Real) or not math.isfinite(value):  # bools count as 0 / 1
                raise RewardError(f"reward '{route.name}' (dataset '{source}') returned {value!r} for row {local} "
                                  f"of its batch (completion {row}: {str(completions[local])[:60]!r}); rewards "
                                  f"must be finite numbers")
            column[row] = float(value)
            total[row] += route.weight * float(value)
