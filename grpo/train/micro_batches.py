"""Micro-batches of one optimizer step: which rows of the step's RolloutBatch go together through the model.

Rows are packed by a token budget (prompt + completion tokens per micro-batch, padding included), longest first,
so rows of similar length share a micro-batch and little padding is computed. Every micro-batch is cut to its
own widths: left padding that no row of it needs, and completion columns past its longest completion, go.

All ranks must run the same number of micro-batches per step (ZeRO-2/3 reduce gradients in collectives, and the
optimizer steps at one boundary), so a rank with fewer adds empty ones: one real row with an all-zero completion
mask, which contributes no loss and no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from grpo.train.step_data import RolloutBatch


@dataclass
class MicroBatch:
    rows: torch.Tensor     # [n] long: the step-batch rows it holds
    batch: RolloutBatch    # those rows, cut to their own prompt / completion widths
    empty: bool = False    # a filler so that every rank runs the same number of micro-batches

    def gather(self, per_row: torch.Tensor) -> torch.Tensor:
        """This micro-batch's part of a step-wide tensor: [N] -> [n], [N, T] -> [n, t]."""
        part = per_row[self.rows.to(per_row.device)]
        return part[:, :self.batch.completion_width] if part.dim() == 2 else part

    def scatter(self, values: torch.Tensor, into: torch.Tensor) -> None:
        """Write this micro-batch's [n, t] values into the step-wide [N, T] tensor `into` (fillers write nothing)."""
        if not self.empty:
            into[self.rows.to(into.device), :values.shape[1]] = values.to(into.device, into.dtype)


def row_lengths(batch: RolloutBatch) -> tuple[list[int], list[int]]:
    """Prompt and completion tokens of every row (padding excluded)."""
    width = batch.completion_width
    prompt = batch.attention_mask[:, :-width].sum(1).tolist()
    completion = batch.attention_mask[:, -width:].sum(1).tolist()
    return [int(p) for p in prompt], [int(c) for c in completion]


def pack_by_token_budget(prompt_lengths: list[int], completion_lengths: list[int],
                         max_tokens: int) -> list[list[int]]:
    """Row indices grouped so that each group's padded size  n x (max prompt + max completion)  stays within
    `max_tokens`: rows sorted longest first (prompt + completion), each added to the current group while the
    group fits, else it opens a new one. A row longer than the budget alone forms its own group.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(prompt_lengths)), key=lambda i: (-(prompt_lengths[i] + completion_lengths[i]), i))
    groups: list[list[int]] = []
    current: list[int] = []
    widest_prompt = widest_completion = 0
    for i in order:
        p, c = max(widest_prompt, prompt_lengths[i]), max(widest_completion, completion_lengths[i])
        if current and (len(current) + 1) * (p + c) > max_tokens:
            groups.append(current)
            current, p, c = [], prompt_lengths[i], completion_lengths[i]
        current.append(i)
        widest_prompt, widest_completion = p, c
    if current:
        groups.append(current)
    return groups


def fixed_row_groups(n_rows: int, rows_per_group: int) -> list[list[int]]:
    """Consecutive groups of `rows_per_group` rows (the last may be smaller)."""
    return [list(range(lo, min(lo + rows_per_group, n_rows))) for lo in range(0, n_rows, rows_per_group)]


def cut_rows(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """`rows` of the batch, without the prompt padding and completion columns none of them needs."""
    index = torch.tensor(rows, dtype=torch.long)
    width = batch.completion_width
    attention = batch.attention_mask[index]                                   # [n, P+T]
    prompt_width = attention.shape[1] - width
    prompt_len = int(attention[:, :prompt_width].sum(1).max()) if len(rows) else 0
    completion_len = max(1, int(attention[:, prompt_width:].sum(1).max())) if len(rows) else 1
    keep_cols = torch.arange(prompt_width - prompt_len, prompt_width + completion_len)

    columns = {"sequence": keep_cols, "completion": slice(0, completion_len), "row": None}

    def take(f):
        value, layout = getattr(batch, f.name), f.metadata["columns"]  # every field names its columns
        if value is None or layout == "shared":
            return value
        value = value[index.to(value.device)]
        return value if columns[layout] is None else value[:, columns[layout]]

    return RolloutBatch(**{f.name: take(f) for f in fields(batch)})


def micro_batch_groups(batch: RolloutBatch, max_tokens: Optional[int], rows_per_micro_batch: int) -> list[list[int]]:
    """Row indices of the step's micro-batches: by token budget when `max_tokens` is set (a vision row's image
    tokens count, and its images go with it: image inputs are built per micro-batch from its rows' prompts), else
    `rows_per_micro_batch` consecutive rows each."""
    if max_tokens:
        return pack_by_token_budget(*row_lengths(batch), max_tokens)
    return fixed_row_groups(len(batch.input_ids), rows_per_micro_batch)


def form_micro_batches(batch: RolloutBatch, groups: list[list[int]], count: Optional[int] = None,
                       device=None) -> list[MicroBatch]:
    """One MicroBatch per group of rows, on `device`; with `count` (the most micro-batches any rank has), empty
    fillers are added up to it."""
    def place(b: RolloutBatch) -> RolloutBatch:
        return b.to(device) if device is not None else b

    out = [MicroBatch(torch.tensor(g, dtype=torch.long), place(cut_rows(batch, g))) for g in groups]
    while count is not None and len(out) < count:
        filler = cut_rows(batch, [0])
        filler.completion_mask = torch.zeros_like(filler.completion_mask)
        out.append(MicroBatch(torch.tensor([0], dtype=torch.long), place(filler), empty=True))
    return out
