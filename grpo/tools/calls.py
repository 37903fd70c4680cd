"""Tool calls in the model's text, and tool results as chat messages.

The convention is Qwen's and Hermes' (also what Qwen2.5/Qwen3 chat templates render for `tool_calls`): each call is a
JSON object between tags, several per message allowed,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "6 * 7"}}
    </tool_call>

"arguments" may also be a JSON string holding the object, or be called "parameters" (Llama 3.1's key). A call that
cannot be read becomes a ToolCall with `error` set (the model gets that message back), never an exception.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: Optional[str]                            # None when the call could not be read
    arguments: dict = field(default_factory=dict)
    error: Optional[str] = None                    # why the call could not be read (a parse error)
    raw: str = ""                                  # the text between the tags


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call>...</tool_call> in `text`, in order; an opening tag left unclosed is a parse error."""
    calls = [_read_call(m.group(1)) for m in _CALL.finditer(text)]
    rest = _CALL.sub("", text)
    if OPEN in rest:
        start = rest.index(OPEN) + len(OPEN)
        calls.append(ToolCall(None, error=f"a {OPEN} without its closing {CLOSE}", raw=rest[start:]))
    return calls


def _read_call(raw: str) -> ToolCall:
    body = raw.strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(None, error=f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}); write "
                                    f'{OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}', raw=raw)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ToolCall(None, error='the tool call needs a "name" (text) and "arguments" (an object)', raw=raw)
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], error=f'"arguments" of {value["name"]!r} must be an object, got '
                                             f"{type(arguments).__name__}", raw=raw)
    return ToolCall(value["name"], arguments, raw=raw)


def text_outside_calls(text: str) -> str:
    """The message without its tool-call blocks (e.g. the reasoning before a call), stripped."""
    return _CALL.sub("", text).strip()


def tool_message(content: str, name: Optional[str] = None) -> dict:
    """A tool result as the chat template's `tool` role message (`name` shown by templates that use it)."""
    message = {"role": "tool", "content": content}
    if name is not None:
        message["name"] = name
    return message
