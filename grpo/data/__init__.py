"""Dataset registry (configs/dataset_config.json) -> prompt rows {messages, answer, data_source} -> token ids.

Every check here runs before any model loads, and every error names the dataset, the file and the fix.
  registry.py  parse and check the registry file
  files.py     read a dataset's raw rows (local files, saved folders, the hub)
  rows.py      raw rows -> standard rows; the train / held-out split
  loading.py   named datasets -> (train, eval) rows
  render.py    rows -> prompt text and token ids, within --max_prompt_length
"""
from grpo.data.loading import load_prompt_datasets
from grpo.data.registry import EXTRACTORS, DatasetSpec, dataset_routes, load_dataset_registry
from grpo.data.render import render_prompts
from grpo.data.rows import ROW_FEATURES, build_messages, extract_answer, first_rows_per_source

__all__ = ["DatasetSpec", "EXTRACTORS", "ROW_FEATURES", "build_messages", "dataset_routes", "extract_answer",
           "first_rows_per_source", "load_dataset_registry", "load_prompt_datasets", "render_prompts"]
