"""Eval bookkeeping: one sample row per eval prompt, and metrics in total (eval/...) and per dataset
(eval/<dataset>/...), so that held-out splits and eval-only datasets are reported apart."""
from __future__ import annotations

import numpy as np


def eval_sample_rows(rows: list[dict], texts: list[str], completions: list, result) -> list[dict]:
    """One row per prompt: its dataset, prompt, completion, answer, total and per-function rewards, length."""
    return [{"data_source": row["data_source"], "prompt": row["prompt_text"], "completion": text,
             "answer": row["answer"], "reward": result.total[i], "length": len(completion.token_ids),
             **{f"rewards/{name}": values[i] for name, values in result.per_function.items()}}
            for i, (row, text, completion) in enumerate(zip(rows, texts, completions))]


def eval_metrics(samples: list[dict]) -> dict[str, float]:
    """Mean reward, mean of each reward function (over the rows it scored) and mean completion length, over all
    samples and per data_source; eval/<dataset>/prompts counts each dataset's samples."""
    metrics = _summary(samples, "eval/")
    for source in sorted({s["data_source"] for s in samples}):
        rows = [s for s in samples if s["data_source"] == source]
        metrics.update(_summary(rows, f"eval/{source}/"))
        metrics[f"eval/{source}/prompts"] = float(len(rows))
    return metrics


def _summary(samples: list[dict], prefix: str) -> dict[str, float]:
    out = {f"{prefix}reward/mean": float(np.mean([s["reward"] for s in samples]))}
    # a reward function scores only its own datasets' rows: the others hold None
    for key in sorted({k for s in samples for k in s if k.startswith("rewards/")}):
        values = [s[key] for s in samples if s.get(key) is not None]
        if values:
            out[f"{prefix}{key}"] = float(np.mean(values))
    out[f"{prefix}completion/length_mean"] = float(np.mean([s["length"] for s in samples]))
    return out
