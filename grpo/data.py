"""Dataset registry (configs/dataset_config.json) -> prompt rows {messages, answer, data_source} -> token ids.

Every check here runs before any model loads, and every error names the dataset, the file and the fix.
"""
from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import datasets

from . import images as image_utils
from .errors import DatasetError
from .jsonfile import read_json_object
from .rewards import last_boxed

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
EXTRACTORS = ("none", "gsm8k", "boxed", "regex:<pattern>")
GSM8K_SOURCE = ("GSM8K comes from https://github.com/openai/grade-school-math: download its file "
                "grade_school_math/data/train.jsonl to that path")
# One schema for every dataset, so that datasets of different origins concatenate.
ROW_FEATURES = datasets.Features({
    "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
    "answer": datasets.Value("string"),
    "data_source": datasets.Value("string"),
})


@dataclass
class DatasetSpec:
    """One registry entry. `path` is absolute once read by load_dataset_registry."""
    name: str
    path: Optional[str] = None
    hub_id: Optional[str] = None
    split: str = "train"
    prompt_field: Optional[str] = None
    messages_field: Optional[str] = None
    answer_field: str = ""
    system_prompt: Optional[str] = None
    prompt_template: Optional[str] = None
    answer_extractor: str = "none"
    rewards: dict[str, float] = field(default_factory=dict)
    reward_kwargs: dict[str, dict] = field(default_factory=dict)
    max_samples: Optional[int] = None
    image_field: Optional[str] = None   # a column of image paths / bytes (see grpo/images.py)
    image_root: Optional[str] = None    # folder relative image paths are read from (default: the registry's)
    registry_folder: Optional[str] = field(default=None, compare=False, repr=False)  # set by the parser

    @property
    def source(self) -> str:
        """Where the rows come from, for messages."""
        return self.path or f"hub dataset '{self.hub_id}'"


ENTRY_KEYS = [f.name for f in fields(DatasetSpec) if f.name != "name" and f.compare]
_TEXT_KEYS = ("path", "hub_id", "split", "prompt_field", "messages_field", "answer_field", "system_prompt",
              "prompt_template", "answer_extractor", "image_field", "image_root")


# ------------------------------------------------------------------------------------------------ registry
def load_dataset_registry(path: str) -> dict[str, DatasetSpec]:
    """Parse and check the registry file; relative data paths become absolute (against the file's folder)."""
    raw = read_json_object(path, DatasetError, "--dataset_config_path")
    if not raw:
        raise DatasetError(f"--dataset_config_path: {path} registers no dataset; add an entry "
                           f"(see configs/dataset_config.json)")
    folder = os.path.dirname(os.path.abspath(path))
    return {name: _parse_entry(name, entry, folder, path) for name, entry in raw.items()}


def _parse_entry(name: str, entry, folder: str, registry_path: str) -> DatasetSpec:
    where = f"dataset '{name}' in {registry_path}"
    if not isinstance(entry, dict):
        raise DatasetError(f"{where}: the entry must be a JSON object {{\"path\": ..., \"rewards\": ...}}, "
                           f"got {json.dumps(entry)}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        hints = [f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, ENTRY_KEYS, 1)) else k
                 for k in unknown]
        raise DatasetError(f"{where}: unknown key(s) {', '.join(hints)}; valid keys: {', '.join(ENTRY_KEYS)}")
    values = {k: v for k, v in entry.items() if v is not None}  # null means "not set"
    for key in _TEXT_KEYS:
        if key in values and not isinstance(values[key], str):
            raise DatasetError(f"{where}: \"{key}\" must be a string, got {json.dumps(values[key])}")
    if bool(values.get("path")) == bool(values.get("hub_id")):
        raise DatasetError(f"{where}: give exactly one of \"path\" (a local file or folder) or \"hub_id\"")
    if bool(values.get("prompt_field")) == bool(values.get("messages_field")):
        raise DatasetError(f"{where}: give exactly one of \"prompt_field\" (a text column) or \"messages_field\" "
                           f"(a column of chat messages)")
    if not values.get("answer_field"):
        raise DatasetError(f"{where}: \"answer_field\" is required (the column holding the ground truth)")
    rewards = values.get("rewards")
    if not isinstance(rewards, dict) or not rewards or \
            not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in rewards.values()):
        raise DatasetError(f"{where}: \"rewards\" must map reward names to numeric weights, e.g. "
                           f"{{\"boxed_accuracy\": 1.0}}; got {json.dumps(rewards)}")
    kwargs = values.get("reward_kwargs", {})
    if not isinstance(kwargs, dict) or not all(isinstance(v, dict) for v in kwargs.values()):
        raise DatasetError(f"{where}: \"reward_kwargs\" must map reward names to objects of keyword arguments, "
                           f"e.g. {{\"format\": {{\"pattern\": \"...\"}}}}")
    max_samples = values.get("max_samples")
    if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                    or max_samples < 1):
        raise DatasetError(f"{where}: \"max_samples\" must be a positive integer or null, got "
                           f"{json.dumps(max_samples)}")
    _check_extractor(where, values.get("answer_extractor", "none"))
    template = values.get("prompt_template")
    if template is not None and "{prompt}" not in template:
        raise DatasetError(f"{where}: \"prompt_template\" must contain the placeholder {{prompt}} (where the "
                           f"question goes)")
    spec = DatasetSpec(name=name, **values)
    if spec.path:
        spec.path = os.path.normpath(os.path.join(folder, os.path.expanduser(spec.path)))
    if spec.image_root:
        spec.image_root = os.path.normpath(os.path.join(folder, os.path.expanduser(spec.image_root)))
    spec.registry_folder = folder
    return spec


