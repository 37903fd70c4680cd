"""Prompt rendering: chat template (or plain text) -> prompt_text and prompt_ids, with the length limit."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Optional

import datasets

from grpo.errors import DatasetError
from grpo.data.files import map_fingerprint, quiet_progress

logger = logging.getLogger("grpo")


def render_prompts(dataset: datasets.Dataset, tokenizer, max_prompt_length: int, filter_overlong: bool = False,
                   split: str = "train", tools_by_source: Optional[dict] = None) -> datasets.Dataset:
    """Add prompt_text and prompt_ids: the tokenizer's chat template when it has one, else the message contents
    joined by blank lines. Prompts over max_prompt_length tokens raise DatasetError, or with `filter_overlong` are
    dropped, with one log line per dataset (`split` names the rows in it: train or eval). `tools_by_source`: the
    tool schemas the chat template shows the rows of each dataset (its `tools=`)."""
    tools_by_source = tools_by_source or {}
    has_template = bool(getattr(tokenizer, "chat_template", None))

    def render(batch):
        if has_template:
            texts = [_apply_template(tokenizer, messages, source, tools_by_source.get(source))
                     for messages, source in zip(batch["messages"], batch["data_source"])]
        else:
            texts = ["\n\n".join(m["content"] for m in messages) + "\n" for messages in batch["messages"]]
        # a chat template writes its own BOS / special tokens; plain text gets the tokenizer's usual ones
        ids = tokenizer(texts, add_special_tokens=not has_template)["input_ids"]
        return {"prompt_text": texts, "prompt_ids": ids}

    with quiet_progress():
        fingerprint = map_fingerprint(dataset, "render_prompts", tokenizer.name_or_path, len(tokenizer),
                                      getattr(tokenizer, "chat_template", None))
        rendered = dataset.map(render, batched=True, keep_in_memory=True, load_from_cache_file=False,
                               new_fingerprint=fingerprint)
    return enforce_prompt_length(rendered, max_prompt_length, filter_overlong, split)


def enforce_prompt_length(rendered: datasets.Dataset, max_prompt_length: int, filter_overlong: bool,
                          split: str) -> datasets.Dataset:
    """Rendered rows with none over max_prompt_length: an error naming the datasets, or (filter_overlong) the
    overlong rows dropped with one log line per dataset."""
    if filter_overlong:
        return _drop_overlong(rendered, max_prompt_length, split)
    _check_prompt_lengths(rendered, max_prompt_length)
    return rendered


def _apply_template(tokenizer, messages: list[dict], source: str, tools: Optional[list] = None) -> str:
    try:
        if tools:
            return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja raises on role orders a template forbids
        raise DatasetError(f"dataset '{source}': the tokenizer's chat template rejects a prompt "
                           f"({type(exc).__name__}: {exc}); check the roles of its messages {messages!r}") from exc


def _check_prompt_lengths(rendered: datasets.Dataset, max_prompt_length: int) -> None:
    lengths = [len(ids) for ids in rendered["prompt_ids"]]
    sources = rendered["data_source"]
    too_long = Counter(source for source, n in zip(sources, lengths) if n > max_prompt_length)
    if not too_long:
        return
    longest = max(lengths)
    per_dataset = "".join(f"{count} in '{source}', " for source, count in sorted(too_long.items())) \
        if len(too_long) > 1 else ""
    raise DatasetError(f"dataset(s) {', '.join(sorted(too_long))}: {sum(too_long.values())} prompt(s) are longer "
                       f"than --max_prompt_length {max_prompt_length} tokens ({per_dataset}the longest has "
                       f"{longest}); pass --max_prompt_length {longest} (and raise --max_seq_length with it), or "
                       f"shorten the prompts (system_prompt, prompt_template, the data), keep fewer rows with "
                       f"max_samples, or drop the long ones with --filter_overlong_prompts")


def _drop_overlong(rendered: datasets.Dataset, max_prompt_length: int, split: str) -> datasets.Dataset:
    """Keep the prompts within the limit; say per dataset how many went, and stop if one loses every row."""
    lengths = [len(ids) for ids in rendered["prompt_ids"]]
    sources = rendered["data_source"]
    by_source: dict[str, list[int]] = {}
    for source, n in zip(sources, lengths):
        by_source.setdefault(source, []).append(n)
    for source, source_lengths in by_source.items():
        kept = [n for n in source_lengths if n <= max_prompt_length]
        if not kept:
            raise DatasetError(f"dataset '{source}' ({split}): all {len(source_lengths)} prompts are longer than "
                               f"--max_prompt_length {max_prompt_length} tokens (the shortest has "
                               f"{min(source_lengths)}), so --filter_overlong_prompts leaves none; raise "
                               f"--max_prompt_length (and --max_seq_length with it) or shorten the prompts "
                               f"(system_prompt, prompt_template)")
        logger.info(f"{split} dataset '{source}': dropped {len(source_lengths) - len(kept)} of "
                    f"{len(source_lengths)} prompts longer than --max_prompt_length {max_prompt_length}; "
                    f"the longest kept has {max(kept)} tokens")
    keep = [i for i, n in enumerate(lengths) if n <= max_prompt_length]
    return rendered if len(keep) == len(rendered) else rendered.select(keep)