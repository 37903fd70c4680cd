"""Multi-turn episodes on any rollout engine: the model's turn, the environment's answer, the model's next turn, ...

k episodes per prompt run turn by turn, every live episode of a turn in one `engine.generate` call (finished ones drop
out). Token ids stay exact end to end: an episode's completion is the model's tokens as sampled followed by the
environment's tokens as inserted, and only the environment's messages are ever tokenized (grpo.tools.template), so the
trainer scores exactly what the engine sampled. Per episode:

    completion_ids  [T]  model turns and environment turns, in order
    mask            [T]  1 on model tokens (they enter the loss, the KL and the entropy), 0 on environment tokens
    logprobs        [T]  the engine's log-prob of each model token, 0 on environment tokens ([] when not asked for)

An episode ends when the environment says so, after `max_turns` model turns, when a model turn is cut by
max_new_tokens, or when its completion would outgrow `max_episode_tokens` (the model's turn is cut there, or the
environment's answer is left out). Environment messages after the last model turn are kept in `messages` (rewards see
them) but not in the token ids: no model token follows them.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings
from grpo.tools.environment import DEFAULT_ENVIRONMENT, EnvironmentStep, get_environment, step_environment
from grpo.tools.template import EnvironmentTurns


@dataclass
class EpisodePrompt:
    prompt_ids: list[int]                          # the rendered prompt (tools shown through the chat template)
    messages: list[dict]                           # the same prompt as messages: what the environment sees first
    fields: dict = field(default_factory=dict)     # for the environment: `tools` (names offered), answer, ...
    environment: Optional[Callable] = None         # None: the default "tools" environment
    images: Optional[object] = None                # the prompt's processed images (vision-language models)


@dataclass
class EpisodeLimits:
    max_turns: int               # model turns per episode
    max_episode_tokens: int      # completion tokens per episode, model and environment together
    environment_workers: int = 8  # environments (and so tools) of one turn run in this many threads


@dataclass
class Episode:
    prompt_index: int
    messages: list[dict]                                # the prompt's messages, then every turn of the episode
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0                                      # model turns
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    finish_reason: str = ""                             # "stop" | "length" | "budget" | "max_turns"
    # per token, the policy version that sampled it (server mode's stream: each model turn's own; an environment
    # turn's tokens carry the version of the turn they answer); None where the engine keeps no count
    versions: Optional[list[int]] = None
    # the engine's routing of the latest model turn (a mixture of experts under --routing_replay): that turn's context
    # was the prompt and every token before it, so it covers the whole episode but its last token
    routed_experts: Optional[object] = None

    @property
    def cut_by_budget(self) -> bool:
        return self.finish_reason == "budget"

    @property
    def final_text(self) -> str:
        """The model's last message (what a final-answer reward reads)."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    def as_completion(self) -> Completion:
        """The episode in the engine protocol's shape (a cut episode counts as truncated), its mask with it."""
        finish = "length" if self.finish_reason in ("length", "budget") else "stop"
        return Completion(self.prompt_index, self.completion_ids, self.logprobs, finish, mask=list(self.mask),
                          versions=self.versions, routed_experts=self.routed_experts)


