"""The registry file (configs/dataset_config.json): entries parsed and checked into DatasetSpecs."""
from __future__ import annotations

import difflib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

from grpo.errors import DatasetError
from grpo.config.json_files import read_json_object

EXTRACTORS = ("none", "gsm8k", "boxed", "regex:<pattern>")


@dataclass
class DatasetSpec:
    """One registry entry. `path` is absolute once read by load_dataset_registry."""
    name: str
    path: Optional[str] = None
    hub_id: Optional[str] = None
    split: str = "train"
    prompt_field: Optional[str] = None
    messages_field: Optional[str] = None
    answer_field: str = ""
    system_prompt: Optional[str] = None
    prompt_template: Optional[str] = None
    answer_extractor: str = "none"
    rewards: dict[str, float] = field(default_factory=dict)
    reward_kwargs: dict[str, dict] = field(default_factory=dict)
    max_samples: Optional[int] = None
    image_field: Optional[str] = None   # a column of image paths / bytes (see grpo/images.py)
    image_root: Optional[str] = None    # folder relative image paths are read from (default: the registry's)
    tools: list[str] = field(default_factory=list)  # tool names the model may call (multi-turn episodes)
    environment: Optional[str] = None   # a registered environment that answers the model's turns (docs/tools.md)
    agent: Optional[str] = None         # a registered agent on the OpenAI API that plays each episode (docs/agents.md)
    demonstrations: Optional[str] = None  # rows with the model's turns written out, for --warm_start_steps
    registry_folder: Optional[str] = field(default=None, compare=False, repr=False)  # set by the parser

    @property
    def source(self) -> str:
        """Where the rows come from, for messages."""
        return self.path or f"hub dataset '{self.hub_id}'"


ENTRY_KEYS = [f.name for f in fields(DatasetSpec) if f.name != "name" and f.compare]
_TEXT_KEYS = ("path", "hub_id", "split", "prompt_field", "messages_field", "answer_field", "system_prompt",
              "prompt_template", "answer_extractor", "image_field", "image_root", "demonstrations", "agent")


# ------------------------------------------------------------------------------------------------ registry
def load_dataset_registry(path: str) -> dict[str, DatasetSpec]:
    """Parse and check the registry file; relative data paths become absolute (against the file's folder)."""
    raw = read_json_object(path, DatasetError, "--dataset_config_path")
    if not raw:
        raise DatasetError(f"--dataset_config_path: {path} registers no dataset; add an entry "
                           f"(see configs/dataset_config.json)")
    folder = os.path.dirname(os.path.abspath(path))
    return {name: _parse_entry(name, entry, folder, path) for name, entry in raw.items()}


def _parse_entry(name: str, entry, folder: str, registry_path: str) -> DatasetSpec:
    where = f"dataset '{name}' in {registry_path}"
    if not isinstance(entry, dict):
        raise DatasetError(f"{where}: the entry must be a JSON object {{\"path\": ..., \"rewards\": ...}}, "
                           f"got {json.dumps(entry)}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        hints = [f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, ENTRY_KEYS, 1)) else k
                 for k in unknown]
        raise DatasetError(f"{where}: unknown key(s) {', '.join(hints)}; valid keys: {', '.join(ENTRY_KEYS)}")
    values = {k: v for k, v in entry.items() if v is not None}  # null means "not set"
    for key in _TEXT_KEYS:
        if key in values and not isinstance(values[key], str):
            raise DatasetError(f"{where}: \"{key}\" must be a string, got {json.dumps(values[key])}")
    if bool(values.get("path")) == bool(values.get("hub_id")):
        raise DatasetError(f"{where}: give exactly one of \"path\" (a local file or folder) or \"hub_id\"")
    if bool(values.get("prompt_field")) == bool(values.get("messages_field")):
        raise DatasetError(f"{where}: give exactly one of \"prompt_field\" (a text column) or \"messages_field\" "
                           f"(a column of chat messages)")
    if not values.get("answer_field"):
        raise DatasetError(f"{where}: \"answer_field\" is required (the column holding the ground truth)")
    rewards = values.get("rewards")
    if not isinstance(rewards, dict) or not rewards or \
            not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in rewards.values()):
        raise DatasetError(f"{where}: \"rewards\" must map reward names to numeric weights, e.g. "
                           f"{{\"boxed_accuracy\": 1.0}}; got {json.dumps(rewards)}")
    kwargs = values.get("reward_kwargs", {})
    if not isinstance(kwargs, dict) or not all(isinstance(v, dict) for v in kwargs.values()):
        raise DatasetError(f"{where}: \"reward_kwargs\" must map reward names to objects of keyword arguments, "
                           f"e.g. {{\"format\": {{\"pattern\": \"...\"}}}}")
    max_samples = values.get("max_samples")
    if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                    or max_samples < 1):
        raise DatasetError(f"{where}: \"max_samples\" must be a positive integer or null, got "
                           f"{json.dumps(max_samples)}")
    _check_extractor(where, values.get("answer_extractor", "none"))
    _check_episode_keys(where, values)
    template = values.get("prompt_template")
    if template is not None and "{prompt}" not in template:
        raise DatasetError(f"{where}: \"prompt_template\" must contain the placeholder {{prompt}} (where the "
                           f"question goes)")
    spec = DatasetSpec(name=name, **values)
    if spec.path:
        spec.path = os.path.normpath(os.path.join(folder, os.path.expanduser(spec.path)))
    if spec.image_root:
        spec.image_root = os.path.normpath(os.path.join(folder, os.path.expanduser(spec.image_root)))
    if spec.demonstrations:
        spec.demonstrations = os.path.normpath(os.path.join(folder, os.path.expanduser(spec.demonstrations)))
    spec.registry_folder = folder
    return spec


