"""Checkpoint manifests: the size and checksum of every file of a checkpoint, written last, checked before loading.

`manifest.json` in a checkpoint folder:
    {"format": 1, "algorithm": "blake2b", "files": {"engine/mp_rank_00_model_states.pt": {"size": n, "blake2b": hex}}}
It covers every rank's files: after a barrier the files are split over the ranks, each rank hashes its share
(streamed in 1 MiB chunks, right after writing, while the pages are still cached), and rank 0 writes the manifest
from what all ranks found. Verification splits the work the same way and gives every rank the same verdict, so no
rank loads a checkpoint that another rank found damaged. A checkpoint without a manifest (saved before manifests
existed) is "legacy": it loads unverified.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from grpo.checkpoint.layout import MANIFEST_FILE
from grpo.runtime import distributed as dist_utils

ALGORITHM = "blake2b"
FORMAT = 1
_CHUNK = 1 << 20


def file_checksum(path: str) -> str:
    """blake2b of a file, read in 1 MiB chunks (bounded memory for multi-GB shards)."""
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(folder: str) -> list[str]:
    """Every file under `folder` as a sorted relative path, the manifest itself excepted."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST_FILE:
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def has_manifest(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST_FILE))


def write_manifest(folder: str) -> None:
    """Hash every file of `folder` (split over ranks) and write manifest.json last. Collective: all ranks call it."""
    dist_utils.barrier()  # every rank's files are on disk
    files = dist_utils.broadcast_object(checkpoint_files(folder) if dist_utils.is_main() else None)
    mine = {rel: {"size": os.path.getsize(os.path.join(folder, rel)),
                  ALGORITHM: file_checksum(os.path.join(folder, rel))}
            for rel in files[dist_utils.rank()::dist_utils.world_size()]}
    entries = {rel: entry for part in dist_utils.gather_objects(mine) for rel, entry in part.items()}
    if dist_utils.is_main():
        path = os.path.join(folder, MANIFEST_FILE)
        with open(path + ".tmp", "w") as fh:
            json.dump({"format": FORMAT, "algorithm": ALGORITHM, "files": dict(sorted(entries.items()))}, fh,
                      indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(path + ".tmp", path)
    dist_utils.barrier()


def read_manifest(folder: str) -> tuple[Optional[dict], Optional[str]]:
    """(files entry of the manifest, None), or (None, what is wrong with manifest.json)."""
    path = os.path.join(folder, MANIFEST_FILE)
    try:
        with open(path) as fh:
            manifest = json.load(fh)
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unknown manifest layout (algorithm {manifest.get('algorithm')!r})")
        return files, None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{MANIFEST_FILE} cannot be read ({type(exc).__name__}: {exc})"


def file_problem(folder: str, rel: str, entry: dict, checksum: bool = True) -> Optional[str]:
    """What is wrong with one file against its manifest entry, or None when it matches."""
    path = os.path.join(folder, rel)
    if not os.path.isfile(path):
        return f"{rel} is missing"
    try:
        size = os.path.getsize(path)
        if size != entry["size"]:
            how = "cut short" if size < entry["size"] else "grown"
            return f"{rel} is {size} bytes but was saved with {entry['size']} ({how})"
        if checksum and file_checksum(path) != entry[ALGORITHM]:
            return f"{rel} has the right size but its checksum differs from the one saved (altered on disk)"
    except OSError as exc:
        return f"{rel} cannot be read ({exc.strerror or exc})"
    return None


def quick_problem(folder: str) -> Optional[str]:
    """Sizes only (no hashing, local, not collective): cheap enough for rotation. None for legacy checkpoints."""
    if not has_manifest(folder):
        return None
    files, problem = read_manifest(folder)
    if problem:
        return problem
    for rel, entry in files.items():
        problem = file_problem(folder, rel, entry, checksum=False)
        if problem:
            return problem
    return None


def verify_checkpoint(folder: str) -> Optional[str]:
    """The first problem found in `folder` (same answer on every rank), or None when intact or legacy.

    Collective: all ranks call it; each hashes its share of the files.
    """
    if dist_utils.is_main():
        files, problem = read_manifest(folder) if has_manifest(folder) else ({}, None)
        shared = {"files": files, "problem": problem}
    else:
        shared = None
    shared = dist_utils.broadcast_object(shared)
    if shared["problem"]:
        return shared["problem"]
    names = sorted(shared["files"])
    mine = []
    for rel in names[dist_utils.rank()::dist_utils.world_size()]:
        problem = file_problem(folder, rel, shared["files"][rel])
        if problem:
            mine.append((rel, problem))
    found = sorted(p for part in dist_utils.gather_objects(mine) for p in part)
    return found[0][1] if found else None
