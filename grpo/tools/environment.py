"""Environments: what answers the model between its turns.

An environment is a plain function registered by name,

    @register_environment("name")
    def step(messages: list[dict], **fields) -> EnvironmentStep | tuple[list[dict], bool]

that gets the conversation so far (the prompt's messages, then the model's and the environment's turns; the last
message is the model's, its `content` the text it wrote, tool calls included) and returns the next message(s) (tool
results, a user turn, ...) and whether the episode is over. `fields` hold the dataset row's fields (`answer`,
`data_source`, ...) and `tools`, the tool names the registry entry offers. The default environment, "tools", runs the
tool calls of the model's last message and ends the episode when it made none.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from grpo.tools.calls import parse_tool_calls
from grpo.tools.errors import ToolError
from grpo.tools.execute import execute_calls
from grpo.tools.registry import qualified_name, load_tool_module

DEFAULT_ENVIRONMENT = "tools"


@dataclass
class EnvironmentStep:
    messages: list = field(default_factory=list)  # the next messages, each {"role": ..., "content": ...}
    done: bool = False                            # the episode is over
    tool_calls: int = 0                           # counts for the episode's metrics
    tool_errors: int = 0
    tool_timeouts: int = 0


_ENVIRONMENTS: dict[str, Callable] = {}


def register_environment(name: str):
    """Decorator: make `fn(messages, **fields)` usable by `name` in dataset_config.json's "environment"."""
    if not isinstance(name, str) or not name.strip():
        hint = " (write @register_environment(\"name\"), with the name in parentheses)" if callable(name) else ""
        raise ToolError(f"register_environment needs a non-empty name, got {name!r}{hint}")

    def decorator(fn: Callable) -> Callable:
        if not callable(fn):
            raise ToolError(f"@register_environment(\"{name}\") must decorate a function, got {type(fn).__name__}")
        existing = _ENVIRONMENTS.get(name)
        if existing is not None and qualified_name(existing) != qualified_name(fn):
            raise ToolError(f"environment name '{name}' is already registered by {qualified_name(existing)}; "
                            f"pick another name for {qualified_name(fn)}")
        _ENVIRONMENTS[name] = fn
        return fn
    return decorator


def registered_environments() -> list[str]:
    return sorted(_ENVIRONMENTS)


def get_environment(name: str) -> Callable:
    if name not in _ENVIRONMENTS:
        raise ToolError(f"unknown environment '{name}'. Registered: {', '.join(registered_environments())}. Add one "
                        f"with @register_environment(\"{name}\") in a Python file passed with --tool_module")
    return _ENVIRONMENTS[name]


def check_environment(name: Optional[str], module: Optional[str] = None) -> Callable:
    """Load --tool_module (if given) and return the named environment (None: the default), or fail with one message.
    Config and dataset validation call this before any model loads."""
    if module:
        load_tool_module(module)
    name = name or DEFAULT_ENVIRONMENT
    if name not in _ENVIRONMENTS:
        where = f" (after importing {module})" if module else " (no --tool_module given)"
        raise ToolError(f"unknown environment '{name}'{where}. Registered: {', '.join(registered_environments())}. "
                        f"Define it with @register_environment(\"{name}\") in a Python file and pass that file with "
                        "--tool_module")
    return _ENVIRONMENTS[name]


def step_environment(environment: Callable, messages: list[dict], fields: dict) -> EnvironmentStep:
    """Call an environment and check what it returned (a wrong shape is the environment's bug: a ToolError naming
    it, not something to show the model)."""
    name = qualified_name(environment)
    try:
        out = environment(messages, **fields)
    except ToolError:
        raise
    except Exception as exc:
        raise ToolError(f"environment {name} raised {type(exc).__name__}: {exc}") from exc
    if isinstance(out, tuple) and len(out) == 2:
        out = EnvironmentStep(list(out[0]), bool(out[1]))
    if not isinstance(out, EnvironmentStep):
        raise ToolError(f"environment {name} returned a {type(out).__name__}; return an EnvironmentStep or a "
                        "(messages, done) tuple")
    for message in out.messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ToolError(f"environment {name} returned the message {message!r}; each message is a dict with a "
                            "'role' and a text 'content'")
    return out


@register_environment(DEFAULT_ENVIRONMENT)
def tool_environment(messages: list[dict], tools: Iterable[str] = (), **fields) -> EnvironmentStep:
    """Run the tool calls of the model's last message (only the tools the prompt offers); done when it made none."""
    calls = parse_tool_calls(messages[-1]["content"])
    if not calls:
        return EnvironmentStep(done=True)
    results = execute_calls(calls, available=list(tools))
    return EnvironmentStep([r.message for r in results], done=False, tool_calls=len(calls),
                           tool_errors=sum(r.status == "error" for r in results),
                           tool_timeouts=sum(r.status == "timeout" for r in results))