def _check_extractor(where: str, extractor: str) -> None:
    if extractor in ("none", "gsm8k", "boxed"):
        return
    if not extractor.startswith("regex:"):
        raise DatasetError(f"{where}: unknown answer_extractor '{extractor}'; use one of {', '.join(EXTRACTORS)}")
    try:
        groups = re.compile(extractor[len("regex:"):]).groups
    except re.error as exc:
        raise DatasetError(f"{where}: the answer_extractor regex does not compile ({exc})") from None
    if groups < 1:
        raise DatasetError(f"{where}: the answer_extractor regex needs a capture group holding the answer, "
                           f"e.g. \"regex:answer: (\\\\d+)\"")


def dataset_routes(registry: dict[str, DatasetSpec],
                   names: Sequence[str]) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, dict]]]:
    """({dataset: {reward: weight}}, {dataset: {reward: kwargs}}) of the named datasets, for the reward router."""
    specs = [_lookup(registry, n) for n in names]
    return ({s.name: dict(s.rewards) for s in specs},
            {s.name: {reward: dict(kw) for reward, kw in s.reward_kwargs.items()} for s in specs})


def _lookup(registry: dict[str, DatasetSpec], name: str, registry_path: Optional[str] = None) -> DatasetSpec:
    if name not in registry:
        where = f" in {registry_path}" if registry_path else ""
        raise DatasetError(f"unknown dataset '{name}'; registered{where}: {', '.join(sorted(registry))} "
                           f"(add an entry to the registry file given by --dataset_config_path)")
    return registry[name]


