"""Built-in rewards for image questions: VQA exact match, multiple-choice letters, and box IoU.

Each looks for the answer in the completion's last <answer>...</answer> block, else its last \\boxed{...}, else the
whole completion. Ground truths are strings (the registry's answer column): one answer, several accepted answers
("red|crimson" or a JSON list '["red", "crimson"]'), a letter, or a box "[x1, y1, x2, y2]".
"""
from __future__ import annotations

import json
import re
import string
from typing import Optional

from grpo.errors import RewardError
from grpo.rewards.math import last_boxed
from grpo.rewards.registry import register_reward

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(["zero", "one", "two", "three", "four", "five", "six", "seven",
                                                   "eight", "nine", "ten"])}
_NUM = r"[-+]?\d+(?:\.\d+)?"
_BOX = re.compile(rf"[\[(]\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*[\])]")


def answer_span(completion: str) -> str:
    """The part of a completion that holds its answer: <answer> block, else \\boxed{}, else all of it."""
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1]
    boxed = last_boxed(completion)
    return boxed if boxed is not None else completion


def normalize_text(text: str) -> str:
    """VQA normalization: lower case, no punctuation, no articles, number words as digits, single spaces."""
    s = str(text).lower()
    s = "".join(" " if ch in string.punctuation else ch for ch in s)
    s = _ARTICLES.sub(" ", s)
    return " ".join(_NUMBER_WORDS.get(word, word) for word in s.split())


def accepted_answers(answer) -> list[str]:
    """One or several accepted answers: a list, a JSON list string, or a string with '|' between answers."""
    if isinstance(answer, (list, tuple)):
        return [str(a) for a in answer]
    text = str(answer).strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
            if isinstance(values, list) and not any(isinstance(v, (list, dict)) for v in values):
                return [str(v) for v in values]
        except json.JSONDecodeError:
            pass
    return [part for part in text.split("|")]


@register_reward("vqa_accuracy")
def vqa_accuracy(completions: list[str], answers: list, **_) -> list[float]:
    """1.0 when the normalized answer span equals a normalized accepted answer, else 0.0."""
    scores = []
    for completion, answer in zip(completions, answers):
        predicted = normalize_text(answer_span(completion))
        scores.append(1.0 if predicted and predicted in {normalize_text(a) for a in accepted_answers(answer)}
                      else 0.0)
    return scores


def parse_choice(completion: str, choices: str = "ABCD") -> Optional[str]:
    """The chosen letter: the answer span's letter when it is one ('B', '(B)', 'B.', 'B) blue'), else the last
    standalone choice letter in the completion ('... the answer is C'); None when there is none."""
    letters = "".join(sorted(set(choices.upper())))
    span = answer_span(completion).strip()
    lead = re.match(rf"^\(?([{letters}])(?:[).:]|\s|$)", span)
    if lead:
        return lead.group(1)
    found = re.findall(rf"(?<![A-Za-z])([{letters}])(?![A-Za-z])", span)
    return found[-1] if found else None


@register_reward("choice_accuracy")
def choice_accuracy(completions: list[str], answers: list, choices: str = "ABCD", **_) -> list[float]:
    """1.0 when the chosen letter (see parse_choice) is the answer's letter ('B' or '(B)'), else 0.0."""
    scores = []
    for completion, answer in zip(completions, answers):
        gold = parse_choice(str(answer), choices)
        if gold is None:
            raise RewardError(f"choice_accuracy: the answer {answer!r} is not one of the letters {choices}")
        scores.append(1.0 if parse_choice(completion, choices) == gold else 0.0)
    return scores


def parse_box(text: str) -> Optional[tuple[float, float, float, float]]:
    """The last [x1, y1, x2, y2] (or (x1, y1, x2, y2)) of four numbers in the answer span; None when absent."""
    found = _BOX.findall(answer_span(str(text)))
    return tuple(float(v) for v in found[-1]) if found else None


def box_iou(a, b) -> float:
    """Intersection over union of two [x1, y1, x2, y2] boxes; 0 when either is empty (x2 <= x1 or y2 <= y1).

    IoU = |a n b| / (|a| + |b| - |a n b|)
    """
    area_a = max(a[2] - a[0], 0.0) * max(a[3] - a[1], 0.0)
    area_b = max(b[2] - b[0], 0.0) * max(b[3] - b[1], 0.0)
    if area_a <= 0 or area_b <= 0:
        return 0.0
    inter = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0) * max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)
    return inter / (area_a + area_b - inter)


@register_reward("iou")
def iou_reward(completions: list[str], answers: list, threshold: Optional[float] = None, **_) -> list[float]:
    """IoU of the completion's box with the answer box; with `threshold`, 1.0 when IoU >= threshold else 0.0."""
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise RewardError(f"iou: \"threshold\" must be in (0, 1], got {threshold!r}; fix it in the dataset's "
                          f"\"reward_kwargs\"")
    scores = []
    for completion, answer in zip(completions, answers):
        gold = parse_box(str(answer))
        if gold is None:
            raise RewardError(f"iou: the answer {str(answer)[:60]!r} is not a box [x1, y1, x2, y2]")
        predicted = parse_box(completion)
        value = box_iou(predicted, gold) if predicted is not None else 0.0
        scores.append(value if threshold is None else float(value >= threshold))
    return scores
