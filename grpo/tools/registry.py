"""The tool registry: @register_tool(name), lookup by name, schemas for the chat template, user tool files
(--tool_module), and the check that the tools a run names exist (before any model loads)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from grpo.user_code import import_user_file, qualified_name, unknown_names
from grpo.tools.errors import ToolError

DEFAULT_TOOL_TIMEOUT = 30.0  # seconds a tool may run before its call becomes a timeout message


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict     # {"type": "function", "function": {"name", "description", "parameters"}}: what `tools=` takes
    timeout: float   # seconds
    check: Optional[Callable[[], None]] = None  # raises ToolError where the tool cannot run here (register_tool)


_TOOLS: dict[str, Tool] = {}


def register_tool(name: str, timeout: float = DEFAULT_TOOL_TIMEOUT, check: Optional[Callable[[], None]] = None):
    """Decorator: make a plain Python function callable by the model as `name`, and usable by that name in
    dataset_config.json's "tools".

    The function needs type hints and a Google-style docstring (a summary line and an `Args:` section naming every
    parameter): they become the JSON schema the chat template shows the model. It returns text, or a value that JSON
    can write (dict, list, number, bool, None). Registering the same function again replaces it; a different function
    under a taken name is an error. `check`, if given, is called by check_tools (before any model loads) and raises
    ToolError where the tool cannot run here (the built-in `python` tool: no sandbox can be made).
    """
    if not isinstance(name, str) or not name.strip():
        hint = " (write @register_tool(\"name\"), with the name in parentheses)" if callable(name) else ""
        raise ToolError(f"register_tool needs a non-empty tool name, got {name!r}{hint}")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
        raise ToolError(f"tool name {name!r}: use letters, digits and _ . - only (the model writes it in a JSON call)")
    if not timeout > 0:
        raise ToolError(f"@register_tool(\"{name}\"): timeout must be > 0 seconds, got {timeout}")

    def decorator(fn: Callable) -> Callable:
        if not callable(fn):
            raise ToolError(f"@register_tool(\"{name}\") must decorate a function, got {type(fn).__name__}")
        existing = _TOOLS.get(name)
        if existing is not None and qualified_name(existing.fn) != qualified_name(fn):
            raise ToolError(f"tool name '{name}' is already registered by {qualified_name(existing.fn)}; "
                            f"pick another name for {qualified_name(fn)}")
        _TOOLS[name] = Tool(name, fn, function_schema(fn, name), float(timeout), check)
        return fn
    return decorator


def function_schema(fn: Callable, name: str) -> dict:
    """The JSON schema of `fn` as chat templates' `tools=` expect it, under the registered `name`."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ToolError(f"tool '{name}' ({qualified_name(fn)}) cannot be described to the model: {exc}. A tool needs a "
                        "type hint on every parameter and a docstring with a summary line and an 'Args:' section "
                        "describing each parameter") from exc
    schema["function"]["name"] = name
    schema["function"].pop("return", None)  # templates show the parameters; the return value reaches the model as text
    return schema


def registered_tools() -> list[str]:
    """Names usable in dataset_config.json's "tools", sorted."""
    return sorted(_TOOLS)


def get_tool(name: str) -> Tool:
    """The tool registered as `name`; ToolError listing the known names when there is none."""
    if name not in _TOOLS:
        raise ToolError(f"unknown tool '{name}'. Registered: {', '.join(registered_tools())}. Add one with "
                        f"@register_tool(\"{name}\") in a Python file passed with --tool_module")
    return _TOOLS[name]


def tool_schemas(names: Iterable[str]) -> list[dict]:
    """The schemas of these tools, in order, for `tokenizer.apply_chat_template(..., tools=...)`."""
    return [get_tool(n).schema for n in names]


def load_tool_module(path: str) -> None:
    """--tool_module: import a user's Python file by path so that its @register_tool / @register_environment
    decorators run."""
    import_user_file(path, "--tool_module", "grpo_user_tools", ToolError)


def check_tools(names: Iterable[str], module: Optional[str] = None) -> list[Tool]:
    """Load --tool_module (if given) and return the named tools, or fail with one message naming every unknown tool
    (or, where a named tool's check fails, saying why it cannot run here: the built-in `python` tool without a
    sandbox).

    Config and dataset validation call this before any model loads."""
    if module:
        load_tool_module(module)
    names = list(names)
    unknown = [n for n in names if n not in _TOOLS]
    if unknown:
        raise ToolError(unknown_names("tool", unknown, module, "--tool_module", registered_tools(),
                                      '@register_tool("name")'))
    for name in dict.fromkeys(names):
        if _TOOLS[name].check is not None:
            _TOOLS[name].check()  # the python tool refuses to start without a sandbox (unless allowed explicitly)
    return [_TOOLS[n] for n in names]
