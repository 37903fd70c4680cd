"""A training step's agent episodes: the rows of datasets that name an agent (dataset_config.json's "agent"), each
played `k` times against the endpoint over the engine being trained, laid out as the step's completions, and scored.

Per prompt row, its k episodes are one group. The trainer's batch puts one prompt before every completion of a group,
while each episode starts from its own first call's prompt (the agent builds its messages, system prompt and tools as
it likes). So the row's `prompt_ids` become the ids its episodes' first prompts share, and whatever an episode's first
prompt has beyond them leads its completion, masked like the tool results and user turns after it:

    row prompt_ids   the group's shared prompt ids (usually an episode's whole first prompt)
    completion       the rest of its first prompt (mask 0), then the assembled episode (grpo.agents.records): the
                     sampled ids (mask 1, the engine's log-probs) and what each later call added (mask 0)

Every id is one the engine was given or sampled; nothing is tokenized again. An episode whose agent failed (raised, ran
past --agent_timeout_s, blocked its loop) scores 0 in every reward; its sampled tokens are still trained on with that
reward (they are what the policy did).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from grpo.agents.runner import AgentEpisode, AgentLimits, agent_metrics, run_agent_episodes
from grpo.rollout.engine import Completion

EPISODES_KEY = "agent_episodes"  # a prompt row's episodes, in the order of its completions (set by AgentRollouts.run)


@dataclass
class AgentDataset:
    """A dataset whose rows agents play: its name, its agent's registered name and function."""
    name: str
    agent_name: str
    agent: Callable


class AgentRollouts:
    """The agent datasets of a run and what their episodes need; the episodes of the step in progress."""

    def __init__(self, datasets: dict[str, AgentDataset], limits: AgentLimits):
        self.datasets = datasets
        self.limits = limits
        self.policy_version = 0
        self.drawn: list[AgentEpisode] = []  # this step's episodes, every round (for their metrics)

    def __bool__(self) -> bool:
        return bool(self.datasets)

    def plays(self, row: dict) -> bool:
        return row.get("data_source") in self.datasets

    def start_step(self, step: int) -> None:
        """A new step: its calls are sampled by the policy after `step` optimizer steps."""
        self.policy_version = step
        self.drawn = []

    def run(self, engine, tokenizer, prompts: list[dict], sampling) -> list[tuple[int, Completion, AgentEpisode]]:
        """`sampling.n` episodes of each prompt row (all datasets' agents at once), as (the row's position in
        `prompts`, the completion trained on, the episode), row by row. Each row's `prompt_ids` become its episodes'
        shared prompt ids, and the row keeps its episodes under EPISODES_KEY for scoring."""
        episodes = run_agent_episodes(engine, tokenizer, self._play, [agent_row(p) for p in prompts], sampling,
                                      self.limits, policy_version=self.policy_version)
        self.drawn += episodes
        out = []
        for index, prompt in enumerate(prompts):
            group = [e for e in episodes if e.prompt_index == index]
            shared = shared_prompt(group, prompt["prompt_ids"])
            prompt["prompt_ids"] = shared
            prompt[EPISODES_KEY] = group
            out += [(index, episode_completion(e, shared), e) for e in group]
        return out

    async def _play(self, client, row: dict):
        return await self.datasets[row["data_source"]].agent(client, row)

    def metrics(self) -> dict:
        """agents/...: the step's episodes (grpo.agents.runner.agent_metrics); {} when it had none on this rank."""
        return agent_metrics(self.drawn) if self.drawn else {}

    def results(self, prompts: list[dict], per_prompt: int) -> list:
        return agent_results(prompts, per_prompt)

    def zero_failed(self, result, prompts: list[dict], per_prompt: int):
        return zero_failed_episodes(result, prompts, per_prompt)


