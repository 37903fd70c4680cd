"""Datasets whose rows run as multi-turn episodes (a registry entry with "tools" and/or an "environment"): checked
before any model loads, and their prompts given the tools (through the chat template's `tools=`, or a system prompt
where the template ignores them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import datasets

from grpo.data.files import quiet_progress
from grpo.data.registry import DatasetSpec
from grpo.errors import ConfigError


@dataclass
class EpisodeDataset:
    """What one dataset's episodes need: its tools (names and schemas) and its environment."""
    tools: list[str]
    environment: Callable
    schemas: list[dict] = field(default_factory=list)


def check_episode_datasets(config, registry: dict[str, DatasetSpec], names) -> dict[str, EpisodeDataset]:
    """{dataset name: EpisodeDataset} of the named datasets that have tools or an environment; --tool_module
    imported. Unknown tools or environments, a missing module, and what does not work with episodes yet are one
    clear error each, raised before the tokenizer or any model loads. grpo.tools (whose built-in tools describe
    themselves through transformers) is imported only for a run that has tools."""
    episodes = [name for name in dict.fromkeys(names)
                if registry.get(name) is not None and (registry[name].tools or registry[name].environment)]
    if not (episodes or config.tool_module):
        return {}
    from grpo.tools import ToolError, check_environment, check_tools
    from grpo.tools.registry import load_tool_module
    from grpo.tools.sandbox import allow_unsandboxed_code

    allow_unsandboxed_code(getattr(config, "allow_unsandboxed_code", False))

    if config.tool_module:
        load_tool_module(config.tool_module)  # also for a module of environments only, or imported for its side
    out: dict[str, EpisodeDataset] = {}
    for name in episodes:
        spec = registry[name]
        where = f"dataset '{name}' in {config.dataset_config_path}"
        try:
            tools = check_tools(spec.tools)
            environment = check_environment(spec.environment)
        except ToolError as exc:  # the message says which --tool_module was imported and how to add the name
            message = str(exc)
            if config.tool_module:  # imported above, once for every dataset
                message = message.replace("(no --tool_module given)", f"(after importing {config.tool_module})")
            raise ToolError(f"{where}: {message}") from None
        if spec.image_field:
            raise ConfigError(f"{where}: tools and environments are for text prompts; this entry has an "
                              "\"image_field\" (vision-language episodes are not supported yet)")
        out[name] = EpisodeDataset([t.name for t in tools], environment, [t.schema for t in tools])
    return out


def run_episode_datasets(config, registry: dict[str, DatasetSpec]) -> dict[str, EpisodeDataset]:
    """check_episode_datasets over the datasets a run trains and evaluates on: the trainer and server mode's rollout
    ranks (which run the episodes) both ask this."""
    return check_episode_datasets(config, registry, config.dataset_names + config.eval_dataset_names)


def prompts_with_tools(rows: datasets.Dataset, tokenizer, episode_datasets: dict[str, EpisodeDataset]):
    """The rows ready for render_prompts, and {data_source: tool schemas} to pass as the chat template's `tools=`.

    A template that renders `tools=` gets the schemas that way; one that ignores them (plain ChatML, SmolLM2's) gets
    the same instructions (grpo.tools.tools_system_prompt) appended to the system message of that dataset's rows."""
    if not episode_datasets or len(rows) == 0:
        return rows, {}
    from grpo.tools import template_shows_tools, tools_system_prompt

    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"dataset(s) {', '.join(sorted(episode_datasets))}: multi-turn episodes need a tokenizer "
                          "with a chat template (to render the tool results and the model's next turn); this model's "
                          "tokenizer has none")
    in_template: dict[str, list[dict]] = {}
    in_system: dict[str, str] = {}
    for name, dataset in episode_datasets.items():
        if not dataset.schemas:
            continue
        if template_shows_tools(tokenizer, dataset.schemas):
            in_template[name] = dataset.schemas
        else:
            in_system[name] = tools_system_prompt(dataset.schemas)
    if not in_system:
        return rows, in_template

    def add_system_prompt(row):
        extra = in_system.get(row["data_source"])
        if extra is None:
            return row
        messages = [dict(m) for m in row["messages"]]
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{extra}"
        else:
            messages.insert(0, {"role": "system", "content": extra})
        return {**row, "messages": messages}

    with quiet_progress():
        rows = rows.map(add_system_prompt, keep_in_memory=True, load_from_cache_file=False)
    return rows, in_template
