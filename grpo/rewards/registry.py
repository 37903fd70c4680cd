"""The reward registry: @register_reward(name), lookup by name, and user reward files (--reward_module, imported by
grpo/user_code.py)."""
from __future__ import annotations

from typing import Callable

from grpo.errors import RewardError
from grpo.user_code import import_user_file, qualified_name  # noqa: F401 (also imported from here)

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