def agent_rollouts(config, datasets: dict[str, AgentDataset], engine) -> AgentRollouts:
    """The run's AgentRollouts under its options (--agent_timeout_s, --agent_max_concurrency, --agent_on_mismatch;
    an episode's first prompt within --max_prompt_length, the rest within the episode token budget), refused for an
    engine the episodes cannot drive from this process alone."""
    from grpo.errors import ConfigError
    from grpo.runtime import distributed as dist_utils

    if engine.runs_episodes or (engine.generates_in_step and dist_utils.world_size() > 1):
        raise ConfigError(f"dataset(s) {', '.join(sorted(datasets))} name an agent, whose episodes drive the engine "
                          f"from this process alone; this rollout engine ({type(engine).__name__}) generates with every "
                          "rank together (ZeRO-3 with the HF engine on several ranks, tensor-parallel vLLM, server "
                          "mode): use ZeRO-2, or --rollout_engine vllm with --vllm_tp 1")
    limits = AgentLimits(max_prompt_tokens=config.max_prompt_length, max_episode_tokens=config.episode_token_budget,
                         timeout_s=config.agent_timeout_s, max_concurrency=config.agent_max_concurrency,
                         on_mismatch=config.agent_on_mismatch)
    return AgentRollouts(datasets, limits)


def agent_row(prompt: dict) -> dict:
    """What an agent gets as `row`: the dataset row's `messages` (system prompt and prompt_template applied), its
    last user message as `prompt`, `answer`, `data_source` and `index`."""
    messages = [dict(m) for m in prompt.get("messages") or []]
    question = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
    return {"messages": messages, "prompt": question, "answer": prompt.get("answer"),
            "data_source": prompt.get("data_source"), "index": prompt.get("index")}


def shared_prompt(group: list[AgentEpisode], fallback: list[int]) -> list[int]:
    """The ids the first prompts of a group's episodes begin with (the longest common prefix of those with tokens to
    train on); `fallback` (the row's rendered prompt) when none has any. Never empty: a row needs a prompt token for
    the forward to predict its first completion token from."""
    prompts = [e.prompt_ids for e in group if e.completion_ids and e.prompt_ids]
    if not prompts:
        return list(fallback)
    shared = list(prompts[0])
    for ids in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(shared, ids)) if a != b), min(len(shared), len(ids)))
        shared = shared[:n]
    return shared or list(prompts[0][:1])  # first prompts that share no id: those not starting so are not trained


def episode_completion(episode: AgentEpisode, shared: list[int]) -> Completion:
    """The episode as the completion after the group's shared prompt ids: the rest of its first prompt (masked),
    then its assembled calls. Empty (nothing trained) when it has no sampled id, or a first prompt that does not
    begin with the shared ids."""
    completion = episode.as_completion()
    if not episode.completion_ids or episode.prompt_ids[:len(shared)] != shared:
        return Completion(completion.prompt_index, [], [], completion.finish_reason, mask=[])
    rest = episode.prompt_ids[len(shared):]
    return Completion(completion.prompt_index, rest + completion.token_ids, [0.0] * len(rest) + completion.logprobs,
                      completion.finish_reason, mask=[0] * len(rest) + completion.mask)


def episodes_of(prompts: list[dict], per_prompt: int) -> list[Optional[AgentEpisode]]:
    """Per completion (`per_prompt` of each prompt row, in order), its agent episode, or None (not an agent row)."""
    out: list[Optional[AgentEpisode]] = []
    for prompt in prompts:
        group = prompt.get(EPISODES_KEY) or []
        out += [group[j] if j < len(group) else None for j in range(per_prompt)]
    return out


def agent_results(prompts: list[dict], per_prompt: int) -> list:
    """Per completion, what its agent returned (None: not an agent row, or the agent failed): rewards that take
    `agent_results` read it."""
    return [e.result if e is not None and e.ok else None for e in episodes_of(prompts, per_prompt)]


def zero_failed_episodes(result, prompts: list[dict], per_prompt: int):
    """The reward result with every reward of a failed agent's episode set to 0 (its total and each function's
    value, where the function applied)."""
    for row, episode in enumerate(episodes_of(prompts, per_prompt)):
        if episode is not None and not episode.ok:
            result.total[row] = 0.0
            for values in result.per_function.values():
                if values[row] is not None:
                    values[row] = 0.0
    return result
