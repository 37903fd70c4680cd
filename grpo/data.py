"""Dataset registry (configs/dataset_config.json) -> prompt rows {messages, answer, data_source} -> token ids.

Every check here runs before any model loads, and every error names the dataset and the fix.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Optional

import datasets

from .errors import DatasetError
from .jsonfile import read_json_object
from .rewards import last_boxed

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
EXTRACTORS = ("none", "gsm8k", "boxed", "regex:<pattern>")
GSM8K_SOURCE = ("GSM8K comes from https://github.com/openai/grade-school-math: download "
                "grade_school_math/data/train.jsonl to that path")


@dataclass
class DatasetSpec:
    name: str
    rewards: dict
    answer_field: str
    path: Optional[str] = None
    hub_id: Optional[str] = None
    split: str = "train"
    prompt_field: Optional[str] = None
    messages_field: Optional[str] = None
    system_prompt: Optional[str] = None
    prompt_template: Optional[str] = None
    answer_extractor: str = "none"
    reward_kwargs: dict = field(default_factory=dict)
    max_samples: Optional[int] = None


_ENTRY_KEYS = [f.name for f in fields(DatasetSpec) if f.name != "name"]


def load_dataset_registry(path: str) -> dict[str, DatasetSpec]:
    """Parse and check the registry file; relative data paths become absolute (against the file's folder)."""
    raw = read_json_object(path, DatasetError, "--dataset_config_path")
    if not raw:
        raise DatasetError(f"--dataset_config_path: {path} registers no dataset")
    folder = os.path.dirname(os.path.abspath(path))
    return {name: _parse_entry(name, entry, folder, path) for name, entry in raw.items()}


def _parse_entry(name: str, entry, folder: str, registry_path: str) -> DatasetSpec:
    where = f"dataset '{name}' in {registry_path}"
    if not isinstance(entry, dict):
        raise DatasetError(f"{where}: the entry must be a JSON object")
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        raise DatasetError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(_ENTRY_KEYS)}")
    if bool(entry.get("path")) == bool(entry.get("hub_id")):
        raise DatasetError(f"{where}: give exactly one of \"path\" (a local file or folder) or \"hub_id\"")
    if bool(entry.get("prompt_field")) == bool(entry.get("messages_field")):
        raise DatasetError(f"{where}: give exactly one of \"prompt_field\" (a text column) or \"messages_field\" "
                           f"(a column of chat messages)")
    if not entry.get("answer_field"):
        raise DatasetError(f"{where}: \"answer_field\" is required (the column holding the ground truth)")
    rewards = entry.get("rewards")
    if not isinstance(rewards, dict) or not rewards or \
            not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in rewards.values()):
        raise DatasetError(f"{where}: \"rewards\" must map reward names to numeric weights, e.g. "
                           f"{{\"boxed_accuracy\": 1.0}}")
    extractor = entry.get("answer_extractor", "none")
    if extractor not in ("none", "gsm8k", "boxed") and not str(extractor).startswith("regex:"):
        raise DatasetError(f"{where}: unknown answer_extractor '{extractor}'; use one of {', '.join(EXTRACTORS)}")
    if extractor.startswith("regex:"):
        try:
            re.compile(extractor[len("regex:"):])
        except re.error as exc:
            raise DatasetError(f"{where}: answer_extractor regex does not compile: {exc}")
    max_samples = entry.get("max_samples")
    if max_samples is not None and (not isinstance(max_samples, int) or max_samples < 1):
        raise DatasetError(f"{where}: \"max_samples\" must be a positive integer or null")
    template = entry.get("prompt_template")
    if template is not None and "{prompt}" not in template:
        raise DatasetError(f"{where}: \"prompt_template\" must contain the placeholder {{prompt}}")
    kwargs = entry.get("reward_kwargs", {})
    if not isinstance(kwargs, dict) or not all(isinstance(v, dict) for v in kwargs.values()):
        raise DatasetError(f"{where}: \"reward_kwargs\" must map reward names to objects of keyword arguments")
    spec = DatasetSpec(name=name, **entry)
    if spec.path and not os.path.isabs(spec.path):
        spec.path = os.path.normpath(os.path.join(folder, spec.path))
    return spec


