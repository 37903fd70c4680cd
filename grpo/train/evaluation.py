"""Evaluation on the held-out prompts (the held-out split and eval-only datasets): completions from the rollout
engine, sharded over ranks, one sample row per prompt, and metrics in total (eval/...) and per dataset
(eval/<dataset>/...), so that each dataset is reported apart."""
from __future__ import annotations

import numpy as np

from grpo.rollout.episodes import episode_metrics
from grpo.runtime import distributed as dist_utils


def evaluate_prompts(eval_set, rollouts, rank: int, world: int) -> tuple[dict[str, float], list[dict]]:
    """Metrics and every rank's sample rows for `eval_set` (collective: every rank calls it), each rank generating
    for its share of the prompts (rank, rank + world, ...)."""
    rows = [eval_set[i] for i in range(rank, len(eval_set), world)]
    completions, texts, result = rollouts.evaluate(rows)
    samples = eval_sample_rows(rows, texts, completions, result) if rows else []
    all_samples = [s for part in dist_utils.gather_objects(samples) for s in part]
    metrics = eval_metrics(all_samples)
    if rollouts.episode_datasets:
        metrics.update(eval_episode_metrics(rollouts.eval_episodes))
    if getattr(rollouts, "agents", None):
        metrics.update(eval_agent_metrics(rollouts.eval_agent_episodes))
    return metrics, all_samples


def eval_episode_metrics(episodes: list) -> dict[str, float]:
    """eval/episodes/...: episode_metrics over every rank's eval episodes (collective)."""
    local = episode_metrics(episodes)
    totals = dist_utils.all_sum([value * len(episodes) for value in local.values()] + [float(len(episodes))])
    count = totals[-1]
    return {f"eval/{key}": total / count for key, total in zip(local, totals)} if count else {}


def eval_agent_metrics(episodes: list) -> dict[str, float]:
    """eval/agents/...: grpo.agents.runner.agent_metrics over every rank's eval episodes (collective), the count of
    episodes summed."""
    from grpo.agents.runner import agent_metrics

    local = agent_metrics(episodes)
    means = [key for key in local if key != "agents/episodes"]
    totals = dist_utils.all_sum([local[key] * len(episodes) for key in means] + [float(len(episodes))])
    count = totals[-1]
    if not count:
        return {}
    return {"eval/agents/episodes": count, **{f"eval/{key}": total / count for key, total in zip(means, totals)}}


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
