"""Tools: the calculator (worked by hand), the python sandbox's limits, tool-call parsing, the executor's error
messages and counts, the registry, user tool modules, and the chat template's side."""
import os
import sys
import textwrap
import time

import pytest

from grpo.tools import (SandboxLimits, ToolCall, ToolError, check_environment, check_tools, evaluate, execute_call,
                        execute_calls, get_tool, parse_tool_calls, register_tool, registered_tools, run_python,
                        template_shows_tools, text_outside_calls, tool_environment, tool_schemas, tools_system_prompt)
from grpo.tools.calculator import calculator
from grpo.tools import sandbox
from grpo.tools.sandbox import sandbox_problem


# ------------------------------------------------------------------------------ calculator
@pytest.mark.parametrize("expression, value", [
    ("(12 + 7) * 3", "57"),        # 19 * 3
    ("7 / 2", "3.5"),
    ("6 / 2", "3"),                # a whole float without ".0"
    ("17 // 5", "3"),
    ("-17 % 5", "3"),              # -17 = 5 * (-4) + 3
    ("2 ** 10", "1024"),
    ("-2 ** 2", "-4"),             # the power binds tighter than unary minus
    ("2 ** -2", "0.25"),
    ("0.1 + 0.2", "0.3"),          # 12 significant digits
    ("+5 - -3", "8"),
    ("((1.5))*4", "6"),
    ("1e3 + 1", "1001"),
    ("2 ** 0.5", "1.41421356237"),
    (" 123456789 * 987654321 ", "121932631112635269"),
])
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("x + 1", "names are not allowed"),
    ("abs(-3)", "function calls are not allowed"),
    ("__import__('os').system('ls')", "function calls are not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("'a' * 3", "only numbers are allowed"),
    ("True + 1", "only numbers are allowed"),
    ("2 ^ 3", r"write 2 \*\* 3"),
    ("1 < 2", "Compare is not allowed"),
    ("[1, 2]", "List is not allowed"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "no real value"),
    ("10 ** 400", "too large"),
    ("9 ** 9 ** 9", "too large"),
    ("2 ** 100000", "too large"),
    ("1.5 ** 5000", "too large"),
    ("1e308 * 10", "not a finite number"),
    ("(1 + 2", "not an arithmetic expression"),
    ("1" * 501, "at most 500"),
])
def test_calculator_refuses(expression, message):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        evaluate(expression)
    assert time.perf_counter() - start < 0.5  # refused before any large computation


# ------------------------------------------------------------------------------ parsing tool calls
def test_parse_one_and_several_calls():
    text = ('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "parameters": {"expression": "1"}}</tool_call> Done.')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "6 * 7"}, None), ("python", {"code": "print(1)"}, None),
        ("calculator", {"expression": "1"}, None)]
    assert text_outside_calls(text) == "Let me compute.  Done."
    assert parse_tool_calls("The answer is 42.") == []


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{'name': 'calculator'}</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name"'),
    ('<tool_call>["calculator"]</tool_call>', 'needs a "name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be an object, got list"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "without its closing"),
])
def test_malformed_calls_become_parse_errors(text, message):
    [call] = parse_tool_calls(text)
    assert message in call.error
    result = execute_call(call)
    assert result.status == "error" and result.message["content"].startswith("Error: ")
    assert message in result.message["content"]


def test_a_good_call_after_a_malformed_one_still_runs():
    calls = parse_tool_calls('<tool_call>{oops}</tool_call><tool_call>{"name": "calculator", "arguments": '
                             '{"expression": "2 + 2"}}</tool_call>')
    results = execute_calls(calls, available=["calculator"])
    assert [r.status for r in results] == ["error", "ok"] and results[1].message["content"] == "4"