def dataset_routes(registry: dict[str, DatasetSpec], names: list[str]) -> tuple[dict, dict]:
    """({dataset: {reward: weight}}, {dataset: {reward: kwargs}}) for the reward router."""
    specs = [_lookup(registry, n) for n in names]
    return {s.name: dict(s.rewards) for s in specs}, {s.name: dict(s.reward_kwargs) for s in specs}


def _lookup(registry: dict[str, DatasetSpec], name: str) -> DatasetSpec:
    if name not in registry:
        raise DatasetError(f"unknown dataset '{name}'; registered: {', '.join(sorted(registry))} "
                           f"(add it to the registry file given by --dataset_config_path)")
    return registry[name]


# ------------------------------------------------------------------------------------------------- loading
def load_prompt_datasets(registry_path: str, names: list[str], train_split_ratio: float,
                         seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) rows with columns messages, answer, data_source; each dataset split by seed, then mixed."""
    datasets.disable_progress_bars()  # a few small maps per run: their bars are noise in the log
    registry = load_dataset_registry(registry_path)
    train_parts, eval_parts = [], []
    for name in names:
        spec = _lookup(registry, name)
        rows = _standardize(spec, _load_raw(spec))
        train, held_out = _split(rows, train_split_ratio, seed)
        if len(train) == 0:
            raise DatasetError(f"dataset '{name}': the training split is empty ({len(rows)} rows with "
                               f"--train_split_ratio {train_split_ratio}); add rows or raise the ratio")
        train_parts.append(train)
        eval_parts.append(held_out)
    return datasets.concatenate_datasets(train_parts), datasets.concatenate_datasets(eval_parts)


def _load_raw(spec: DatasetSpec) -> datasets.Dataset:
    if spec.hub_id:
        if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
            raise DatasetError(f"dataset '{spec.name}': hub_id '{spec.hub_id}' needs the network, but this run is "
                               f"offline; download it and point \"path\" at the local file")
        try:
            return datasets.load_dataset(spec.hub_id, split=spec.split)
        except Exception as exc:
            raise DatasetError(f"dataset '{spec.name}': could not load '{spec.hub_id}' from the hub: {exc}") from exc
    path = spec.path
    if os.path.isdir(path):
        try:
            loaded = datasets.load_from_disk(path)
        except Exception as exc:
            raise DatasetError(f"dataset '{spec.name}': {path} is a folder but not one written by "
                               f"datasets' save_to_disk ({exc})") from exc
        if isinstance(loaded, datasets.DatasetDict):
            if spec.split not in loaded:
                raise DatasetError(f"dataset '{spec.name}': split '{spec.split}' not in {path} "
                                   f"(splits: {', '.join(loaded)})")
            loaded = loaded[spec.split]
        return loaded
    if not os.path.isfile(path):
        hint = GSM8K_SOURCE if "gsm8k" in spec.name.lower() else "fix \"path\" in the registry"
        raise DatasetError(f"dataset '{spec.name}': data file not found: {path}; {hint}")
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_BUILDERS:
        raise DatasetError(f"dataset '{spec.name}': unsupported file type '{ext}' ({path}); use .jsonl, .json, "
                           f".parquet, .csv or a save_to_disk folder")
    if ext == ".jsonl":
        _check_jsonl(spec.name, path)
    try:
        return datasets.load_dataset(FILE_BUILDERS[ext], data_files=path, split="train", keep_in_memory=True)
    except Exception as exc:
        raise DatasetError(f"dataset '{spec.name}': could not read {path}: {exc}") from exc


def _check_jsonl(name: str, path: str) -> None:
    """datasets' own message for a bad line names no line; find it first."""
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"dataset '{name}': {path} line {number} is not valid JSON ({exc.msg})")


