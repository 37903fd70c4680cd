"""Reward registry, built-ins, routing and error reporting."""
import math

import pytest

from grpo.errors import RewardError
from grpo.rewards import (RewardRouter, boxed_accuracy, format_reward, get_reward, gsm8k_accuracy, last_boxed,
                          length_penalty, load_reward_module, normalize_math, number_accuracy, parse_number,
                          register_reward, registered_rewards)


@pytest.mark.parametrize("completion, answer, expected", [
    ("so the total is #### 1,000", "1000", 1.0),
    ("#### 1000.0", "1,000", 1.0),
    ("#### 1000", 1000, 1.0),                        # gold given as a number
    ("She pays $18 in the end.", "18", 1.0),
    ("She pays $18 in the end.", "$18", 1.0),
    ("the change is -3.50", "-3.5", 1.0),
    ("the change is -$3.50", "-3.5", 1.0),
    ("first 5 then #### 7 and later 9", "7", 1.0),   # the number after #### wins over the last number
    ("5 apples and 9 pears", "9", 1.0),              # no ####: the last number
    ("5 apples and 9 pears", "5", 0.0),
    ("10-4=6", "6", 1.0),
    ("she walked 10-4 blocks", "4", 1.0),            # a '-' after a digit is subtraction, not a sign
    ("she walked 10-4 blocks", "-4", 0.0),
    ("the values are 1,2,3", "3", 1.0),              # commas that are not thousands groups separate numbers
    ("no number at all", "3", 0.0),
    ("#### 42", "43", 0.0),
    ("#### 72", "48 / 2 = 24 clips in May.\n48 + 24 = 72\n#### 72", 1.0),  # gold as a full GSM8K solution
])
def test_gsm8k_accuracy(completion, answer, expected):
    assert gsm8k_accuracy([completion], [answer]) == [expected]