# ------------------------------------------------------------------------------ executing calls
@register_tool("test_raises")
def _raises(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken on {x}")


@register_tool("test_sleeps", timeout=0.3)
def _sleeps(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


@register_tool("test_returns")
def _returns(kind: str):
    """Returns a value of some kind.

    Args:
        kind: Which value.
    """
    return {"dict": {"a": [1, 2.5]}, "object": object(), "nan": float("nan"), "long": "x" * 5000,
            "none": None}[kind]


def call(name, **arguments):
    return execute_call(ToolCall(name, arguments))


def test_tool_results_and_errors():
    assert call("calculator", expression="6 * 7").message == {"role": "tool", "name": "calculator", "content": "42"}
    assert call("test_returns", kind="dict").message["content"] == '{"a": [1, 2.5]}'
    assert call("test_returns", kind="none").message["content"] == "null"
    failed = call("test_raises", x=3)
    assert failed.status == "error"
    assert failed.message["content"] == "Error: test_raises failed: RuntimeError: broken on 3"
    calc = call("calculator", expression="1 / 0")
    assert (calc.status, calc.message["content"]) == ("error", "Error: calculator failed: ValueError: division by zero")
    for kind in ("object", "nan"):
        junk = call("test_returns", kind=kind)
        assert junk.status == "error" and "neither text nor JSON" in junk.message["content"]
    long = call("test_returns", kind="long")
    assert long.status == "ok" and long.message["content"].endswith("[result truncated to 4000 characters]")
    assert len(long.message["content"]) < 4100
    wrong = call("calculator", expr="1")
    assert wrong.status == "error" and "wrong arguments for calculator" in wrong.message["content"]
    assert "It takes expression" in wrong.message["content"]


def test_a_hanging_tool_times_out():
    start = time.perf_counter()
    result = call("test_sleeps", seconds=5)
    assert time.perf_counter() - start < 2
    assert result.status == "timeout" and "timed out" in result.message["content"]
    assert call("test_sleeps", seconds=0).message["content"] == "awake"


def test_unknown_and_unoffered_tools_are_messages_at_run_time():
    unknown = execute_call(ToolCall("search_web", {"q": "x"}))
    assert unknown.status == "error" and "there is no tool named 'search_web'" in unknown.message["content"]
    offered = execute_call(ToolCall("python", {"code": "print(1)"}), available=["calculator"])
    assert offered.message["content"] == "Error: there is no tool named 'python'. Available: calculator"


def test_calls_per_message_are_bounded():
    calls = [ToolCall("calculator", {"expression": "1"})] * 3
    results = execute_calls(calls, max_calls=2)
    assert [r.status for r in results] == ["ok", "ok", "error"]
    assert "at most 2 tool calls per message" in results[2].message["content"]


def test_the_tools_environment_counts_calls_errors_and_timeouts():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 21"}}</tool_call>'
            '<tool_call>{"name": "test_sleeps", "arguments": {"seconds": 3}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "x"}}</tool_call><tool_call>nope')
    step = tool_environment([{"role": "assistant", "content": text}], tools=["calculator", "test_sleeps"])
    assert not step.done and (step.tool_calls, step.tool_errors, step.tool_timeouts) == (4, 2, 1)
    assert step.messages[0] == {"role": "tool", "name": "calculator", "content": "42"}
    assert tool_environment([{"role": "assistant", "content": "It is 42."}], tools=["calculator"]).done


# ------------------------------------------------------------------------------ the python sandbox
# the limits in both modes: a sandbox (where one can be made here) and unsandboxed code, allowed explicitly
# (tests/test_sandbox_hostile.py holds the sandbox against hostile code)
MODES = (["sandbox"] if sandbox_problem(sys.executable) is None else []) + ["unsandboxed"]


@pytest.fixture(params=MODES)
def limits(request, monkeypatch):
    if request.param == "unsandboxed":
        monkeypatch.setattr(sandbox, "sandbox_problem", lambda python: "no sandbox (test)")
        monkeypatch.setattr(sandbox, "_allow_unsandboxed", True)
    return SandboxLimits(timeout=2.0, memory_bytes=256 * 2**20, max_output_chars=100)


def test_sandbox_runs_code_in_a_fresh_folder(limits):
    result = run_python("import os\nprint(6 * 7)\nprint(os.getcwd())\nopen('out.txt', 'w').write('x')", limits)
    assert result.returncode == 0 and not result.timed_out, result.stderr
    printed, folder = result.stdout.splitlines()
    assert printed == "42" and (folder == "/tmp" or "grpo-python-tool-" in folder)
    assert folder == "/tmp" or not os.path.exists(folder)  # removed afterwards


def test_sandbox_stops_code_that_sleeps(limits):
    start = time.perf_counter()
    result = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", limits)
    assert result.timed_out and time.perf_counter() - start < 10
    assert result.stdout == "started\n"


def test_sandbox_refuses_too_much_memory(limits):
    result = run_python("block = bytearray(512 * 2**20)\nprint('allocated')", limits)
    assert result.returncode == 1 and "allocated" not in result.stdout
    assert result.stderr.rstrip().endswith("MemoryError")


def test_sandbox_truncates_output(limits):
    result = run_python("print('a' * 5000)\nimport sys\nsys.stderr.write('e' * 3000 + 'END')", limits)
    assert result.stdout == "a" * 100 + "\n[output truncated: 5001 bytes in all, the first 100 characters shown]"
    assert result.stderr.startswith("[output truncated: 3003 bytes in all, the last 100 characters shown]\n")
    assert result.stderr.endswith("END") and len(result.stderr) < 200


def test_without_a_sandbox_the_python_tool_refuses_to_start_unless_allowed(monkeypatch):
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda python: "bubblewrap is not installed (test)")
    monkeypatch.setattr(sandbox, "_allow_unsandboxed", False)
    with pytest.raises(ToolError, match="bubblewrap is not installed.*pass --allow_unsandboxed_code"):
        check_tools(["calculator", "python"])
    refused = call("python", code="print(1)")  # a call made anyway is an error message, not a run
    assert refused.status == "error" and "--allow_unsandboxed_code" in refused.message["content"]
    sandbox.allow_unsandboxed_code(True)
    assert [t.name for t in check_tools(["python"])] == ["python"]
    assert call("python", code="print(1)").message["content"] == "1\n"


