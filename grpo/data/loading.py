"""Named registry datasets -> (train, eval) standard rows, each dataset checked before any model loads."""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import datasets

from grpo.data import images as image_utils
from grpo.errors import DatasetError
from grpo.data.files import load_raw, quiet_progress
from grpo.data.registry import load_dataset_registry, lookup
from grpo.data.rows import split_rows, standardize


def load_prompt_datasets(registry_path: str, names: Sequence[str], train_split_ratio: float, seed: int,
                         eval_names: Sequence[str] = (), max_images_per_prompt: int = 1,
                         ) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) rows with columns messages, answer, data_source.

    Each named dataset is split on its own (train_split_ratio of its rows for train, chosen by `seed`); the eval
    rows are the held-out parts followed by every row of the `eval_names` datasets, which are never trained on.
    Parts are concatenated in the order the names are given; every row's data_source names its dataset.
    """
    names, eval_names = _name_list(names), _name_list(eval_names)
    if not names:
        raise DatasetError(f"--dataset_names: no dataset given; name one or more entries of {registry_path}")
    _check_once("--dataset_names", names)
    _check_once("--eval_dataset_names", eval_names)
    both = [n for n in eval_names if n in names]
    if both:
        raise DatasetError(f"--eval_dataset_names: {', '.join(both)} is also in --dataset_names; evaluate on a "
                           f"separately registered file, or hold out part of it with --train_split_ratio")
    if not 0.0 < train_split_ratio <= 1.0:
        raise DatasetError(f"--train_split_ratio must be in (0, 1], got {train_split_ratio}")
    registry = load_dataset_registry(registry_path)
    # every name checked before any file is read
    specs = [lookup(registry, n, registry_path) for n in names]
    eval_specs = [lookup(registry, n, registry_path) for n in eval_names]
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


def _name_list(names) -> list[str]:
    return [names] if isinstance(names, str) else list(names)


def _check_once(flag: str, names: list[str]) -> None:
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        raise DatasetError(f"{flag}: {', '.join(repeated)} listed more than once; name each dataset once")
