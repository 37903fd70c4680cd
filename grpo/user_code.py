"""The user's own code: a Python file given by path (--reward_module, --tool_module, --agent_module) imported so that
its decorators register what it defines, and the name a registry gives a function in its errors."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys


def qualified_name(fn) -> str:
    """`module.qualname` of a function: how a registry names the one that holds a name."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


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


def unknown_names(kind: str, unknown: list[str], module: str | None, flag: str, registered: list[str],
                  define: str) -> str:
    """The error of a registry asked for names it does not hold: which, after which user file, what it holds, and
    how to define one (`define`, e.g. '@register_tool("name")')."""
    where = f" (after importing {module})" if module else f" (no {flag} given)"
    return (f"unknown {kind}{'s' if len(unknown) > 1 else ''} {', '.join(repr(n) for n in unknown)}{where}. "
            f"Registered: {', '.join(registered) or 'none'}. Define it with {define} in a Python file and pass that "
            f"file with {flag}")