def test_a_sandbox_that_fails_is_explained_in_bwraps_own_words(monkeypatch):
    """The way to allow namespaces is given only where bwrap says they were refused; any other failure in its own
    words (a missing interpreter is no matter of Docker flags)."""
    missing = sandbox.failure_message("/x/bwrap", "bwrap: execvp /tmp/venv/bin/python: No such file or directory\n", 1)
    assert missing == ("bubblewrap (/x/bwrap) could not make a sandbox here: bwrap: execvp /tmp/venv/bin/python: "
                       "No such file or directory")
    python_failed = sandbox.failure_message("/x/bwrap", "Fatal Python error: init_fs_encoding\n", 1)
    assert python_failed.startswith("the interpreter failed in the sandbox") and "CAP_SYS_ADMIN" not in python_failed
    refused = "bwrap: Creating new namespace failed: Operation not permitted\n"
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    assert "bwrap: Creating new namespace failed" in sandbox.failure_message("/x/bwrap", refused, 1)
    assert "CAP_SYS_ADMIN" in sandbox.failure_message("/x/bwrap", refused, 1)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    assert "unprivileged user namespaces" in sandbox.failure_message("/x/bwrap", refused, 1)


def test_the_interpreter_folders_never_show_the_host_root_or_its_tmp(monkeypatch):
    monkeypatch.setattr(sandbox.subprocess, "run", lambda *a, **k: type("P", (), dict(
        returncode=0, stdout='["/opt/venv", "/", "/usr", "/usr/local"]', stderr=""))())
    assert sandbox.interpreter_folders.__wrapped__("/opt/python3") == ("/opt", "/opt/venv")
    monkeypatch.setattr(sandbox.subprocess, "run", lambda *a, **k: type("P", (), dict(
        returncode=0, stdout='["/tmp", "/usr"]', stderr=""))())
    with pytest.raises(ToolError, match="lives in /tmp, which holds the sandbox's private /tmp"):
        sandbox.interpreter_folders.__wrapped__("/tmp/bin/python")


