"""The files grpo ships (the DeepSpeed configs, the dataset registry and the data it names), found from any folder.

A path is read as given when it exists; a relative one that does not (`configs/zero2.json` run from a folder of
one's own) is looked up among the shipped files, so an installed package finds its defaults. In a clone,
grpo/shipped/configs and grpo/shipped/data are links to the repository's configs/ and data/; a wheel holds copies.
"""
from __future__ import annotations

import os

from grpo.errors import ConfigError

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shipped")
SHIPPED_DEEPSPEED = {"zero2": "configs/zero2.json", "zero3": "configs/zero3.json"}


def shipped_file(relative: str) -> str:
    """The absolute path of a shipped file, e.g. shipped_file('configs/zero3.json')."""
    return os.path.join(SHIPPED_DIR, relative)


def resolve_shipped_file(path: str, flag: str, strict: bool = True) -> str:
    """`path` when it exists, else the shipped file of that relative path; when neither exists, a ConfigError naming
    both places (`strict`) or `path` as given. The DeepSpeed names zero2 / zero3 stand for the shipped configs."""
    if flag == "deepspeed" and path in SHIPPED_DEEPSPEED:
        return shipped_file(SHIPPED_DEEPSPEED[path])
    if os.path.isfile(path):
        return path
    relative = os.path.normpath(path)
    if not os.path.isabs(path) and not relative.startswith(".."):
        candidate = shipped_file(relative)
        if os.path.isfile(candidate):
            return candidate
    if not strict:
        return path
    hint = " (use zero2, zero3 or a path to a JSON file)" if flag == "deepspeed" else ""
    raise ConfigError(f"--{flag}: file not found: {os.path.abspath(path)}, nor among the files grpo ships "
                      f"({SHIPPED_DIR}){hint}")
