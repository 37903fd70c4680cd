"""Running the model's tool calls: each call's result, or an error message, for the model to read; never an exception.

A tool that raises, runs past its time limit or returns something other than text or JSON-writable data becomes an
error message (counted as an error, or as a timeout); so does a call that could not be parsed, that names a tool not
offered to this prompt, or whose arguments do not fit the function. One message's calls share a time budget, so a
message of many slow calls holds its turn for at most that long, not for the sum of their timeouts.
"""
from __future__ import annotations

import inspect
import json
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from grpo.tools.calls import MAX_NESTING, ToolCall, nesting_depth, tool_message
from grpo.tools.errors import ToolFailure, ToolTimeout
from grpo.tools.registry import Tool, get_tool, registered_tools

MAX_RESULT_CHARS = 4000   # longer results are cut (they cost episode tokens)
MAX_CALLS_PER_TURN = 8    # calls past this in one message get an error instead of running
MESSAGE_TIME_BUDGET = 40.0  # seconds all the calls of one message may take together


@dataclass
class ToolResult:
    message: dict   # the `tool` message the model reads
    status: str     # "ok" | "error" | "timeout"


def execute_call(call: ToolCall, available: Optional[Sequence[str]] = None,
                 max_result_chars: int = MAX_RESULT_CHARS, time_left: Optional[float] = None) -> ToolResult:
    """Run one parsed call. `available`: the tools this prompt offers (None: every registered tool); `time_left`:
    seconds the call may take at most (less than the tool's own timeout when the message's budget runs low)."""
    try:
        return _execute(call, available, max_result_chars, time_left)
    except Exception as exc:  # whatever went wrong, the model reads a message and the run goes on
        return _error(f"Error: the call could not be run: {_describe(exc)}", None)


def _execute(call: ToolCall, available: Optional[Sequence[str]], max_result_chars: int,
             time_left: Optional[float]) -> ToolResult:
    if call.error is not None:
        return _error(f"Error: {call.error}", call.name)
    offered = list(available) if available is not None else registered_tools()
    if call.name not in offered:
        return _error(f"Error: there is no tool named {call.name!r}. Available: {', '.join(offered) or 'none'}",
                      call.name)
    tool = get_tool(call.name)
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as exc:
        return _error(f"Error: wrong arguments for {tool.name}: {_describe(exc)}. It takes "
                      f"{', '.join(tool.schema['function']['parameters'].get('properties', {})) or 'no arguments'}",
                      tool.name)
    timeout = tool.timeout if time_left is None else min(tool.timeout, time_left)
    try:
        value = _call_with_timeout(tool, call.arguments, timeout)
    except ToolTimeout as exc:
        return ToolResult(tool_message(_cut(f"Error: {tool.name} timed out: {_describe(exc, False)}",
                                            max_result_chars), tool.name), "timeout")
    except ToolFailure as exc:
        return _error(_cut(_describe(exc, False), max_result_chars), tool.name)
    except Exception as exc:
        return _error(_cut(f"Error: {tool.name} failed: {_describe(exc)}", max_result_chars), tool.name)
    text = _as_text(value)
    if text is None:
        return _error(f"Error: {tool.name} returned a {type(value).__name__}, which is neither text nor JSON data "
                      f"nested at most {MAX_NESTING} levels deep", tool.name)
    return ToolResult(tool_message(_cut(text, max_result_chars), tool.name), "ok")


def execute_calls(calls: Sequence[ToolCall], available: Optional[Sequence[str]] = None,
                  max_calls: int = MAX_CALLS_PER_TURN, time_budget: float = MESSAGE_TIME_BUDGET) -> list[ToolResult]:
    """The results of one message's calls, in order; calls past `max_calls` are refused, and so are calls left once
    the message's `time_budget` (seconds) is spent (each call gets at most what is left of it)."""
    deadline = time.monotonic() + time_budget
    results = []
    for call in calls[:max_calls]:
        left = deadline - time.monotonic()
        if left <= 0:
            results.append(_error(f"Error: this message's tool calls took their {time_budget:g} s in all; this one "
                                  "was not run", call.name))
        else:
            results.append(execute_call(call, available, time_left=left))
    results += [_error(f"Error: at most {max_calls} tool calls per message; this one was not run", c.name)
                for c in calls[max_calls:]]
    return results


def _call_with_timeout(tool: Tool, arguments: dict, timeout: float):
    """The tool's return value, or ToolTimeout after tool.timeout seconds. A Python function cannot be stopped from
    outside: a timed-out call goes on in a daemon thread (it never blocks the exit) while the episode moves on; tools
    that may block should bound their own waits (as the python tool does: it kills its process)."""
    box: dict = {}

    def run():
        try:
            box["value"] = tool.fn(**arguments)
        except BaseException as exc:  # reported to the model, whatever it is
            box["error"] = exc

    worker = threading.Thread(target=run, name=f"grpo-tool-{tool.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise ToolTimeout(f"no result after {timeout:.3g} s")
    if "error" in box:
        error = box["error"]
        if isinstance(error, Exception):
            raise error
        raise ToolFailure(f"Error: {tool.name} stopped: {_describe(error)}")
    return box.get("value")


def _as_text(value) -> Optional[str]:
    """The value as text: a string as it is, other values as JSON (None when JSON cannot write it, or it nests past
    MAX_NESTING: the writer recurses, and a reader of the result would too)."""
    if type(value) is str:
        return value
    if isinstance(value, str):
        return str.__str__(value)  # a subclass's own methods are not run
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    return text if nesting_depth(text) <= MAX_NESTING else None


def _describe(exc: BaseException, with_type: bool = True) -> str:
    """An exception as text, even one whose __str__ fails or is enormous."""
    try:
        text = str(exc)
    except Exception:
        text = "(its message could not be written)"
    text = text[:MAX_RESULT_CHARS]
    return f"{type(exc).__name__}: {text}" if with_type else text


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + f"\n[result truncated to {max_chars} characters]"


def _error(text: str, name: Optional[str]) -> ToolResult:
    return ToolResult(tool_message(text, name), "error")
