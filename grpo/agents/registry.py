"""The agent registry: @register_agent(name), lookup by name, and user agent files (--agent_module).

An agent is an `async def agent(client, row)`: `client` is an `openai.AsyncOpenAI` pointed at the episode's own
endpoint (grpo.agents.endpoint), `row` the dataset row (its fields: the prompt, `answer`, ...). It calls the model as
often as it likes and returns its result: the final answer as text, or a dict (see grpo.agents.runner), or None.
"""
from __future__ import annotations

import inspect
import os
from typing import Callable, Optional

from grpo.errors import GRPOError
from grpo.user_code import import_user_file, qualified_name, unknown_names


class AgentError(GRPOError):
    """An agent that cannot be registered or found, or a --agent_module that does not import."""


_AGENTS: dict[str, Callable] = {}


def register_agent(name: str):
    """Decorator: make an `async def agent(client, row)` usable by that name (dataset_config.json's "agent")."""
    if not isinstance(name, str) or not name.strip():
        hint = " (write @register_agent(\"name\"), with the name in parentheses)" if callable(name) else ""
        raise AgentError(f"register_agent needs a non-empty agent name, got {name!r}{hint}")

    def decorator(fn: Callable) -> Callable:
        check_agent_function(fn, name)
        existing = _AGENTS.get(name)
        if existing is not None and qualified_name(existing) != qualified_name(fn):
            raise AgentError(f"agent name '{name}' is already registered by {qualified_name(existing)}; pick another "
                             f"name for {qualified_name(fn)}")
        _AGENTS[name] = fn
        return fn
    return decorator


def check_agent_function(fn, name: str = "") -> None:
    """An agent must be an async function of two arguments (client, row)."""
    label = f"agent '{name}' ({qualified_name(fn)})" if name and callable(fn) else f"agent {fn!r}"
    if not callable(fn):
        raise AgentError(f"{label} must be a function, got {type(fn).__name__}")
    target = fn.__call__ if not inspect.isfunction(fn) and not inspect.ismethod(fn) and hasattr(fn, "__call__") \
        else fn
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(target)):
        raise AgentError(f"{label} must be an async function: `async def agent(client, row)` (its calls to the model "
                         "are awaited, so that many episodes run at once)")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as exc:
        raise AgentError(f"{label} must take two arguments, (client, row): {exc}") from exc
    except ValueError:
        pass  # no signature to read (a builtin): called as it is


def registered_agents() -> list[str]:
    return sorted(_AGENTS)


def get_agent(name: str) -> Callable:
    if name not in _AGENTS:
        known = ", ".join(registered_agents()) or "none"
        raise AgentError(f"unknown agent '{name}'. Registered: {known}. Add one with @register_agent(\"{name}\") in a "
                         "Python file passed with --agent_module")
    return _AGENTS[name]


def load_agent_module(path: str) -> None:
    """--agent_module: import a user's Python file by path so that its @register_agent decorators run."""
    import_user_file(path, "--agent_module", "grpo_user_agents", AgentError)


def agents_defined_in(path: str) -> list[str]:
    """The registered agents whose function is written in the Python file at `path`."""
    target = os.path.realpath(path)

    def source(fn) -> str:
        code = getattr(inspect.unwrap(fn), "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
        return os.path.realpath(code.co_filename) if code is not None else ""
    return [name for name, fn in sorted(_AGENTS.items()) if source(fn) == target]


def check_agents(names, module: Optional[str] = None) -> list[Callable]:
    """Load --agent_module (if given) and return the named agents, or fail with one message naming every unknown
    one; meant to run before any model loads."""
    if module:
        load_agent_module(module)
    names = list(names)
    unknown = [n for n in names if n not in _AGENTS]
    if unknown:
        raise AgentError(unknown_names("agent", unknown, module, "--agent_module", registered_agents(),
                                       '@register_agent("name") on an `async def agent(client, row)`'))
    return [_AGENTS[n] for n in names]
