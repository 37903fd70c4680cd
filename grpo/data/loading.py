"""Named registry datasets -> (train, eval) standard rows, each dataset checked before any model loads."""
from __future__ import annotations

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