# ------------------------------------------------------------------------------------------------- loading
def load_prompt_datasets(registry_path: str, names: Sequence[str], train_split_ratio: float,
                         seed: int, max_images_per_prompt: int = 1) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) rows with columns messages, answer, data_source.

    Each named dataset is split on its own (train_split_ratio of its rows for train, chosen by `seed`), then the
    train parts and the eval parts are concatenated in the order of `names`.
    """
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise DatasetError(f"--dataset_names: no dataset given; name one or more entries of {registry_path}")
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        raise DatasetError(f"--dataset_names: {', '.join(repeated)} listed more than once; name each dataset once")
    if not 0.0 < train_split_ratio <= 1.0:
        raise DatasetError(f"--train_split_ratio must be in (0, 1], got {train_split_ratio}")
    registry = load_dataset_registry(registry_path)
    specs = [_lookup(registry, n, registry_path) for n in names]  # every name checked before any file is read
    train_parts, eval_parts = [], []
    with _quiet_progress():
        for spec in specs:
            rows = _standardize(spec, _load_raw(spec), max_images_per_prompt)
            train, held_out = _split(rows, train_split_ratio, seed)
            if len(train) == 0:
                raise DatasetError(f"dataset '{spec.name}': the training split is empty ({len(rows)} rows with "
                                   f"--train_split_ratio {train_split_ratio}); add rows, raise max_samples or "
                                   f"raise --train_split_ratio")
            train_parts.append(train)
            eval_parts.append(held_out)
    if any("images" in part.column_names for part in train_parts):  # text rows of a mix get no images
        train_parts, eval_parts = _with_images_column(train_parts), _with_images_column(eval_parts)
    return datasets.concatenate_datasets(train_parts), datasets.concatenate_datasets(eval_parts)


def _with_images_column(parts: list[datasets.Dataset]) -> list[datasets.Dataset]:
    with _quiet_progress():
        return [part if "images" in part.column_names else
                part.add_column("images", [[] for _ in range(len(part))], feature=image_utils.IMAGE_FEATURE)
                for part in parts]


@contextlib.contextmanager
def _quiet_progress():
    """A few small builds and maps per run: their progress bars are noise in the training log."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _hub_offline() -> bool:
    return any(os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _load_raw(spec: DatasetSpec) -> datasets.Dataset:
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
        hint = GSM8K_SOURCE if "gsm8k" in (spec.name + path).lower() else "fix \"path\" in the registry"
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


# ------------------------------------------------------------------------------------------ standard rows
def _standardize(spec: DatasetSpec, raw: datasets.Dataset, max_images_per_prompt: int = 1) -> datasets.Dataset:
    if spec.max_samples is not None:
        raw = raw.select(range(min(spec.max_samples, len(raw))))
    if len(raw) == 0:
        raise DatasetError(f"dataset '{spec.name}' has no rows ({spec.source}); add rows or fix \"path\"")
    present = raw.column_names
    for key, column in (("prompt_field", spec.prompt_field), ("messages_field", spec.messages_field),
                        ("answer_field", spec.answer_field), ("image_field", spec.image_field)):
        if column and column not in present:
            raise DatasetError(f"dataset '{spec.name}': {key} '{column}' is not a column of {spec.source}; "
                               f"columns present: {', '.join(present)}")

    def to_row(example, index):
        if example[spec.answer_field] is None:
            raise DatasetError(f"dataset '{spec.name}': record {index + 1} of {spec.source} has no value in "
                               f"'{spec.answer_field}'; fill it in or drop the row")
        messages = build_messages(spec, example, index)
        return {"messages": messages, "images": image_utils.row_images(spec, example, index, messages),
                "answer": extract_answer(spec.answer_extractor, example[spec.answer_field]),
                "data_source": spec.name}

    raw = image_utils.undecoded(raw, spec.image_field)
    features = datasets.Features({**ROW_FEATURES, "images": image_utils.IMAGE_FEATURE})
    rows = raw.map(to_row, with_indices=True, remove_columns=present, features=features,
                   keep_in_memory=True, load_from_cache_file=False)
    if not any(rows["images"]):
        rows = rows.remove_columns("images")  # a text-only dataset: rows exactly as before
    else:
        image_utils.check_row_images(spec.name, spec.source, rows, max_images_per_prompt)
    unanswered = [i for i, answer in enumerate(rows["answer"]) if answer is None]
    if unanswered:
        first = unanswered[0]
        raise DatasetError(f"dataset '{spec.name}': answer_extractor '{spec.answer_extractor}' finds no answer in "
                           f"{len(unanswered)} of {len(rows)} rows of {spec.source} (first: record {first + 1}, "
                           f"{str(raw[first][spec.answer_field])[-80:]!r}); choose another answer_extractor "
                           f"({', '.join(EXTRACTORS)}) or fix those rows")
    return rows


def build_messages(spec: DatasetSpec, example: dict, index: int = 0) -> list[dict]:
    """Chat messages of the row at `index` (0-based): the system prompt first (unless the row has its own), the
    template applied to the last user message."""
    where = f"dataset '{spec.name}': record {index + 1} of {spec.source}"
    if spec.prompt_field:
        if example[spec.prompt_field] is None:
            raise DatasetError(f"{where} has no value in '{spec.prompt_field}'; fill it in or drop the row")
        messages = [{"role": "user", "content": str(example[spec.prompt_field])}]
    else:
        messages = _chat_messages(where, spec.messages_field, example[spec.messages_field])
    if spec.prompt_template:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise DatasetError(f"{where} has no user message to apply prompt_template to; give every row a "
                               f"{{\"role\": \"user\", ...}} message or drop prompt_template")
        last = users[-1]
        # replace, not str.format: templates hold other braces, such as \boxed{}
        messages[last]["content"] = spec.prompt_template.replace("{prompt}", messages[last]["content"])
    if spec.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": spec.system_prompt})
    return messages


def _chat_messages(where: str, column: str, value) -> list[dict]:
    fix = f"'{column}' must hold a non-empty list of {{\"role\": ..., \"content\": ...}} messages"
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: {fix}, got {type(value).__name__}")
    messages = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m.get("content") is None:
            raise DatasetError(f"{where}: {fix}, got the message {m!r}")
        content = m["content"]
        messages.append({"role": m["role"], "content": image_utils.content_text(content, where)
                         if isinstance(content, list) else str(content)})
    return messages


def extract_answer(extractor: str, value) -> Optional[str]:
    """The ground truth as a string, read from an answer-field value; None when the extractor finds nothing.

    none: the value itself; gsm8k: the text after the last '####', commas removed ("#### 1,000" -> "1000");
    boxed: the content of the last \\boxed{...} (nested braces kept); regex:<p>: group 1 of the last match of p.
    """
    text = str(value)
    if extractor == "gsm8k":
        found = text.rsplit("####", 1)[1].strip().replace(",", "") if "####" in text else None
    elif extractor == "boxed":
        found = last_boxed(text)
    elif extractor.startswith("regex:"):
        matches = list(re.finditer(extractor[len("regex:"):], text))
        found = matches[-1].group(1) if matches else None
    else:
        found = text
    found = found.strip() if found is not None else None
    return found or None


def _split(rows: datasets.Dataset, ratio: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """round(n * ratio) rows for train, the rest held out, chosen by `seed`; a ratio below 1 holds out at least
    one row (of two or more)."""
    n = len(rows)
    n_eval = n - round(n * ratio)
    if ratio < 1.0 and n > 1:
        n_eval = max(n_eval, 1)
    if n_eval == 0:
        return rows, rows.select([])
    if n_eval >= n:
        return rows.select([]), rows
    parts = rows.train_test_split(test_size=n_eval, seed=seed, shuffle=True, keep_in_memory=True)
    return parts["train"], parts["test"]


# ----------------------------------------------------------------------------------------------- rendering
def render_prompts(dataset: datasets.Dataset, tokenizer, max_prompt_length: int) -> datasets.Dataset:
    """Add prompt_text and prompt_ids: the tokenizer's chat template when it has one, else the message contents
    joined by blank lines. Prompts over max_prompt_length tokens raise DatasetError."""
    has_template = bool(getattr(tokenizer, "chat_template", None))

    def render(batch):
        if has_template:
            texts = [_apply_template(tokenizer, messages, source)
                     for messages, source in zip(batch["messages"], batch["data_source"])]
        else:
            texts = ["\n\n".join(m["content"] for m in messages) + "\n" for messages in batch["messages"]]
        # a chat template writes its own BOS / special tokens; plain text gets the tokenizer's usual ones
        ids = tokenizer(texts, add_special_tokens=not has_template)["input_ids"]
        return {"prompt_text": texts, "prompt_ids": ids}

    with _quiet_progress():
        rendered = dataset.map(render, batched=True, keep_in_memory=True, load_from_cache_file=False)
    _check_prompt_lengths(rendered, max_prompt_length)
    return rendered


def _apply_template(tokenizer, messages: list[dict], source: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja raises on role orders a template forbids
        raise DatasetError(f"dataset '{source}': the tokenizer's chat template rejects a prompt "
                           f"({type(exc).__name__}: {exc}); check the roles of its messages {messages!r}") from exc


def _check_prompt_lengths(rendered: datasets.Dataset, max_prompt_length: int) -> None:
    lengths = [len(ids) for ids in rendered["prompt_ids"]]
    sources = rendered["data_source"]
    too_long = Counter(source for source, n in zip(sources, lengths) if n > max_prompt_length)
    if not too_long:
        return
    longest = max(lengths)
    per_dataset = "".join(f"{count} in '{source}', " for source, count in sorted(too_long.items())) \
        if len(too_long) > 1 else ""
    raise DatasetError(f"dataset(s) {', '.join(sorted(too_long))}: {sum(too_long.values())} prompt(s) are longer "
                       f"than --max_prompt_length {max_prompt_length} tokens ({per_dataset}the longest has "
                       f"{longest}); pass --max_prompt_length {longest} (and raise --max_seq_length with it), or "
                       f"shorten the prompts (system_prompt, prompt_template, the data) or keep fewer rows with "
                       f"max_samples")
