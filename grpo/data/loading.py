"""Named registry datasets -> (train, eval) standard rows, each dataset checked before any model loads."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import datasets

from grpo.data import images as image_utils
from grpo.data.files import load_raw, quiet_progress
from grpo.errors import DatasetError
from grpo.data.registry import check_dataset_names, load_dataset_registry
from grpo.data.rows import split_rows, standardize


def load_prompt_datasets(registry_path: str, names: Sequence[str], train_split_ratio: float, seed: int,
                         eval_names: Sequence[str] = (), max_images_per_prompt: int = 1,
                         ) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) rows with columns messages, answer, data_source.

    Each named dataset is split on its own (train_split_ratio of its rows for train, chosen by `seed`); the eval
    rows are the held-out parts followed by every row of the `eval_names` datasets, which are never trained on.
    Parts are concatenated in the order the names are given; every row's data_source names its dataset.
    """
    registry = load_dataset_registry(registry_path)
    # every name checked before any file is read
    names, eval_names = check_dataset_names(registry, registry_path, names, eval_names, train_split_ratio)
    specs = [registry[n] for n in names]
    eval_specs = [registry[n] for n in eval_names]
    train_parts, eval_parts = [], []
    with quiet_progress():
        for spec in specs:
            rows = standardize(spec, load_raw(spec), max_images_per_prompt)
            train, held_out = split_rows(rows, train_split_ratio, seed)
            if len(train) == 0:
                raise DatasetError(f"dataset '{spec.name}': the training split is empty ({len(rows)} rows with "
                                   f"--train_split_ratio {train_split_ratio}); add rows, raise max_samples or "
                                   f"raise --train_split_ratio")
            train_parts.append(train)
            eval_parts.append(held_out)
        eval_parts += [standardize(spec, load_raw(spec), max_images_per_prompt) for spec in eval_specs]
    if any("images" in part.column_names for part in train_parts + eval_parts):  # text rows of a mix: no images
        train_parts, eval_parts = _with_images_column(train_parts), _with_images_column(eval_parts)
    return datasets.concatenate_datasets(train_parts), datasets.concatenate_datasets(eval_parts)


def _with_images_column(parts: list[datasets.Dataset]) -> list[datasets.Dataset]:
    with quiet_progress():
        return [part if "images" in part.column_names else
                part.add_column("images", [[] for _ in range(len(part))], feature=image_utils.IMAGE_FEATURE)
                for part in parts]


DEMONSTRATION_COLUMN = "demonstration"


def load_demonstrations(registry_path: str, names: Sequence[str]) -> datasets.Dataset:
    """Standard rows plus a `demonstration` column (the model's turns, as strings) from the "demonstrations" files
    of the named datasets: the same fields as the dataset's own rows (prompt, answer), so they render the same way.
    Datasets without demonstrations are skipped; none at all is an error naming the key to add."""
    registry = load_dataset_registry(registry_path)
    specs = [registry[n] for n in dict.fromkeys(names) if n in registry and registry[n].demonstrations]
    if not specs:
        raise DatasetError(f"--warm_start_steps: none of the datasets {', '.join(names)} has \"demonstrations\" in "
                           f"{registry_path}; add that key (a file of rows with the model's turns written out, "
                           f"e.g. data/arith/calc_demonstrations.jsonl) or drop --warm_start_steps")
    parts = []
    with quiet_progress():
        for spec in specs:
            source = dataclasses.replace(spec, path=spec.demonstrations, hub_id=None, max_samples=None,
                                         image_field=None)
            raw = load_raw(source)
            turns = _demonstration_turns(source, raw)
            parts.append(standardize(source, raw).add_column(DEMONSTRATION_COLUMN, turns))
    return datasets.concatenate_datasets(parts)


def _demonstration_turns(spec, raw: datasets.Dataset) -> list[list[str]]:
    """Each row's `demonstration`: a non-empty list of the model's turns (strings), checked row by row."""
    if DEMONSTRATION_COLUMN not in raw.column_names:
        raise DatasetError(f"dataset '{spec.name}': its demonstrations {spec.path} have no \"{DEMONSTRATION_COLUMN}\" "
                           f"column; give each row the model's turns, e.g. \"{DEMONSTRATION_COLUMN}\": [\"<tool_call>"
                           f"...</tool_call>\", \"The answer is \\\\boxed{{41}}.\"]")
    turns = raw[DEMONSTRATION_COLUMN]
    for index, value in enumerate(turns):
        if not (isinstance(value, list) and value and all(isinstance(t, str) and t for t in value)):
            raise DatasetError(f"dataset '{spec.name}': record {index + 1} of {spec.path}: \"{DEMONSTRATION_COLUMN}\" "
                               f"must be a non-empty list of the model's turns (non-empty strings), got "
                               f"{str(value)[:120]!r}")
    return turns