def _check_episode_keys(where: str, values: dict) -> None:
    """"tools": a list of tool names; "environment", "agent": a name. Whether they are registered is checked once
    --tool_module / --agent_module is imported (grpo.data.episode_datasets, grpo.train.agent_setup)."""
    tools = values.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, str) and t for t in tools):
        raise DatasetError(f"{where}: \"tools\" must be a list of tool names, e.g. [\"calculator\"]; got "
                           f"{json.dumps(tools)}")
    if len(set(tools)) != len(tools):
        raise DatasetError(f"{where}: \"tools\" names a tool more than once: {json.dumps(tools)}")
    environment = values.get("environment")
    if environment is not None and (not isinstance(environment, str) or not environment.strip()):
        raise DatasetError(f"{where}: \"environment\" must be the name of a registered environment; got "
                           f"{json.dumps(environment)}")
    agent = values.get("agent")
    if agent is not None and not agent.strip():
        raise DatasetError(f"{where}: \"agent\" must be the name of a registered agent (@register_agent in the file "
                           "given with --agent_module)")
    if agent and (tools or environment):
        raise DatasetError(f"{where}: an \"agent\" plays the whole episode (its own tools, in the OpenAI format), so "
                           "it does not combine with \"tools\" or \"environment\"; keep one of them")
    if agent and values.get("demonstrations"):
        raise DatasetError(f"{where}: \"demonstrations\" are laid out as the trainer's own tool episodes, while an "
                           "agent builds its episodes itself; drop \"demonstrations\" from this entry")


def _check_extractor(where: str, extractor: str) -> None:
    if extractor in ("none", "gsm8k", "boxed"):
        return
    if not extractor.startswith("regex:"):
        raise DatasetError(f"{where}: unknown answer_extractor '{extractor}'; use one of {', '.join(EXTRACTORS)}")
    try:
        groups = re.compile(extractor[len("regex:"):]).groups
    except re.error as exc:
        raise DatasetError(f"{where}: the answer_extractor regex does not compile ({exc})") from None
    if groups < 1:
        raise DatasetError(f"{where}: the answer_extractor regex needs a capture group holding the answer, "
                           f"e.g. \"regex:answer: (\\\\d+)\"")


def dataset_routes(registry: dict[str, DatasetSpec],
                   names: Sequence[str]) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, dict]]]:
    """({dataset: {reward: weight}}, {dataset: {reward: kwargs}}) of the named datasets, for the reward router."""
    specs = [lookup(registry, n) for n in names]
    return ({s.name: dict(s.rewards) for s in specs},
            {s.name: {reward: dict(kw) for reward, kw in s.reward_kwargs.items()} for s in specs})


def tool_datasets(registry: dict[str, DatasetSpec], names: Sequence[str]) -> list[str]:
    """The named datasets whose episodes may call tools."""
    return [s.name for s in (lookup(registry, n) for n in names) if s.tools]


def check_dataset_names(registry: dict[str, DatasetSpec], registry_path: str, names, eval_names,
                        train_split_ratio: float) -> tuple[list[str], list[str]]:
    """(train names, eval names) as lists, once each registered and given once, before any data file is read."""
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
    for name in names + eval_names:
        lookup(registry, name, registry_path)
    return names, eval_names


def _name_list(names) -> list[str]:
    return [names] if isinstance(names, str) else list(names)


def _check_once(flag: str, names: list[str]) -> None:
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        raise DatasetError(f"{flag}: {', '.join(repeated)} listed more than once; name each dataset once")


def lookup(registry: dict[str, DatasetSpec], name: str, registry_path: Optional[str] = None) -> DatasetSpec:
    if name not in registry:
        where = f" in {registry_path}" if registry_path else ""
        raise DatasetError(f"unknown dataset '{name}'; registered{where}: {', '.join(sorted(registry))} "
                           f"(add an entry to the registry file given by --dataset_config_path)")
    return registry[name]
