"""Running the model's tool calls: each call's result, or an error message, for the model to read; never an exception.

A tool that raises, runs past its time limit or returns something other than text or JSON-writable data becomes an
error message (counted as an error, or as a timeout); so does a call that could not be parsed, that names a tool not
offered to this prompt, or whose arguments do not fit the function.
"""
from __future__ import annotations

import inspect
import json
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

from grpo.tools.calls import ToolCall, tool_message
from grpo.tools.errors import ToolFailure, ToolTimeout
from grpo.tools.registry import Tool, get_tool, registered_tools

MAX_RESULT_CHARS = 4000   # longer results are cut (they cost episode tokens)
MAX_CALLS_PER_TURN = 8    # calls past this in one message get an error instead of running


@dataclass
class ToolResult:
    message: dict   # the `tool` message the model reads
    status: str     # "ok" | "error" | "timeout"


def execute_call(call: ToolCall, available: Optional[Sequence[str]] = None,
                 max_result_chars: int = MAX_RESULT_CHARS) -> ToolResult:
    """Run one parsed call. `available`: the tools this prompt offers (None: every registered tool)."""
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
        return _error(f"Error: wrong arguments for {tool.name}: {exc}. It takes "
                      f"{', '.join(tool.schema['function']['parameters'].get('properties', {})) or 'no arguments'}",
                      tool.name)
    try:
        value = _call_with_timeout(tool, call.arguments)
    except ToolTimeout as exc:
        return ToolResult(tool_message(_cut(f"Error: {tool.name} timed out: {exc}", max_result_chars), tool.name),
                          "timeout")
    except ToolFailure as exc:
        return _error(_cut(str(exc), max_result_chars), tool.name)
    except Exception as exc:
        return _error(_cut(f"Error: {tool.name} failed: {type(exc).__name__}: {exc}", max_result_chars), tool.name)
    text = _as_text(value)
    if text is None:
        return _error(f"Error: {tool.name} returned a {type(value).__name__}, which is neither text nor JSON data",
                      tool.name)
    return ToolResult(tool_message(_cut(text, max_result_chars), tool.name), "ok")


def execute_calls(calls: Sequence[ToolCall], available: Optional[Sequence[str]] = None,
                  max_calls: int = MAX_CALLS_PER_TURN) -> list[ToolResult]:
    """The results of one message's calls, in order; calls past `max_calls` are refused."""
    results = [execute_call(c, available) for c in calls[:max_calls]]
    results += [_error(f"Error: at most {max_calls} tool calls per message; this one was not run", c.name)
                for c in calls[max_calls:]]
    return results


def _call_with_timeout(tool: Tool, arguments: dict):
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
    worker.join(tool.timeout)
    if worker.is_alive():
        raise ToolTimeout(f"no result after {tool.timeout:g} s")
    if "error" in box:
        error = box["error"]
        if isinstance(error, Exception):
            raise error
        raise ToolFailure(f"Error: {tool.name} stopped: {type(error).__name__}: {error}")
    return box.get("value")


def _as_text(value) -> Optional[str]:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return None


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + f"\n[result truncated to {max_chars} characters]"


def _error(text: str, name: Optional[str]) -> ToolResult:
    return ToolResult(tool_message(text, name), "error")
