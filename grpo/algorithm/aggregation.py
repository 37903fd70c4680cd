"""Masked means and the loss aggregations (how per-token terms become one scalar per step).

Shapes: N = completions (B prompts x group size G), T = completion tokens, V = vocabulary.
"""
from __future__ import annotations

from typing import Optional

import torch

from grpo.algorithm.registry import AGGREGATIONS


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of `values` where `mask` is nonzero, over all entries or along `dim`; 0 (not NaN) where the mask is empty.

        masked_mean(x, m) = sum(m * x) / max(sum(m), 1)
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def aggregation_normaliser(mask: torch.Tensor, aggregation: str = "token_mean",
                           max_completion_length: Optional[int] = None) -> float:
    """The denominator D of an aggregation over the rows of `mask` [N, T] (see `aggregate`):

        token_mean:              D = sum_{i,t} m_it                     (completion tokens)
        seq_mean_token_mean:     D = #{i : sum_t m_it > 0}               (sequences with >= 1 token)
        seq_mean_token_sum_norm: D = max_completion_length * #{i : sum_t m_it > 0}   (a constant per sequence)
    A row without tokens (masked out, or a truncated completion under --mask_truncated_completions) counts in
    neither mean. D is additive over disjoint sets of rows: the D of an optimizer step is the sum of the D of its micro-batches
    over all ranks, so each micro-batch can be normalised by the step's D (`aggregate(..., normaliser=D)`).
    """
    _check_aggregation(aggregation, max_completion_length)
    if aggregation == "token_mean":
        return float(mask.sum())
    rows_with_tokens = float((mask.sum(dim=1) > 0).sum())
    if aggregation == "seq_mean_token_mean":
        return rows_with_tokens
    return float(max_completion_length) * rows_with_tokens


def aggregation_numerator(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "token_mean") -> torch.Tensor:
    """The numerator S of an aggregation over the rows of `per_token` / `mask` [N, T]; additive over rows:

        token_mean, seq_mean_token_sum_norm:  S = sum_{i,t} m_it x_it
        seq_mean_token_mean:                  S = sum_i sum_t m_it x_it / max(sum_t m_it, 1)
    """
    mask = mask.to(per_token.dtype)                                       # [N, T]
    if aggregation == "seq_mean_token_mean":
        return masked_mean(per_token, mask, dim=1).sum()                  # rows without tokens add 0
    return (per_token * mask).sum()


def _check_aggregation(aggregation: str, max_completion_length: Optional[int]) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation '{aggregation}' (use one of {', '.join(AGGREGATIONS)})")
    if aggregation == "seq_mean_token_sum_norm" and (max_completion_length is None or max_completion_length <= 0):
        raise ValueError("aggregation 'seq_mean_token_sum_norm' needs max_completion_length > 0 "
                         f"(the constant that replaces the per-sequence length), got {max_completion_length}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "token_mean",
              max_completion_length: Optional[int] = None, normaliser: Optional[float] = None) -> torch.Tensor:
    """Reduce a per-token quantity [N, T] under a mask [N, T] to one number,  S / max(D, 1):

        token_mean:              sum_{i,t} m_it x_it / sum_{i,t} m_it                    (DAPO)
        seq_mean_token_mean:     mean over sequences with >= 1 token of sum_t m_it x_it / sum_t m_it   (GRPO)
        seq_mean_token_sum_norm: mean over sequences with >= 1 token of sum_t m_it x_it / max_completion_length
                                 (Dr. GRPO)
    S = `aggregation_numerator`, D = `normaliser` if given (the whole optimizer step's D, so that the micro-batch
    results sum to the step's aggregate), else `aggregation_normaliser` of these rows.
    """
    _check_aggregation(aggregation, max_completion_length)
    if normaliser is None:
        normaliser = aggregation_normaliser(mask, aggregation, max_completion_length)
    return aggregation_numerator(per_token, mask, aggregation) / max(float(normaliser), 1.0)