def _standardize(spec: DatasetSpec, raw: datasets.Dataset) -> datasets.Dataset:
    if spec.max_samples:
        raw = raw.select(range(min(spec.max_samples, len(raw))))
    if len(raw) == 0:
        raise DatasetError(f"dataset '{spec.name}' is empty ({spec.path or spec.hub_id})")
    present = raw.column_names
    for kind, column in (("prompt_field", spec.prompt_field), ("messages_field", spec.messages_field),
                         ("answer_field", spec.answer_field)):
        if column and column not in present:
            raise DatasetError(f"dataset '{spec.name}': {kind} '{column}' is not a column of "
                               f"{spec.path or spec.hub_id}; columns present: {', '.join(present)}")

    def to_row(example):
        return {"messages": build_messages(spec, example), "answer": extract_answer(spec, example[spec.answer_field]),
                "data_source": spec.name}

    return raw.map(to_row, remove_columns=present, keep_in_memory=True, load_from_cache_file=False,
                   desc=None)


def build_messages(spec: DatasetSpec, example: dict) -> list[dict]:
    """Chat messages of one row: system prompt first (when configured), template applied to the user turn."""
    if spec.prompt_field:
        messages = [{"role": "user", "content": str(example[spec.prompt_field])}]
    else:
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in example[spec.messages_field]]
        if not messages:
            raise DatasetError(f"dataset '{spec.name}': a row has an empty '{spec.messages_field}' list")
    if spec.prompt_template:
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user") \
            if any(m["role"] == "user" for m in messages) else len(messages) - 1
        messages[last_user] = {**messages[last_user],
                               "content": spec.prompt_template.replace("{prompt}", messages[last_user]["content"])}
    if spec.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": spec.system_prompt}] + messages
    return messages


def extract_answer(spec: DatasetSpec, value) -> str:
    """The ground truth as a string, read from the answer field by the configured extractor."""
    text = str(value)
    extractor = spec.answer_extractor
    if extractor == "gsm8k":
        return text.rsplit("####", 1)[-1].strip().replace(",", "")
    if extractor == "boxed":
        boxed = last_boxed(text)
        return boxed.strip() if boxed is not None else text.strip()
    if extractor.startswith("regex:"):
        matches = list(re.finditer(extractor[len("regex:"):], text))
        if matches:
            m = matches[-1]
            return (m.group(1) if m.groups() else m.group(0)).strip()
        return text.strip()
    return text.strip()


def _split(rows: datasets.Dataset, ratio: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    if ratio >= 1.0:
        return rows, rows.select([])
    held_out = max(1, round(len(rows) * (1.0 - ratio))) if len(rows) > 1 else 0
    if held_out == 0:
        return rows, rows.select([])
    if held_out >= len(rows):
        return rows.select([]), rows
    parts = rows.train_test_split(test_size=held_out, seed=seed, shuffle=True, keep_in_memory=True)
    return parts["train"], parts["test"]


# ----------------------------------------------------------------------------------------------- rendering
def render_prompts(dataset: datasets.Dataset, tokenizer, max_prompt_length: int) -> datasets.Dataset:
    """Add prompt_text and prompt_ids, using the tokenizer's chat template when it has one."""
    has_template = bool(getattr(tokenizer, "chat_template", None))

    def render(example):
        if has_template:
            text = tokenizer.apply_chat_template(example["messages"], add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            text = "\n\n".join(m["content"] for m in example["messages"]) + "\n"
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        return {"prompt_text": text, "prompt_ids": ids}

    rendered = dataset.map(render, keep_in_memory=True, load_from_cache_file=False)
    lengths = [len(ids) for ids in rendered["prompt_ids"]]
    too_long = [i for i, n in enumerate(lengths) if n > max_prompt_length]
    if too_long:
        sources = sorted({rendered[i]["data_source"] for i in too_long})
        raise DatasetError(f"dataset(s) {', '.join(sources)}: {len(too_long)} prompt(s) are longer than "
                           f"--max_prompt_length {max_prompt_length} tokens (longest: {max(lengths)}); raise "
                           f"--max_prompt_length to {max(lengths)} or shorten the prompts / set max_samples")
    return rendered
