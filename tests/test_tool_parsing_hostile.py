"""What a model writes (or a tool returns) never stops a run: deep nesting, huge calls, unclosed tags by the
thousand, values JSON cannot write, exceptions that cannot be printed, and a message of slow calls; each ends as a
`tool` message the model reads. (The parse's cost as the count of tags grows is measured by
benchmarks/tool_calls.py --parse_cost, not timed here.)"""
import time

from grpo.tools import ToolCall, execute_call, execute_calls, parse_tool_calls, register_tool, tool_environment
from grpo.tools.calls import MAX_CALL_CHARS, MAX_NESTING, nesting_depth, text_outside_calls


def call_text(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def test_a_call_nested_a_thousand_levels_is_an_error_message():
    deep = "[" * 1000 + "]" * 1000
    text = call_text('{"name": "calculator", "arguments": {"expression": ' + deep + "}}")
    step = tool_environment([{"role": "assistant", "content": text}], tools=["calculator"])
    assert (step.tool_calls, step.tool_errors) == (1, 1)
    assert f"more than {MAX_NESTING} levels" in step.messages[0]["content"]


def test_arguments_written_as_a_deeply_nested_json_string_are_an_error_message():
    inner = '{"expression": ' + "[" * 5000 + "]" * 5000 + "}"
    text = call_text('{"name": "calculator", "arguments": ' + __import__("json").dumps(inner) + "}")
    [parsed] = parse_tool_calls(text)
    assert parsed.error and "levels deep" in parsed.error


def test_nesting_is_counted_outside_strings_only():
    assert nesting_depth('{"a": [1, {"b": "[[[{{{"}], "c": "\\\\\\"]"}') == 3  # worked by hand: { [ {
    assert nesting_depth('"[[[') == 0  # a string left open runs to the end


def test_a_huge_call_is_refused_unread():
    text = call_text('{"name": "calculator", "arguments": {"expression": "' + "1+" * MAX_CALL_CHARS + '1"}}')
    [parsed] = parse_tool_calls(text)
    assert parsed.name is None and f"at most {MAX_CALL_CHARS}" in parsed.error
    assert len(parsed.raw) == MAX_CALL_CHARS


def test_thousands_of_unclosed_tags_are_one_parse_error():
    text = "<tool_call>" * 8192
    calls = parse_tool_calls(text)
    assert len(calls) == 1 and calls[0].error.startswith("a <tool_call> without its closing")
    assert text_outside_calls(text) == text


def test_closed_calls_before_an_unclosed_tag_are_read():
    text = (call_text('{"name": "calculator", "arguments": {"expression": "1+1"}}') + " then "
            + call_text('{"name": "calculator", "arguments": {"expression": "2+2"}}') + "<tool_call>{" * 100)
    calls = parse_tool_calls(text)
    assert [c.arguments.get("expression") for c in calls] == ["1+1", "2+2", None]
    assert calls[2].error and text_outside_calls(text) == "then " + "<tool_call>{" * 100


def test_a_tool_returning_a_deeply_nested_value_is_an_error_message():
    @register_tool("test_deep_value")
    def deep_value(levels: int) -> list:
        """Return a list nested `levels` deep.

        Args:
            levels: How deep.
        """
        value: list = []
        for _ in range(levels):
            value = [value]
        return value

    for levels in (MAX_NESTING + 1, 100_000):  # the second is past what json.dumps can recurse into
        result = execute_call(ToolCall("test_deep_value", {"levels": levels}))
        assert result.status == "error" and "neither text nor JSON data" in result.message["content"]
    assert execute_call(ToolCall("test_deep_value", {"levels": 2})).message["content"] == "[[[]]]"


def test_an_exception_that_cannot_be_printed_is_still_a_message():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no")

    @register_tool("test_unprintable")
    def unprintable() -> str:
        """Raise an exception whose message cannot be written."""
        raise Unprintable()

    result = execute_call(ToolCall("test_unprintable", {}))
    assert result.status == "error"
    assert result.message["content"] == "Error: test_unprintable failed: Unprintable: (its message could not be written)"


def test_a_message_of_slow_calls_shares_one_time_budget():
    @register_tool("test_half_second", timeout=30)
    def half_second() -> str:
        """Sleep half a second."""
        time.sleep(0.5)
        return "done"

    calls = [ToolCall("test_half_second", {})] * 8
    start = time.perf_counter()
    results = execute_calls(calls, time_budget=1.25)
    elapsed = time.perf_counter() - start
    assert [r.status for r in results] == ["ok", "ok", "timeout"] + ["error"] * 5
    assert all("took their 1.25 s in all" in r.message["content"] for r in results[3:])
    assert elapsed < 2.0  # 1.25 s of budget, not 8 x 0.5 s
