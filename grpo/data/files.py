"""Reading a registry entry's raw rows: local files (checked line by line first), saved folders, or the hub."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile

import datasets

from grpo.errors import DatasetError
from grpo.data.registry import DatasetSpec

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
GSM8K_SOURCE = ("GSM8K comes from https://github.com/openai/grade-school-math: download its file "
                "grade_school_math/data/{file} (train.jsonl or test.jsonl) to that path")


@contextlib.contextmanager
def quiet_progress():
    """A few small builds and maps per run: their progress bars are noise in the training log."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def map_fingerprint(dataset: datasets.Dataset, transform: str, *params) -> str:
    """The fingerprint of `dataset.map(<transform>)`: the input's own fingerprint, the transform's name and the
    parameters that shape its output. Given as new_fingerprint, `datasets` need not pickle the mapped function (a
    closure over a registry entry or a tokenizer) to hash it, which fails for some closures and warns."""
    return hashlib.sha256(repr((dataset._fingerprint, transform, params)).encode()).hexdigest()[:32]


def _hub_offline() -> bool:
    return any(os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def load_raw(spec: DatasetSpec) -> datasets.Dataset:
    if not spec.hub_id:
        return _load_local(spec)
    if _hub_offline():
        raise DatasetError(f"dataset '{spec.name}': hub_id '{spec.hub_id}' needs the network, but HF_HUB_OFFLINE / "
                           f"HF_DATASETS_OFFLINE is set; download it where the hub is reachable (e.g. "
                           f"datasets.load_dataset('{spec.hub_id}', split='{spec.split}').to_json('x.jsonl')) and "
                           f"give its local file as \"path\" instead of \"hub_id\"")
    try:
        return datasets.load_dataset(spec.hub_id, split=spec.split)
    except Exception as exc:
        raise DatasetError(f"dataset '{spec.name}': could not load '{spec.hub_id}' (split '{spec.split}') from the "
                           f"hub ({type(exc).__name__}: {exc}); check hub_id and split, or use a local \"path\"") \
            from exc


def _load_local(spec: DatasetSpec) -> datasets.Dataset:
    path = spec.path
    if os.path.isdir(path):
        return _load_saved_folder(spec)
    if not os.path.isfile(path):
        hint = GSM8K_SOURCE.format(file=os.path.basename(path)) if "gsm8k" in (spec.name + path).lower() \
            else "fix \"path\" in the registry"
        raise DatasetError(f"dataset '{spec.name}': data file not found: {path}; {hint}")
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_BUILDERS:
        raise DatasetError(f"dataset '{spec.name}': unsupported file type '{ext}' ({path}); use .jsonl, .json, "
                           f".parquet, .csv or a folder written by datasets' save_to_disk")
    if ext == ".jsonl":
        _check_json_lines(spec.name, path)
    elif ext == ".json":
        _check_json_file(spec.name, path)
    try:
        # A throw-away cache: nothing is written next to the data or kept in ~/.cache, and an edited file is never
        # served from a stale copy. keep_in_memory holds the rows once the folder is gone.
        with tempfile.TemporaryDirectory(prefix="grpo-data-") as cache:
            return datasets.load_dataset(FILE_BUILDERS[ext], data_files=path, split="train", keep_in_memory=True,
                                         cache_dir=cache)
    except Exception as exc:
        raise DatasetError(f"dataset '{spec.name}': could not read {path} ({type(exc).__name__}: {exc}); check "
                           f"that it is a valid {ext} file with one row per record") from exc


def _load_saved_folder(spec: DatasetSpec) -> datasets.Dataset:
    try:
        loaded = datasets.load_from_disk(spec.path)
    except Exception as exc:
        raise DatasetError(f"dataset '{spec.name}': {spec.path} is a folder but not one written by datasets' "
                           f"save_to_disk ({exc}); point \"path\" at a data file or a saved dataset") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if spec.split not in loaded:
            raise DatasetError(f"dataset '{spec.name}': split '{spec.split}' is not in {spec.path}; set \"split\" "
                               f"to one of {', '.join(loaded)}")
        loaded = loaded[spec.split]
    return loaded


def _check_json_lines(name: str, path: str) -> None:
    """datasets' own message for a bad line names no line: find it first (and catch an empty file)."""
    rows = 0
    with _open_text(name, path) as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"dataset '{name}': {path} line {number} is not valid JSON ({exc.msg} at column "
                                   f"{exc.colno}); fix or delete that line") from None
            if not isinstance(value, dict):
                raise DatasetError(f"dataset '{name}': {path} line {number} is not a JSON object; each line must be "
                                   f"one record like {{\"question\": ..., \"answer\": ...}}")
            rows += 1
    if rows == 0:
        raise DatasetError(f"dataset '{name}': {path} has no rows; add records (one JSON object per line)")


def _check_json_file(name: str, path: str) -> None:
    """A .json file is either one JSON array of records or JSON lines; check whichever it is."""
    with _open_text(name, path) as fh:
        text = fh.read()
    if not text.lstrip().startswith("["):
        return _check_json_lines(name, path)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"dataset '{name}': {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                           f"{exc.msg})") from None
    if not records:
        raise DatasetError(f"dataset '{name}': {path} holds an empty list; add records")
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is not None:
        raise DatasetError(f"dataset '{name}': {path} record {bad + 1} is not a JSON object; the list must hold "
                           f"records like {{\"question\": ..., \"answer\": ...}}")


@contextlib.contextmanager
def _open_text(name: str, path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            yield fh
    except UnicodeDecodeError as exc:
        raise DatasetError(f"dataset '{name}': {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                           f"save it as UTF-8") from None