@pytest.mark.parametrize("required", [False, True])
def test_the_hostile_sandbox_tests_fail_where_required_and_no_sandbox_can_be_made(required):
    """CI sets GRPO_REQUIRE_SANDBOX=1: a machine without a sandbox fails the hostile tests there (with the reason);
    elsewhere they skip, with the reason printed."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys, pytest, grpo.tools.sandbox as s\n"
            "s.sandbox_problem = lambda python: 'bubblewrap is not installed (test)'\n"
            "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', 'tests/test_sandbox_hostile.py']))")
    env = dict(os.environ, GRPO_REQUIRE_SANDBOX="1" if required else "0")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    summary = run.stdout.strip().splitlines()[-1]
    if required:
        assert run.returncode == 1 and "error" in summary and "passed" not in summary, run.stdout[-2000:]
        assert "no sandbox here, and GRPO_REQUIRE_SANDBOX is set: bubblewrap is not installed (test)" in run.stdout
    else:
        assert run.returncode == 0 and "skipped" in summary and "failed" not in summary, run.stdout[-2000:]
        assert "SKIPPED" in run.stdout and "no sandbox here: bubblewrap is not installed (test)" in run.stdout


def test_python_tool_messages():
    ok = call("python", code="print(sum(range(10)))")
    assert (ok.status, ok.message["content"]) == ("ok", "45\n")
    failed = call("python", code="print('before')\n1 / 0")
    assert failed.status == "error" and failed.message["content"].startswith("Error: the code exited with status 1.")
    assert "before" in failed.message["content"] and "ZeroDivisionError" in failed.message["content"]
    assert call("python", code="x = 1").message["content"].startswith("(the code printed nothing")


# ------------------------------------------------------------------------------ registry and user modules
def test_schema_from_signature_and_docstring():
    @register_tool("test_convert")
    def convert(value: float, unit: str = "km") -> str:
        """Convert a distance.

        Args:
            value: The distance.
            unit: The unit to convert to.
        """
        return f"{value} {unit}"

    assert get_tool("test_convert").schema == {"type": "function", "function": {
        "name": "test_convert", "description": "Convert a distance.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number", "description": "The distance."},
            "unit": {"type": "string", "description": "The unit to convert to."}}, "required": ["value"]}}}
    assert tool_schemas(["test_convert"]) == [get_tool("test_convert").schema]
    register_tool("test_convert")(convert)  # the same function again (a module imported twice) is fine


def test_registration_errors():
    def undocumented(x: int) -> str:
        return str(x)

    with pytest.raises(ToolError, match="cannot be described to the model.*'Args:' section"):
        register_tool("test_undocumented")(undocumented)
    with pytest.raises(ToolError, match="already registered by grpo.tools.calculator.calculator"):
        register_tool("calculator")(_raises)
    with pytest.raises(ToolError, match=r"with the name in parentheses"):
        register_tool(_raises)
    with pytest.raises(ToolError, match="letters, digits"):
        register_tool("my tool")


def test_check_tools_names_every_unknown_tool():
    assert [t.name for t in check_tools(["calculator", "python"])] == ["calculator", "python"]
    with pytest.raises(ToolError, match=r"unknown tools 'search', 'browse' \(no --tool_module given\)\. "
                                        r"Registered: calculator, python"):
        check_tools(["calculator", "search", "browse"])
    with pytest.raises(ToolError, match="--tool_module: file not found: missing_tools.py"):
        check_tools(["calculator"], "missing_tools.py")
    with pytest.raises(ToolError, match="unknown environment 'maze'"):
        check_environment("maze")
    assert check_environment(None) is tool_environment


def test_a_user_tool_module(tmp_path):
    module = tmp_path / "my_tools.py"
    module.write_text(textwrap.dedent('''
        from grpo import register_tool
        from grpo.tools import register_environment


        @register_tool("test_unit_price")
        def unit_price(total: float, count: int) -> float:
            """The price of one item.

            Args:
                total: The price of all items.
                count: How many items.
            """
            return total / count


        @register_environment("test_shop")
        def shop(messages, **fields):
            return [], True
    '''))
    [tool] = check_tools(["test_unit_price"], str(module))
    assert call("test_unit_price", total=10, count=4).message["content"] == "2.5"
    assert check_environment("test_shop", str(module))([], answer="x") == ([], True)
    check_tools(["test_unit_price"], str(module))  # loading the file again re-registers the same functions
    assert "test_unit_price" in registered_tools()
    with pytest.raises(ToolError, match=r"unknown tool 'tool_b' \(after importing .*my_tools.py\)"):
        check_tools(["tool_b"], str(module))
    broken = tmp_path / "broken_tools.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ToolError, match="importing .*broken_tools.py failed: ModuleNotFoundError"):
        check_tools(["calculator"], str(broken))


# ------------------------------------------------------------------------------ the chat template's side
def test_templates_that_show_tools_and_the_fallback_prompt():
    from .test_episodes import make_tool_tokenizer
    from .tiny_models import make_tiny_tokenizer

    schemas = tool_schemas(["calculator"])
    assert template_shows_tools(make_tool_tokenizer(), schemas)
    assert not template_shows_tools(make_tiny_tokenizer(), schemas)  # plain ChatML ignores tools=
    prompt = tools_system_prompt(schemas)
    assert '"name": "calculator"' in prompt and "<tool_call>" in prompt and "</tools>" in prompt
