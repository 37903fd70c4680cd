"""Which base model a lora / qlora checkpoint was trained on.

Such a checkpoint holds only the trainable weights; a resume rebuilds the frozen base from --model_name_or_path.
`base_model.json` in the checkpoint records the base's weight files (and config.json), each by its size and a
blake2b of three 1 MiB samples (start, middle, end): cheap for a 15 GB model, and any retraining or merge changes
them. A resume compares the files it is about to load with that record before any model loads.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from grpo.checkpoint.layout import BASE_FILE

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE = 1 << 20


def base_model_files(model_path: str) -> Optional[dict]:
    """{file name: {"size", "sampled_blake2b"}} of the base's weight files and config.json; None when the model has
    no local folder to read (a hub id not in the local cache)."""
    from grpo.model.base_weights import local_snapshot

    folder = local_snapshot(model_path)
    if folder is None:
        return None
    names = sorted(n for n in os.listdir(folder) if (n == "config.json" or n.endswith(WEIGHT_SUFFIXES))
                   and os.path.isfile(os.path.join(folder, n)))
    return {name: _fingerprint(os.path.join(folder, name)) for name in names}


def _fingerprint(path: str) -> dict:
    size = os.path.getsize(path)
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
            fh.seek(offset)
            digest.update(fh.read(_SAMPLE))
    return {"size": size, "sampled_blake2b": digest.hexdigest()}


def base_model_record(model_name_or_path: str, model_path: str) -> dict:
    return {"model_name_or_path": model_name_or_path, "files": base_model_files(model_path)}


def write_base_model_record(folder: str, record: dict) -> None:
    with open(os.path.join(folder, BASE_FILE), "w") as fh:
        json.dump(record, fh, indent=1)


def base_model_problem(checkpoint: str, model_path: str) -> Optional[str]:
    """How the base at `model_path` differs from the one `checkpoint` was trained on, or None (the same files, or
    nothing to compare: no record, or no local files)."""
    path = os.path.join(checkpoint, BASE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        record = json.load(fh)
    saved, now = record.get("files"), base_model_files(model_path)
    if saved is None or now is None:
        return None
    trained_on = f"trained on {record.get('model_name_or_path')!r}, this run loads {model_path!r}"
    for name in sorted(set(saved) | set(now)):
        if name not in now:
            return f"{trained_on}, which has no {name}"
        if name not in saved:
            return f"{trained_on}, whose {name} the trained base did not have"
        if saved[name] != now[name]:
            how = (f"{now[name]['size']} bytes, trained on {saved[name]['size']}" if saved[name]["size"] !=
                   now[name]["size"] else "same size, other contents")
            return f"{trained_on}, whose {name} differs ({how})"
    return None
