"""Tool calls in the model's text, and tool results as chat messages.

The convention is Qwen's and Hermes' (also what Qwen2.5/Qwen3 chat templates render for `tool_calls`): each call is a
JSON object between tags, several per message allowed,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "6 * 7"}}
    </tool_call>

"arguments" may also be a JSON string holding the object, or be called "parameters" (Llama 3.1's key). A call that
cannot be read becomes a ToolCall with `error` set (the model gets that message back), never an exception.

What a model writes is hostile input: the tags are found in one pass (time linear in the text, however many tags are
left open), and a call's JSON is bounded in size and nesting before it is parsed (Python's parser recurses).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 100_000  # a call's JSON longer than this is refused unread
MAX_NESTING = 32          # nor deeper than this: lists and objects inside each other
# JSON strings (skipped whole; one left open runs to the end, so no search starts again inside it) and brackets:
# the nesting counted without parsing
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)|[\[\]{}]', re.DOTALL)


@dataclass
class ToolCall:
    name: Optional[str]                            # None when the call could not be read
    arguments: dict = field(default_factory=dict)
    error: Optional[str] = None                    # why the call could not be read (a parse error)
    raw: str = ""                                  # the text between the tags


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call>...</tool_call> in `text`, in order; an opening tag left unclosed is a parse error."""
    calls = []
    for body, closed in _blocks(text):
        calls.append(_read_call(body) if closed else
                     ToolCall(None, error=f"a {OPEN} without its closing {CLOSE}", raw=body[:MAX_CALL_CHARS]))
    return calls


def _blocks(text: str):
    """(text between the tags, whether it was closed) for each call block, left to right, in one pass: each search
    starts where the last one stopped, and an unclosed tag ends the search (nothing after it can close)."""
    position = 0
    while True:
        start = text.find(OPEN, position)
        if start < 0:
            return
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            yield text[start + len(OPEN):], False
            return
        yield text[start + len(OPEN):end], True
        position = end + len(CLOSE)


def nesting_depth(text: str) -> int:
    """How deeply the JSON in `text` nests lists and objects (brackets inside strings not counted); linear time."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


def _read_call(raw: str) -> ToolCall:
    body = raw.strip()
    if len(body) > MAX_CALL_CHARS:
        return ToolCall(None, error=f"the tool call is {len(body)} characters long; at most {MAX_CALL_CHARS} are read",
                        raw=raw[:MAX_CALL_CHARS])
    if nesting_depth(body) > MAX_NESTING:
        return ToolCall(None, error=f"the tool call nests lists or objects more than {MAX_NESTING} levels deep",
                        raw=raw)
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        if isinstance(exc, RecursionError):
            return ToolCall(None, error="the tool call nests too deeply to read", raw=raw)
        return ToolCall(None, error=f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}); write "
                                    f'{OPEN}{{"name": ..., "arguments": {{...}}}}{CLOSE}', raw=raw)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ToolCall(None, error='the tool call needs a "name" (text) and "arguments" (an object)', raw=raw)
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        if nesting_depth(arguments) > MAX_NESTING:
            return ToolCall(value["name"], error=f"the arguments nest more than {MAX_NESTING} levels deep", raw=raw)
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], error=f'"arguments" of {value["name"]!r} must be an object, got '
                                             f"{type(arguments).__name__}", raw=raw)
    return ToolCall(value["name"], arguments, raw=raw)


def text_outside_calls(text: str) -> str:
    """The message without its tool-call blocks (e.g. the reasoning before a call), stripped."""
    pieces, position = [], 0
    while True:
        start = text.find(OPEN, position)
        end = text.find(CLOSE, start + len(OPEN)) if start >= 0 else -1
        if end < 0:  # no more closed blocks: an unclosed tag stays in the text, as written
            pieces.append(text[position:])
            return "".join(pieces).strip()
        pieces.append(text[position:start])
        position = end + len(CLOSE)


def tool_message(content: str, name: Optional[str] = None) -> dict:
    """A tool result as the chat template's `tool` role message (`name` shown by templates that use it)."""
    message = {"role": "tool", "content": content}
    if name is not None:
        message["name"] = name
    return message