def run_episodes(engine: RolloutEngine, tokenizer, prompts: list[EpisodePrompt], sampling: SamplingSettings,
                 limits: EpisodeLimits, turns: Optional[EnvironmentTurns] = None,
                 any_rank: Callable[[bool], bool] = bool) -> list[Episode]:
    """`sampling.n` episodes per prompt, ordered prompt by prompt like the engine's completions.

    `sampling.max_new_tokens` bounds each model turn. `turns` renders environment messages to token ids (default:
    this tokenizer's chat template). An engine whose generate is collective (tensor-parallel vLLM, server mode) needs
    every rank in every call with the same sampling settings, and one whose forward gathers ZeRO-3 weights (the HF
    engine on several ranks) every rank in every call (`generates_in_step`): pass `any_rank`
    (grpo.runtime.distributed.any_rank), and each rank takes part in every turn, with no prompts once its own
    episodes are over, until no rank has any; a collective engine's turns then ask for max_new_tokens and are cut to
    each episode's room afterwards."""
    if limits.max_turns < 1 or limits.max_episode_tokens < 1:
        raise ValueError(f"max_turns and max_episode_tokens must be at least 1, got {limits.max_turns} and "
                         f"{limits.max_episode_tokens}")
    turns = turns or EnvironmentTurns(tokenizer)
    environments = [p.environment or get_environment(DEFAULT_ENVIRONMENT) for p in prompts]
    episodes = [Episode(i, [dict(m) for m in p.messages]) for i, p in enumerate(prompts) for _ in range(sampling.n)]
    live = list(range(len(episodes)))
    failure: Optional[Exception] = None  # engines in step: this rank's error, raised once no rank has episodes
    with ThreadPoolExecutor(max(1, limits.environment_workers), thread_name_prefix="grpo-environment") as pool:
        # in step: every rank takes part in every turn (a collective engine also needs the same sampling settings)
        first_turn, in_step, collective = True, engine.generates_in_step, engine.collective_generate
        while any_rank(bool(live)) if in_step else live:
            room = {i: limits.max_episode_tokens - len(episodes[i].completion_ids) for i in live}
            cap = sampling.max_new_tokens if collective or not live else min(sampling.max_new_tokens,
                                                                               max(room.values()))
            if first_turn:  # k samples of each prompt in one request (engines share the prompt's prefix)
                completions = engine.generate([p.prompt_ids for p in prompts],
                                              dataclasses.replace(sampling, max_new_tokens=cap),
                                              _images([p.images for p in prompts]))
            else:
                contexts = [prompts[episodes[i].prompt_index].prompt_ids + episodes[i].completion_ids for i in live]
                completions = engine.generate(contexts, dataclasses.replace(sampling, n=1, max_new_tokens=cap),
                                              _images([prompts[episodes[i].prompt_index].images for i in live]))
            try:
                expected = [episodes[i].prompt_index for i in live] if first_turn else list(range(len(live)))
                if [c.prompt_index for c in completions] != expected:
                    raise RuntimeError(f"the rollout engine returned {len(completions)} completions for {len(live)} "
                                       "live episodes, or not in the order of its prompts")
                answering = [i for i, c in zip(live, completions)
                             if _add_model_turn(episodes[i], c, room[i], tokenizer, sampling.logprobs)]
                steps = pool.map(lambda i: step_environment(environments[episodes[i].prompt_index],
                                                            episodes[i].messages,
                                                            prompts[episodes[i].prompt_index].fields), answering)
                live = [i for i, step in zip(answering, steps)
                        if _add_environment_turn(episodes[i], step, turns, limits)]
            except Exception as exc:
                if not in_step:
                    raise
                # the other ranks of the engine wait for this one in every turn (a hang until the process group's
                # timeout otherwise): it takes part with no prompts until none has episodes left, then fails
                failure, live = failure or exc, []
            first_turn = False
    if failure is not None:
        raise failure
    if not sampling.logprobs:
        for episode in episodes:
            episode.logprobs = []
    return episodes


def scripted_episode(prompt: EpisodePrompt, replies: list[str], tokenizer, limits: EpisodeLimits,
                     turns: Optional[EnvironmentTurns] = None) -> Episode:
    """An episode whose model turns are given as text (a demonstration), laid out exactly as run_episodes lays out a
    sampled one: each reply's tokens and the template's end-of-turn token (what the model emits to stop), the
    environment's real answers between them (tools run), the same limits. The episode ends after the last reply."""
    turns = turns or EnvironmentTurns(tokenizer)
    end_of_turn = tokenizer.encode(turns.turn_close, add_special_tokens=False)[:1]
    environment = prompt.environment or get_environment(DEFAULT_ENVIRONMENT)
    episode = Episode(0, [dict(m) for m in prompt.messages])
    for index, reply in enumerate(replies):
        tokens = tokenizer.encode(reply, add_special_tokens=False) + end_of_turn
        room = limits.max_episode_tokens - len(episode.completion_ids)
        if not _add_model_turn(episode, Completion(0, tokens, [], "stop"), room, tokenizer, False):
            break  # cut by the budget
        step = step_environment(environment, episode.messages, prompt.fields)
        if index == len(replies) - 1:  # the environment's last answer stays in messages, as after a sampled turn
            episode.messages += [dict(m) for m in step.messages]
            episode.finish_reason = "stop"
        elif not _add_environment_turn(episode, step, turns, limits):
            break
    episode.logprobs = []
    return episode


