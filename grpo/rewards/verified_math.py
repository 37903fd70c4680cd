"""math_verify_accuracy: answers compared symbolically by HF's `math-verify` package (as TRL and open-r1 use it).

    pip install math-verify          # or: pip install .[math]   (tested: math-verify 0.9.0)
The gold answer is parsed as written (a number or LaTeX; a plain expression is read as inline LaTeX); the
completion's answer is its last \\boxed{} / LaTeX answer, and the two are compared with `verify` (numbers,
fractions, expressions, sets), each step bounded by a timeout. The gsm8k / boxed / number rewards do not need the
package.
"""
from __future__ import annotations

import importlib.util
import threading

from grpo.errors import RewardError
from grpo.rewards.registry import register_reward

INSTALL_HINT = "pip install math-verify (or pip install .[math]; tested with math-verify 0.9.0)"


def _check_installed() -> None:
    if importlib.util.find_spec("math_verify") is None:
        raise RewardError(f"reward 'math_verify_accuracy' needs the math-verify package: {INSTALL_HINT}")


@register_reward("math_verify_accuracy")
def math_verify_accuracy(completions: list[str], answers: list, timeout_seconds: int = 5, **_) -> list[float]:
    """1.0 when math-verify finds the completion's final (boxed / LaTeX) answer equal to the gold answer, else 0.0
    (also when the gold answer cannot be parsed, or a step times out)."""
    _check_installed()
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.parser import NormalizationConfig

    # math-verify's timeouts use SIGALRM, which only the main thread may set
    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    answer_config = [LatexExtractionConfig(
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                 boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]
    golds: dict = {}  # the k samples of a prompt share its answer: parse it once

    def parse_gold(answer):
        gold = parse(str(answer), extraction_mode="first_match", parsing_timeout=timeout)
        if not gold:  # a plain expression such as "(x+1)^2" parses as inline LaTeX
            gold = parse(f"${answer}$", extraction_mode="first_match", parsing_timeout=timeout)
        return gold

    scores = []
    for completion, answer in zip(completions, answers):
        if str(answer) not in golds:
            golds[str(answer)] = parse_gold(answer)
        gold = golds[str(answer)]
        if not gold:
            scores.append(0.0)
            continue
        predicted = parse(completion, extraction_config=answer_config, extraction_mode="first_match",
                          parsing_timeout=timeout)
        scores.append(1.0 if predicted and verify(gold, predicted, timeout_seconds=timeout) else 0.0)
    return scores


math_verify_accuracy.check_ready = _check_installed  # the router calls it when a dataset names this reward
