"""Staleness of streamed rollouts (server mode, --max_staleness K): pure functions over the policy version of each
sampled token.

A version is a count of optimizer steps: the step that trains at version s (the policy after s updates) reads a token
sampled by version v as s - v versions behind. A group (the k completions of one prompt) is as stale as its oldest
token; a group more than K behind is not trained on (the collector generates it again, see collect.py).
"""
from __future__ import annotations

from typing import Optional, Sequence


def group_staleness(versions: Sequence[Optional[Sequence[int]]], group_size: int, current: int) -> list[int]:
    """Per group of `group_size` consecutive completions: current - its oldest token's version (0 for a group with no
    token or no versions). versions: per completion, its tokens' versions (or None)."""
    if len(versions) % group_size:
        raise ValueError(f"{len(versions)} completions do not form groups of {group_size}")
    out = []
    for start in range(0, len(versions), group_size):
        oldest = [min(v) for v in versions[start:start + group_size] if v]
        out.append(current - min(oldest) if oldest else 0)
    return out


def groups_over_bound(staleness: Sequence[int], bound: int) -> list[int]:
    """Indices of the groups more than `bound` versions behind."""
    return [g for g, s in enumerate(staleness) if s > bound]


def staleness_metrics(versions: Sequence[Optional[Sequence[int]]], current: int) -> dict:
    """What a step's tokens say about the stream (empty when no completion carries versions):
      stream/staleness_mean, _max   versions behind, over every sampled token
      stream/partial_share          the share of completions sampled by more than one version (partial rollouts)
      stream/tokens_version_<d>     tokens sampled d versions behind (d = 0 .. max): the per-step histogram
    """
    known = [v for v in versions if v is not None]
    if not known:
        return {}
    behind = [current - t for v in known for t in v]
    metrics = {"stream/partial_share": sum(len(set(v)) > 1 for v in known) / len(known)}
    if behind:
        metrics.update({"stream/staleness_mean": sum(behind) / len(behind), "stream/staleness_max": float(max(behind))})
        for d in range(max(behind) + 1):
            metrics[f"stream/tokens_version_{d}"] = float(sum(b == d for b in behind))
    return metrics



def sampled_versions(versions: Optional[Sequence[int]], mask: Optional[Sequence[int]]) -> Optional[list[int]]:
    """The versions of the tokens the policy sampled: an episode's environment tokens (mask 0) are left out."""
    if versions is None or mask is None:
        return None if versions is None else list(versions)
    return [v for v, m in zip(versions, mask) if m]