def _images(per_prompt: list) -> Optional[list]:
    return per_prompt if any(p is not None for p in per_prompt) else None


def _add_model_turn(episode: Episode, completion: Completion, room: int, tokenizer, with_logprobs: bool) -> bool:
    """Append the model's turn (cut to the episode's room); whether the environment answers it."""
    tokens = list(completion.token_ids)
    logprobs = list(completion.logprobs) if with_logprobs else [0.0] * len(tokens)
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"the rollout engine returned {len(logprobs)} log-probs for {len(tokens)} tokens")
    if len(tokens) > room:
        tokens, logprobs, finish = tokens[:room], logprobs[:room], "budget"
    elif completion.finish_reason == "length":
        finish = "budget" if len(tokens) >= room else "length"
    else:
        finish = ""
    episode.completion_ids += tokens
    episode.mask += [1] * len(tokens)
    episode.logprobs += logprobs
    if completion.versions is not None and (episode.versions is not None or episode.turns == 0):
        episode.versions = (episode.versions or []) + list(completion.versions[:len(tokens)])
    else:  # a turn without versions: the episode has none
        episode.versions = None
    episode.routed_experts = completion.routed_experts
    episode.turns += 1
    # decoded for the messages only (rewards, environments); the ids above stay as sampled
    episode.messages.append({"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)})
    episode.finish_reason = finish
    return not finish


def _add_environment_turn(episode: Episode, step: EnvironmentStep, turns: EnvironmentTurns,
                          limits: EpisodeLimits) -> bool:
    """Append the environment's answer (its tokens only if a model turn can follow); whether the episode goes on."""
    episode.tool_calls += step.tool_calls
    episode.tool_errors += step.tool_errors
    episode.tool_timeouts += step.tool_timeouts
    episode.messages += [dict(m) for m in step.messages]
    if step.done:
        episode.finish_reason = "stop"
        return False
    if episode.turns >= limits.max_turns:
        episode.finish_reason = "max_turns"
        return False
    ids = turns.ids(step.messages, episode.completion_ids[-1] if episode.completion_ids else None)
    if len(episode.completion_ids) + len(ids) >= limits.max_episode_tokens:  # no room left for a model token
        episode.finish_reason = "budget"
        return False
    episode.completion_ids += ids
    episode.mask += [0] * len(ids)
    episode.logprobs += [0.0] * len(ids)
    if episode.versions:  # (out of the loss) the version of the turn they answer
        episode.versions += [episode.versions[-1]] * len(ids)
    elif episode.versions is not None:
        episode.versions = None
    return True


def episode_metrics(episodes: list[Episode]) -> dict:
    """Per-episode means for logging: turns, tool calls, tool errors and timeouts; the share that called a tool at
    least once, the share cut by the token budget and the share stopped at max_turns."""
    n = max(1, len(episodes))
    return {"episodes/turns": sum(e.turns for e in episodes) / n,
            "episodes/tool_calls": sum(e.tool_calls for e in episodes) / n,
            "episodes/called_a_tool": sum(e.tool_calls > 0 for e in episodes) / n,
            "episodes/tool_errors": sum(e.tool_errors for e in episodes) / n,
            "episodes/tool_timeouts": sum(e.tool_timeouts for e in episodes) / n,
            "episodes/cut_by_budget": sum(e.cut_by_budget for e in episodes) / n,
            "episodes/max_turns": sum(e.finish_reason == "max_turns" for e in episodes) / n}