@pytest.mark.parametrize("text, value", [
    ("1,000", 1000.0), ("$18", 18.0), ("-3.50", -3.5), ("12.", 12.0), ("50%", 50.0), ("1/2", 0.5),
    ("-3/4", -0.75), ("1,2", None), ("abc", None), ("", None), (None, None), (7, 7.0), (math.inf, None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_last_boxed_handles_nesting_and_takes_the_last():
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"first \boxed{1} then \boxed{{2}}") == "{2}"
    assert last_boxed(r"\fbox{7} and \boxed {\sqrt{2}}") == r"\sqrt{2}"
    assert last_boxed("nothing boxed") is None
    assert last_boxed(r"\boxed{unclosed") is None


def test_normalize_math():
    assert normalize_math(r" $\text{\mathrm{ 12 }}$. ") == "12"         # nested wrappers, '$', '.', spaces
    assert normalize_math(r"\left( \dfrac{1}{2}, 3 \right)") == r"(\frac{1}{2},3)"
    assert normalize_math(r"x \leftarrow y") == r"x\leftarrowy"          # \left of \leftarrow is kept


@pytest.mark.parametrize("completion, answer, expected", [
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
    (r"\boxed{1/2}", "0.5", 1.0),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
    (r"\boxed{ 42 }.", "42", 1.0),
    (r"\boxed{42.}", "42", 1.0),
    (r"\boxed{\text{42}}", "42", 1.0),
    (r"\boxed{\mathrm{east}}", "east", 1.0),
    (r"\boxed{$\left(1,2\right)$}", "(1,2)", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1,2}", "12", 0.0),                   # a pair, not twelve
    (r"a \boxed{3} then \boxed{4}", "4", 1.0),
    (r"a \boxed{3} then \boxed{4}", "3", 0.0),
    ("42", "42", 0.0),                            # no box, no credit
])
def test_boxed_accuracy(completion, answer, expected):
    assert boxed_accuracy([completion], [answer]) == [expected]


def test_number_accuracy_takes_the_box_else_the_last_number():
    assert number_accuracy([r"\boxed{\frac{1}{2}}", "so 3 and then 7", r"\boxed{8} not 7"], ["0.5", "7", "7"]) \
        == [1.0, 1.0, 0.0]


def test_format_default_and_custom_pattern():
    good = "<think>add them</think> The answer is 4."
    assert format_reward([good, "  " + good + "\n", "The answer is 4.", "<think>x</think>   "], [None] * 4) \
        == [1.0, 1.0, 0.0, 0.0]
    assert format_reward(["<think>a\nb</think>\n4"], [None]) == [1.0]  # DOTALL: the think block spans lines
    assert format_reward(["#### 12", "12"], [None, None], pattern=r".*####\s*\d+") == [1.0, 0.0]
    assert format_reward(["x #### 12"], [None], pattern=r"####\s*\d+") == [0.0]  # fullmatch, not search
    with pytest.raises(RewardError, match="invalid \"pattern\".*reward_kwargs"):
        format_reward(["x"], [None], pattern="(")


def test_length_penalty_by_hand():
    # target 10, max 20: 0 up to 10 chars, then -(len - 10) / (20 - 10), floor -1
    #   len 0 -> 0; 10 -> 0; 15 -> -5/10 = -0.5; 20 -> -10/10 = -1; 35 -> -25/10 clipped to -1
    texts = ["", "x" * 10, "x" * 15, "x" * 20, "x" * 35]
    assert length_penalty(texts, [None] * 5, target_chars=10) == [0.0, 0.0, -0.5, -1.0, -1.0]
    # target 10, max 14: len 13 -> -3/4 = -0.75
    assert length_penalty(["x" * 13], [None], target_chars=10, max_chars=14) == [-0.75]
    # defaults: target 1000, max 2000: len 1500 -> -500/1000 = -0.5
    assert length_penalty(["x" * 1000, "x" * 1500], [None, None]) == [0.0, -0.5]
    with pytest.raises(RewardError, match="target_chars < max_chars"):
        length_penalty(["x"], [None], target_chars=10, max_chars=10)


def test_registry_lookup_and_duplicates():
    assert {"gsm8k_accuracy", "boxed_accuracy", "format", "length_penalty"} <= set(registered_rewards())
    assert registered_rewards() == sorted(registered_rewards())
    assert get_reward("format") is format_reward
    with pytest.raises(RewardError, match="unknown reward 'nope'.*boxed_accuracy.*gsm8k_accuracy.*"
                                          "@register_reward\\(\"nope\"\\).*--reward_module"):
        get_reward("nope")
    with pytest.raises(RewardError, match="already registered"):
        register_reward("format")(lambda completions, answers, **kw: [0.0] * len(completions))
    with pytest.raises(RewardError, match="parentheses"):
        register_reward(format_reward)


def test_registering_the_same_function_again_replaces_it():
    def shout(completions, answers, **kw):
        return [1.0] * len(completions)

    register_reward("test_shout")(shout)
    register_reward("test_shout")(shout)  # e.g. a notebook cell run twice
    assert get_reward("test_shout") is shout


def record_calls(log):
    """A reward that records the arguments of every call and pays 0.25 per row."""
    def recorder(completions, answers, prompts, data_source, **kw):
        log.append({"completions": completions, "answers": answers, "prompts": prompts, "data_source": data_source,
                    **kw})
        return [0.25] * len(completions)
    return recorder


def test_router_routes_per_dataset_with_weights():
    router = RewardRouter({"math": {"boxed_accuracy": 1.0, "format": 0.5}, "gsm": {"gsm8k_accuracy": 2.0}},
                          reward_kwargs={"math": {"format": {"pattern": r".*\\boxed\{.+\}.*"}}})
    completions = [r"\boxed{4}", "#### 7", r"\boxed{5}", "#### 8"]
    result = router(completions, ["4", "7", "4", "7"], ["math", "gsm", "math", "gsm"], prompts=["p"] * 4)
    # row 0: boxed 1 * 1.0 + format 1 * 0.5 = 1.5
    # row 1: gsm8k 1 * 2.0                  = 2.0
    # row 2: boxed 0 * 1.0 + format 1 * 0.5 = 0.5
    # row 3: gsm8k 0 * 2.0                  = 0.0
    assert result.total == [1.5, 2.0, 0.5, 0.0]
    assert result.per_function == {"boxed_accuracy": [1.0, None, 0.0, None], "format": [1.0, None, 1.0, None],
                                   "gsm8k_accuracy": [None, 1.0, None, 0.0]}
    # means over applied rows only: boxed (1 + 0) / 2, format (1 + 1) / 2, gsm8k (1 + 0) / 2
    assert result.means() == {"boxed_accuracy": 0.5, "format": 1.0, "gsm8k_accuracy": 0.5}
    assert result.reward_names == ["boxed_accuracy", "format", "gsm8k_accuracy"]


def test_router_calls_each_function_once_per_source_with_its_slice():
    log = []
    register_reward("test_recorder")(record_calls(log))
    router = RewardRouter({"a": {"test_recorder": 2.0}, "b": {"test_recorder": -1.0}},
                          reward_kwargs={"b": {"test_recorder": {"scale": 3}}})
    result = router(["c0", "c1", "c2"], ["x0", "x1", "x2"], ["b", "a", "b"], ["p0", "p1", "p2"],
                    completion_ids=[[0], [1], [2]])
    assert log == [{"completions": ["c1"], "answers": ["x1"], "prompts": ["p1"], "data_source": ["a"],
                    "completion_ids": [[1]]},
                   {"completions": ["c0", "c2"], "answers": ["x0", "x2"], "prompts": ["p0", "p2"],
                    "data_source": ["b", "b"], "completion_ids": [[0], [2]], "scale": 3}]
    # 0.25 per row, weight 2 on 'a' (row 1) and -1 on 'b' (rows 0, 2)
    assert result.total == [-0.25, 0.5, -0.25]
    assert result.per_function == {"test_recorder": [0.25, 0.25, 0.25]}


def test_router_extra_funcs_see_row_fields():
    seen = {}

    def longer_than_two(completions, answers, prompts, data_source, completion_ids, **kw):
        seen.update(prompts=prompts, sources=data_source)
        return [float(len(ids) > 2) for ids in completion_ids]

    router = RewardRouter({"a": {"format": 0.0}, "b": {"length_penalty": 1.0}}, extra_funcs=[longer_than_two])
    result = router(["x", "y", "z"], ["", "", ""], ["a", "a", "b"], prompts=["p0", "p1", "p2"],
                    completion_ids=[[1, 2, 3], [1], [4, 5, 6, 7]])
    # format weighs 0 and 'z' is far below 1000 chars, so the totals are the extra function's 1.0 / 0.0 / 1.0
    assert result.total == [1.0, 0.0, 1.0]
    assert seen == {"prompts": ["p0", "p1", "p2"], "sources": ["a", "a", "b"]}
    assert result.reward_names == ["format", "length_penalty", "longer_than_two"]
    assert result.means() == {"format": 0.0, "length_penalty": 0.0, "longer_than_two": 2 / 3}


def test_router_construction_errors():
    with pytest.raises(RewardError, match="dataset 'd'.*unknown reward 'missing'.*boxed_accuracy"):
        RewardRouter({"d": {"missing": 1.0}})
    with pytest.raises(RewardError, match="dataset 'd'.*weight of 'format'.*nan"):
        RewardRouter({"d": {"format": math.nan}})
    with pytest.raises(RewardError, match="dataset 'd'.*reward_kwargs given for length_penalty"):
        RewardRouter({"d": {"format": 1.0}}, reward_kwargs={"d": {"length_penalty": {"target_chars": 5}}})
    with pytest.raises(RewardError, match="dataset 'd'.*may not set prompts"):
        RewardRouter({"d": {"format": 1.0}}, reward_kwargs={"d": {"format": {"prompts": []}}})
    with pytest.raises(RewardError, match="dataset\\(s\\) other"):
        RewardRouter({"d": {"format": 1.0}}, reward_kwargs={"other": {}})

    def format(completions, answers, **kw):  # noqa: A001 - the clash is the point
        return [0.0] * len(completions)
    with pytest.raises(RewardError, match="two reward functions are named 'format'"):
        RewardRouter({"d": {"format": 1.0}}, extra_funcs=[format])
    with pytest.raises(RewardError, match="callables"):
        RewardRouter({"d": {"format": 1.0}}, extra_funcs=["format"])


def test_router_errors_name_function_source_and_row():
    def raises(completions, answers, **kw):
        raise KeyError("boom")

    def short(completions, answers, **kw):
        return [1.0]

    def array_like(completions, answers, **kw):
        return {"scores": [1.0, 1.0]}

    def nan_at_one(completions, answers, **kw):
        return [0.0, math.nan]

    def inf_at_zero(completions, answers, **kw):
        return [math.inf, 0.0]

    def text_at_one(completions, answers, **kw):
        return [0.0, "1.0"]

    for fn, pattern in [(raises, "'raises'.*all datasets.*raised KeyError: 'boom'"),
                        (short, "'short'.*list of 2 floats.*got 1 values"),
                        (array_like, "'array_like'.*list of 2 floats.*got a dict"),
                        (nan_at_one, "'nan_at_one'.*returned nan for row 1.*'b'"),
                        (inf_at_zero, "'inf_at_zero'.*returned inf for row 0.*'a'"),
                        (text_at_one, "'text_at_one'.*returned '1.0' for row 1")]:
        router = RewardRouter({"d": {"format": 1.0}}, extra_funcs=[fn])
        with pytest.raises(RewardError, match=pattern) as caught:
            router(["a", "b"], ["", ""], ["d", "d"])
        if fn is raises:
            assert isinstance(caught.value.__cause__, KeyError)  # chained: the original traceback survives

    register_reward("test_nan_reward")(lambda completions, answers, **kw: [math.nan] * len(completions))
    router = RewardRouter({"d": {"format": 1.0}, "e": {"test_nan_reward": 1.0}})
    with pytest.raises(RewardError, match="'test_nan_reward' \\(dataset 'e'\\).*row 0 of its batch \\(completion 2"):
        router(["a", "b", "c"], ["", "", ""], ["d", "d", "e"])
    with pytest.raises(RewardError, match="row 1 comes from dataset 'other'.*no rewards configured.*d, e"):
        router(["a", "b"], ["", ""], ["d", "other"])
    with pytest.raises(RewardError, match="'answers' has 1 entries for 2 completions"):
        router(["a", "b"], [""], ["d", "d"])


def test_load_reward_module(tmp_path):
    good = tmp_path / "my_rewards.py"
    good.write_text("from grpo import register_reward\n\n@register_reward('always_half')\n"
                    "def always_half(completions, answers, **kw):\n    return [0.5] * len(completions)\n")
    load_reward_module(str(good))
    assert get_reward("always_half")(["a", "b"], [None, None]) == [0.5, 0.5]
    assert RewardRouter({"d": {"always_half": 2.0}})(["a"], [None], ["d"]).total == [1.0]
    load_reward_module(str(good))  # importing the same file twice is fine

    # a different file with the same base name may not take the name over
    (tmp_path / "other").mkdir()
    twin = tmp_path / "other" / "my_rewards.py"
    twin.write_text(good.read_text().replace("0.5", "0.7"))
    with pytest.raises(RewardError, match="other.my_rewards.py.*already registered"):
        load_reward_module(str(twin))

    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('no config')\n")
    with pytest.raises(RewardError, match="broken.py.*RuntimeError: no config") as caught:
        load_reward_module(str(bad))
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(RewardError, match="file not found.*absent.py"):
        load_reward_module(str(tmp_path / "absent.py"))
    notes = tmp_path / "rewards.txt"
    notes.write_text("not python")
    with pytest.raises(RewardError, match="rewards.txt.*\\.py"):
        load_reward_module(str(notes))


# ------------------------------------------------------------------------- overlong shaping, math-verify
def test_overlong_penalty_three_regions_by_hand():
    from grpo.rewards import overlong_penalty

    # max_length 10, buffer 4: no penalty up to 10 - 4 = 6 tokens; inside (6, 10] (6 - L) / 4 * factor; beyond: -factor
    lengths = [3, 6, 7, 8, 10, 11, 40]
    ids = [[5] * n for n in lengths]
    got = overlong_penalty([""] * len(ids), [None] * len(ids), completion_ids=ids, max_length=10, buffer_length=4)
    # L=7: (6-7)/4 = -0.25; L=8: -2/4 = -0.5; L=10: -4/4 = -1.0; L=11, 40: -1
    assert got == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    # penalty_factor 2 doubles it: L=8 -> -1.0, beyond -> -2
    assert overlong_penalty(["", ""], [None, None], completion_ids=[[1] * 8, [1] * 12], max_length=10,
                            buffer_length=4, penalty_factor=2.0) == [-1.0, -2.0]
    with pytest.raises(RewardError, match="max_length"):
        overlong_penalty([""], [None], completion_ids=[[1]])
    with pytest.raises(RewardError, match="buffer_length <= max_length"):
        overlong_penalty([""], [None], completion_ids=[[1]], max_length=4, buffer_length=5)
    # through the router, configured per dataset
    router = RewardRouter({"d": {"overlong_penalty": 0.5}},
                          {"d": {"overlong_penalty": {"max_length": 10, "buffer_length": 4}}})
    assert router(["a", "b"], ["", ""], ["d", "d"], completion_ids=[[1] * 8, [1] * 2]).total == [-0.25, 0.0]


def test_math_verify_accuracy():
    pytest.importorskip("math_verify")
    from grpo.rewards import math_verify_accuracy

    completions = ["so the answer is \\boxed{12}", "\\boxed{\\frac{1}{2}}", "we get \\boxed{0.5}", "\\boxed{13}",
                   "the answer is 12 (no box)", "\\boxed{x^2 + 2x + 1}"]
    answers = ["12", "0.5", "\\frac{1}{2}", "12", "12", "(x+1)^2"]
    assert math_verify_accuracy(completions, answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    # routed like any reward
    router = RewardRouter({"m": {"math_verify_accuracy": 1.0}})
    assert router(["\\boxed{3/4}"], ["0.75"], ["m"]).total == [1.0]


def test_math_verify_missing_package_is_a_clear_error(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "math_verify" else real_find_spec(name, *a))
    # at construction, naming the dataset and how to install it
    with pytest.raises(RewardError, match="dataset 'm': reward 'math_verify_accuracy' needs the math-verify "
                                          "package: pip install math-verify"):
        RewardRouter({"m": {"math_verify_accuracy": 1.0}})
    # the gsm8k / boxed rewards do not need it
    RewardRouter({"g": {"gsm8k_accuracy": 1.0, "boxed_accuracy": 1.0}})


# ------------------------------------------------------------------------------------------ reward models
def test_reward_model_is_registered_by_folder_and_scores_in_batches(tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from grpo.rewards.reward_model import register_reward_models

    from .tiny_models import make_tiny_reward_model_dir

    path = make_tiny_reward_model_dir(str(tmp_path / "tiny_rm"))
    (rm,) = register_reward_models([path], torch.device("cpu"))
    rm.batch_size = 2  # three rows: two batches, the second padded differently
    assert "tiny_rm" in registered_rewards() and get_reward("tiny_rm") is rm
    completions = ["4", "The answer is 7", "boxed { 9 }"]
    messages = [[{"role": "user", "content": "What is 2 + 2 ?"}]] * 3
    router = RewardRouter({"toy": {"tiny_rm": 2.0}})
    result = router(completions, ["4"] * 3, ["toy"] * 3, prompts=["x"] * 3, prompt_messages=messages)
    # the same numbers one row at a time, with the model's own chat template
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    expected = []
    for c in completions:
        text = tok.apply_chat_template(messages[0] + [{"role": "assistant", "content": c}], tokenize=False)
        with torch.no_grad():
            expected.append(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item())
    assert result.per_function["tiny_rm"] == pytest.approx(expected, abs=1e-5)
    assert result.total == pytest.approx([2 * e for e in expected], abs=1e-5)
    assert len(set(round(e, 4) for e in expected)) == 3  # a random head tells the completions apart


def test_reward_model_without_classification_head_is_refused(tmp_path):
    import torch

    from grpo.errors import ConfigError
    from grpo.rewards.reward_model import register_reward_models

    from .tiny_models import make_tiny_model_dir

    path = make_tiny_model_dir(str(tmp_path / "causal_lm"))
    with pytest.raises(ConfigError, match="--reward_model .*causal_lm: not a sequence-classification model "
                                          r"\(architectures: LlamaForCausalLM\)"):
        register_reward_models([path], torch.device("cpu"))
    with pytest.raises(ConfigError, match="not a model folder"):
        register_reward_models([str(tmp_path / "missing")], torch.device("cpu"))


def _episode(*turns):
    """A conversation: the prompt, then the model's turns, each followed by what the tools environment answers."""
    from grpo.tools import tool_environment

    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    for text in turns:
        messages.append({"role": "assistant", "content": text})
        messages += tool_environment(messages, tools=["calculator"]).messages
    return messages


def test_tool_call_reward_pays_a_call_that_ran():
    from grpo.rewards import tool_call_reward

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    episodes = [
        _episode(call, "\\boxed{42}"),                                             # ran, then answered
        _episode("\\boxed{42}"),                                                   # no call
        _episode('<tool_call>{"name": "calculator", "arguments": {"expression": "6 *"}</tool_call>'),  # bad JSON
        _episode('<tool_call>{"name": "search", "arguments": {"q": "6 * 7"}}</tool_call>'),  # a tool not offered
        _episode('<tool_call>{"name": "calculator", "arguments": {"x": "6 * 7"}}</tool_call>'),  # wrong arguments
        _episode('<tool_call>{"name": "calculator", "arguments": {"expression": "6 ^ 7"}}</tool_call>', call),
    ]
    assert episodes[0][2] == {"role": "tool", "content": "42", "name": "calculator"}  # the result the model read
    assert all(m["content"].startswith("Error:") for e in episodes[2:5] for m in e if m["role"] == "tool")
    assert tool_call_reward(["\\boxed{42}"] * 6, ["42"] * 6, messages=episodes) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    # partial credit for calls written that all failed (bad JSON, a tool not offered, wrong arguments), none for none
    assert tool_call_reward(["\\boxed{42}"] * 6, ["42"] * 6, messages=episodes, attempt=0.5) == \
        [1.0, 0.0, 0.5, 0.5, 0.5, 1.0]
    # a negative `attempt` is a penalty for calls that all failed, below writing none
    assert tool_call_reward(["\\boxed{42}"] * 6, ["42"] * 6, messages=episodes, attempt=-0.5) == \
        [1.0, 0.0, -0.5, -0.5, -0.5, 1.0]


def test_tool_reward_options_reweigh_and_penalise_the_tool_datasets_only():
    from grpo.rewards.tool_use import tool_reward_overrides

    routes = {"calc": {"boxed_accuracy": 1.0, "tool_call": 0.2}, "plain": {"boxed_accuracy": 1.0},
              "products": {"boxed_accuracy": 1.0}}
    kwargs = {"calc": {"tool_call": {"attempt": 0.5}}}
    new_routes, new_kwargs = tool_reward_overrides(routes, kwargs, ["calc", "products"], weight=0.6, penalty=0.25)
    assert new_routes == {"calc": {"boxed_accuracy": 1.0, "tool_call": 0.6}, "plain": {"boxed_accuracy": 1.0},
                          "products": {"boxed_accuracy": 1.0, "tool_call": 0.6}}  # added where it had none
    assert new_kwargs == {"calc": {"tool_call": {"attempt": -0.25}}, "products": {"tool_call": {"attempt": -0.25}}}
    assert routes["calc"]["tool_call"] == 0.2 and kwargs["calc"]["tool_call"]["attempt"] == 0.5  # registry untouched
    # through the router: a call that ran scores 1 x 0.6 on top of the answer, calls that all failed -0.25 x 0.6
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    failed = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 *"}</tool_call>'
    result = RewardRouter(new_routes, new_kwargs)(
        ["\\boxed{42}"] * 3, ["42"] * 3, ["calc"] * 3,
        messages=[_episode(call, "\\boxed{42}"), _episode(failed, "\\boxed{42}"), _episode("\\boxed{42}")])
    assert result.total == pytest.approx([1.6, 1.0 - 0.15, 1.0])
    # only what is given changes; nothing given is no change
    assert tool_reward_overrides(routes, kwargs, ["calc"]) == (routes, kwargs)
    assert tool_reward_overrides(routes, kwargs, ["calc"], penalty=1.0)[0]["calc"]["tool_call"] == 0.2
    with pytest.raises(RewardError, match="none of the named datasets"):
        tool_reward_overrides(routes, kwargs, [], weight=0.5)
    with pytest.raises(RewardError, match="dataset 'products' has no tool_call reward"):
        tool_reward_overrides(routes, kwargs, ["products"], penalty=0.5)


def test_tool_reward_options_reach_a_runs_reward_router():
    from grpo.config import GRPOConfig
    from grpo.train.setup import load_rewards

    config = GRPOConfig(dataset_names=["arith_products", "arith"], eval_dataset_names=["arith_products_eval"],
                        tool_call_reward=0.7, tool_failure_penalty=0.1)
    router = load_rewards(config)
    for source in ("arith_products", "arith_products_eval"):  # the shipped entries with the calculator
        tool_call = next(r for r in router.routes[source] if r.name == "tool_call")
        assert (tool_call.weight, tool_call.kwargs["attempt"]) == (0.7, -0.1)
    assert "tool_call" not in [r.name for r in router.routes["arith"]]  # no tools, no change


def test_tool_reward_options_are_checked_at_construction():
    from grpo.config import GRPOConfig
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError, match="tool_failure_penalty.*>= 0.*0.5 scores a failed call -0.5"):
        GRPOConfig(tool_failure_penalty=-0.5)
    with pytest.raises(ConfigError, match="tool_call_reward.*>= 0"):
        GRPOConfig(tool_call_reward=float("nan"))


def test_tool_call_reward_through_the_router_and_its_errors():
    from grpo.rewards import tool_call_reward

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    router = RewardRouter({"calc": {"boxed_accuracy": 1.0, "tool_call": 0.2}})
    result = router(["\\boxed{42}", "\\boxed{42}"], ["42", "42"], ["calc", "calc"],
                    messages=[_episode(call, "\\boxed{42}"), _episode("\\boxed{42}")])
    assert result.total == pytest.approx([1.2, 1.0])
    assert result.per_function["tool_call"] == [1.0, 0.0]
    with pytest.raises(RewardError, match="messages"):
        tool_call_reward(["\\boxed{42}"], ["42"])
    with pytest.raises(RewardError, match="2 conversations for 1 completions"):
        tool_call_reward(["\\boxed{42}"], ["42"], messages=[[], []])
