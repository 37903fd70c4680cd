"""The reward registry: @register_reward(name), lookup by name, and user reward files (--reward_module)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from typing import Callable

from grpo.errors import RewardError

RewardFn = Callable[..., list]
_REGISTRY: dict[str, RewardFn] = {}


# ---------------------------------------------------------------------------------------------- registry
def register_reward(name: str):
    """Decorator: make the function usable by `name` in dataset_config.json's "rewards".

    Registering the same function again (same module and qualified name, e.g. a file imported twice or a
    notebook cell run again) replaces it; a different function under a taken name is an error.
    """
    if not isinstance(name, str) or not name.strip():
        hint = " (write @register_reward(\"name\"), with the name in parentheses)" if callable(name) else ""
        raise RewardError(f"register_reward needs a non-empty reward name, got {name!r}{hint}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise RewardError(f"@register_reward(\"{name}\") must decorate a function, got {type(fn).__name__}")
        existing = _REGISTRY.get(name)
        if existing is not None and qualified_name(existing) != qualified_name(fn):
            raise RewardError(f"reward name '{name}' is already registered by {qualified_name(existing)}; "
                              f"pick another name for {qualified_name(fn)}")
        _REGISTRY[name] = fn
        return fn
    return decorator


def qualified_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def registered_rewards() -> list[str]:
    """Names usable in dataset_config.json's "rewards", sorted."""
    return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFn:
    """The function registered as `name`; RewardError listing the known names when there is none."""
    if name not in _REGISTRY:
        raise RewardError(f"unknown reward '{name}'. Registered: {', '.join(registered_rewards())}. Add one with "
                          f"@register_reward(\"{name}\") in a Python file passed with --reward_module")
    return _REGISTRY[name]


def load_reward_module(path: str) -> None:
    """Import a user's Python file by path so that its @register_reward decorators run."""
    import_user_file(path, "--reward_module", "grpo_user_rewards", RewardError)


def import_user_file(path: str, flag: str, prefix: str, error: type[Exception]) -> None:
    """Import a user's Python file by path (its decorators register what it defines); `error` names `flag` and says
    what is wrong when the file is missing, not Python, or fails while it imports."""
    if not os.path.isfile(path):
        raise error(f"{flag}: file not found: {path}")
    absolute = os.path.abspath(path)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    # The same file always gets the same module name (so importing it twice re-registers the same functions),
    # while two files that share a base name in different folders stay distinct (and clash if names collide).
    module_name = f"{prefix}_{stem}_{hashlib.sha1(absolute.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, absolute)
    if spec is None or spec.loader is None:
        raise error(f"{flag}: {path} is not an importable Python file (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up while it executes
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(module_name, None)
        raise error(f"{flag}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
