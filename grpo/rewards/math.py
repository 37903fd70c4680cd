"""Built-in math rewards: GSM8K-style final numbers and \\boxed{} answers (with the number parsing they share)."""
from __future__ import annotations

import math
import numbers
import re
from typing import Optional

from grpo.rewards.registry import register_reward


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
