"""Dataset registry (configs/dataset_config.json) -> prompt rows {messages, answer, data_source} -> token ids.

Every check here runs before any model loads, and every error names the dataset, the file and the fix.
  registry.py  parse and check the registry file
  files.py     read a dataset's raw rows (local files, saved folders, the hub)
  rows.py      raw rows -> standard rows; the train / held-out split
  loading.py   named datasets -> (train, eval) rows; their demonstrations (--warm_start_steps)
  render.py    rows -> prompt text and token ids, within --max_prompt_length

The names below load on first use: the registry's checks run without importing `datasets`.
"""
import importlib

_WHERE = {
    "load_prompt_datasets": "grpo.data.loading", "load_demonstrations": "grpo.data.loading",
    "DatasetSpec": "grpo.data.registry", "EXTRACTORS": "grpo.data.registry",
    "check_dataset_names": "grpo.data.registry",
    "dataset_routes": "grpo.data.registry", "load_dataset_registry": "grpo.data.registry",
    "render_prompts": "grpo.data.render",
    "ROW_FEATURES": "grpo.data.rows", "build_messages": "grpo.data.rows", "extract_answer": "grpo.data.rows",
    "first_rows_per_source": "grpo.data.rows",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'grpo.data' has no attribute {name!r}")
