"""Reward registry, built-ins, routing and error reporting."""
import math

import pytest

from grpo.errors import RewardError
from grpo.rewards import (RewardRouter, boxed_accuracy, format_reward, get_reward, gsm8k_accuracy, last_boxed,
                          length_penalty, load_reward_module, register_reward, registered_rewards)


@pytest.mark.parametrize("completion, answer, expected", [
    ("so the total is #### 1,000", "1000", 1.0),
    ("#### 1000.0", "1,000", 1.0),
    ("She pays $18 in the end.", "18", 1.0),
    ("the change is -3.50", "-3.5", 1.0),
    ("first 5 then #### 7 and later 9", "7", 1.0),   # the number after #### wins over the last number
    ("5 apples and 9 pears", "9", 1.0),              # no ####: the last number
    ("5 apples and 9 pears", "5", 0.0),
    ("no number at all", "3", 0.0),
    ("#### 42", "43", 0.0),
])
def test_gsm8k_accuracy(completion, answer, expected):
    assert gsm8k_accuracy([completion], [answer]) == [expected]


def test_last_boxed_handles_nesting_and_takes_the_last():
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"first \boxed{1} then \boxed{{2}}") == "{2}"
    assert last_boxed("nothing boxed") is None
    assert last_boxed(r"\boxed{unclosed") is None


@pytest.mark.parametrize("completion, answer, expected", [
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1/2}", "0.5", 1.0),
    (r"\boxed{ 42 }.", "42", 1.0),
    (r"\boxed{\text{42}}", "42", 1.0),
    (r"\boxed{$\left(1,2\right)$}", "(1,2)", 1.0),
    (r"a \boxed{3} then \boxed{4}", "4", 1.0),
    (r"a \boxed{3} then \boxed{4}", "3", 0.0),
    ("42", "42", 0.0),                            # no box, no credit
])
def test_boxed_accuracy(completion, answer, expected):
    assert boxed_accuracy([completion], [answer]) == [expected]


def test_format_default_and_custom_pattern():
    good = "<think>add them</think> The answer is 4."
    assert format_reward([good, "The answer is 4.", "<think>x</think>   "], [None] * 3) == [1.0, 0.0, 0.0]
    assert format_reward(["#### 12", "12"], [None, None], pattern=r".*####\s*\d+") == [1.0, 0.0]


def test_length_penalty_by_hand():
    # target 10, max 20: 0 up to 10 chars, then -(len - 10) / 10, floor -1
    texts = ["", "x" * 10, "x" * 15, "x" * 20, "x" * 35]
    assert length_penalty(texts, [None] * 5, target_chars=10) == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert length_penalty(["x" * 16], [None], target_chars=10, max_chars=13) == [-1.0]


def test_registry_lookup_and_duplicates():
    assert {"gsm8k_accuracy", "boxed_accuracy", "format", "length_penalty"} <= set(registered_rewards())
    with pytest.raises(RewardError, match="unknown reward 'nope'.*boxed_accuracy.*--reward_module"):
        get_reward("nope")
    with pytest.raises(RewardError, match="already registered"):
        register_reward("format")(lambda completions, answers, **kw: [0.0] * len(completions))


def test_router_routes_per_dataset_with_weights():
    router = RewardRouter({"math": {"boxed_accuracy": 1.0, "format": 0.5}, "gsm": {"gsm8k_accuracy": 2.0}},
                          reward_kwargs={"math": {"format": {"pattern": r".*\\boxed\{.+\}.*"}}})
    completions = [r"\boxed{4}", "#### 7", r"\boxed{5}", "#### 8"]
    result = router(completions, ["4", "7", "4", "7"], ["math", "gsm", "math", "gsm"], prompts=["p"] * 4)
    # row 0: boxed 1 * 1 + format 1 * 0.5 = 1.5; row 1: gsm 1 * 2 = 2; row 2: 0 + 0.5; row 3: 0
    assert result.total == [1.5, 2.0, 0.5, 0.0]
    assert result.per_function["boxed_accuracy"] == [1.0, None, 0.0, None]
    assert result.per_function["gsm8k_accuracy"] == [None, 1.0, None, 0.0]
    assert result.means() == {"boxed_accuracy": 0.5, "format": 1.0, "gsm8k_accuracy": 0.5}


def test_router_extra_funcs_see_row_fields():
    seen = {}

    def longer_than_two(completions, answers, prompts, data_source, completion_ids, **kw):
        seen.update(prompts=prompts, sources=data_source)
        return [float(len(ids) > 2) for ids in completion_ids]

    router = RewardRouter({"a": {"format": 0.0}}, extra_funcs=[longer_than_two])
    result = router(["x", "y"], ["", ""], ["a", "a"], prompts=["p0", "p1"], completion_ids=[[1, 2, 3], [1]])
    assert result.total == [1.0, 0.0]
    assert seen == {"prompts": ["p0", "p1"], "sources": ["a", "a"]}
    assert result.reward_names == ["format", "longer_than_two"]


def test_router_errors_name_function_and_row():
    with pytest.raises(RewardError, match="dataset 'd'.*unknown reward 'missing'"):
        RewardRouter({"d": {"missing": 1.0}})

    def raises(completions, answers, **kw):
        raise KeyError("boom")

    def short(completions, answers, **kw):
        return [1.0]

    def nan_at_one(completions, answers, **kw):
        return [0.0, math.nan]

    for fn, pattern in [(raises, "'raises'.*raised KeyError.*boom"), (short, "'short'.*list of 2 floats.*1 values"),
                        (nan_at_one, "'nan_at_one'.*nan.*row 1")]:
        router = RewardRouter({"d": {"format": 1.0}}, extra_funcs=[fn])
        with pytest.raises(RewardError, match=pattern):
            router(["a", "b"], ["", ""], ["d", "d"])
    router = RewardRouter({"d": {"format": 1.0}})
    with pytest.raises(RewardError, match="other.*no rewards configured"):
        router(["a"], [""], ["other"])


def test_load_reward_module(tmp_path):
    good = tmp_path / "my_rewards.py"
    good.write_text("from grpo import register_reward\n\n@register_reward('always_half')\n"
                    "def always_half(completions, answers, **kw):\n    return [0.5] * len(completions)\n")
    load_reward_module(str(good))
    assert get_reward("always_half")(["a", "b"], [None, None]) == [0.5, 0.5]
    load_reward_module(str(good))  # importing the same file twice is fine
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('no config')\n")
    with pytest.raises(RewardError, match="broken.py.*RuntimeError: no config"):
        load_reward_module(str(bad))
    with pytest.raises(RewardError, match="file not found"):
        load_reward_module(str(tmp_path / "absent.py"))
