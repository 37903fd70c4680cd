"""Raw rows -> the standard rows {messages, answer, data_source} every dataset shares; the train / held-out split."""
from __future__ import annotations

import re
from typing import Optional

import datasets

from grpo.data import images as image_utils
from grpo.data.files import map_fingerprint
from grpo.errors import DatasetError
from grpo.rewards import last_boxed
from grpo.data.registry import EXTRACTORS, DatasetSpec

# One schema for every dataset, so that datasets of different origins concatenate.
ROW_FEATURES = datasets.Features({
    "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
    "answer": datasets.Value("string"),
    "data_source": datasets.Value("string"),
})


def standardize(spec: DatasetSpec, raw: datasets.Dataset, max_images_per_prompt: int = 1) -> datasets.Dataset:
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
                   keep_in_memory=True, load_from_cache_file=False,
                   new_fingerprint=map_fingerprint(raw, "standardize", spec))
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


def split_rows(rows: datasets.Dataset, ratio: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
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


def first_rows_per_source(rows: datasets.Dataset, limit: int) -> datasets.Dataset:
    """The first `limit` rows of each data_source (all rows when limit is -1), in their order."""
    if limit < 0:
        return rows
    seen: dict[str, int] = {}
    keep = []
    for index, source in enumerate(rows["data_source"]):
        seen[source] = seen.get(source, 0) + 1
        if seen[source] <= limit:
            keep.append(index)
    return rows if len(keep) == len(rows) else rows.select(keep)
