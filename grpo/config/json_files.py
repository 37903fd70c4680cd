"""The reading of every JSON file users edit (run configs, the dataset registry, DeepSpeed configs, saved options),
with errors that point: the file, and for bad JSON the line and column."""
from __future__ import annotations

import json
import os


def read_json_object(path: str, error: type[Exception], label: str) -> dict:
    """The JSON object in `path`; a missing file, bad JSON (with line and column) or a non-object raises `error`."""
    if not os.path.isfile(path):
        raise error(f"{label}: file not found: {os.path.abspath(path)}")
    try:
        with open(path) as fh:
            value = json.load(fh)
    except json.JSONDecodeError as exc:
        raise error(f"{label}: {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})")
    if not isinstance(value, dict):
        raise error(f"{label}: {path} must hold a JSON object")
    return value
