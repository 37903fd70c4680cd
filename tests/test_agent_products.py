"""arith_products played by the calculator written as an OpenAI-API agent (arith_products_agent): its episodes are the
trainer's own tool episodes token for token (so the native warm start's demonstrations fit it, and
--warm_start_datasets arith_products warm-starts it), its tool calls are counted as the native episodes' are, and
both loops report where a model turn's time goes (grpo.rollout.turn_timing)."""
import json
import os
import time

import pytest

from grpo.agents import AgentLimits, agent_metrics, check_agents, load_agent_module, run_agent_episodes
from grpo.agents.rollouts import agent_row
from grpo.data import load_demonstrations, load_dataset_registry, render_prompts
from grpo.data.episode_datasets import check_episode_datasets, prompts_with_tools
from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings
from grpo.rollout.episodes import EpisodeLimits, EpisodePrompt, run_episodes, scripted_episode
from grpo.rollout.turn_timing import TimedEngine, TurnTimes
from grpo.tools.template import EnvironmentTurns

from .test_episodes import smollm2_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "configs", "dataset_config.json")
EXAMPLE = os.path.join(ROOT, "examples", "calculator_agent.py")


class Options:
    tool_module = None
    dataset_config_path = SHIPPED


class DemonstrationEngine(RolloutEngine):
    """Samples the demonstrations' turns: a prompt that begins with demonstration d's rendered first prompt and holds
    t earlier assistant turns gets d's turn t, then the template's end-of-turn token (as a model stops)."""

    def __init__(self, tokenizer, first_prompts: list[list[int]], replies: list[list[str]]):
        self.first_prompts, self.replies = first_prompts, replies
        self.assistant = tokenizer.encode("<|im_start|>assistant", add_special_tokens=False)
        end = tokenizer.encode(EnvironmentTurns(tokenizer).turn_close, add_special_tokens=False)[:1]
        self.turns = [[tokenizer.encode(r, add_special_tokens=False) + end for r in demo] for demo in replies]

    def generate(self, prompt_token_ids, sampling, images=None):
        out = []
        for i, prompt in enumerate(prompt_token_ids):
            demo = next(d for d, first in enumerate(self.first_prompts) if prompt[:len(first)] == first)
            turn = _count(prompt, self.assistant) - 1
            for _ in range(sampling.n):
                tokens = self.turns[demo][turn]
                out.append(Completion(i, tokens, [-0.5] * len(tokens), "stop"))
        return out


def _count(ids: list[int], pattern: list[int]) -> int:
    return sum(ids[i:i + len(pattern)] == pattern for i in range(len(ids) - len(pattern) + 1))


def test_the_calculator_agent_plays_arith_products_native_episodes_token_for_token():
    """The shipped arith_products demonstrations, rendered as the trainer renders them (tools in the system prompt),
    laid out as the warm start lays them out; the same turns played by examples/calculator_agent.py on the
    arith_products_agent rows through the endpoint, and by the trainer's own episode loop: the same prompt ids, the same
    completion ids, the same mask. So the agent's first prompt is the native one (the endpoint adds the tools as the
    trainer does), and a warm start on arith_products' demonstrations is a warm start on the agent's episodes."""
    tokenizer = smollm2_tokenizer()
    registry = load_dataset_registry(SHIPPED)
    tools = check_episode_datasets(Options(), registry, ["arith_products"])
    demos = load_demonstrations(SHIPPED, ["arith_products"]).select(range(3))
    rows, _ = prompts_with_tools(demos, tokenizer, tools)
    native = render_prompts(rows, tokenizer, 320, False, "demonstrations")
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=256)
    prompts = [EpisodePrompt(list(r["prompt_ids"]), [dict(m) for m in r["messages"]],
                             {"tools": ["calculator"], "answer": r["answer"], "data_source": "arith_products"})
               for r in native]
    laid_out = [scripted_episode(p, list(r["demonstration"]), tokenizer, limits) for p, r in zip(prompts, native)]
    engine = DemonstrationEngine(tokenizer, [p.prompt_ids for p in prompts], [list(r["demonstration"]) for r in native])

    # the trainer's own loop, its engine timed
    timed = TimedEngine(engine)
    played = run_episodes(timed, tokenizer, prompts, SamplingSettings(n=2, max_new_tokens=64), limits)
    assert timed.calls == 2 and timed.seconds > 0  # the call turn of every episode at once, then the answer turn
    for episode in played:
        assert episode.completion_ids == laid_out[episode.prompt_index].completion_ids
        assert episode.mask == laid_out[episode.prompt_index].mask and episode.tool_calls == 1

    # the agent, on the agent entry's rows (no tools in them: the agent offers its own)
    load_agent_module(EXAMPLE)
    (agent,) = check_agents(["calculator_agent"], EXAMPLE)
    import datasets

    from grpo.data.rows import standardize

    # the agent entry's own rows of the same questions: its system prompt and template, no tools in them
    with open(os.path.join(ROOT, "data", "arith_products", "calc_demonstrations.jsonl")) as fh:
        raw = [json.loads(line) for line, _ in zip(fh, range(len(demos)))]
    questions = datasets.Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in raw])
    agent_rows = standardize(registry["arith_products_agent"], questions)
    assert "<tools>" not in agent_rows[0]["messages"][0]["content"]
    timed = TimedEngine(engine)
    episodes = run_agent_episodes(timed, tokenizer, agent, [agent_row(dict(r)) for r in agent_rows],
                                  SamplingSettings(n=2, max_new_tokens=64),
                                  AgentLimits(timeout_s=60, max_prompt_tokens=320, max_episode_tokens=256))
    assert timed.calls >= 2
    for episode in episodes:
        assert episode.ok, episode.error
        assert episode.prompt_ids == prompts[episode.prompt_index].prompt_ids
        assert episode.completion_ids == laid_out[episode.prompt_index].completion_ids
        assert episode.mask == laid_out[episode.prompt_index].mask
        assert episode.final_text == native[episode.prompt_index]["demonstration"][-1]
    metrics = agent_metrics(episodes)
    assert metrics["agents/tool_calls"] == metrics["agents/called_a_tool"] == 1.0
    assert metrics["agents/calls"] == 2.0


def test_tool_calls_written_count_blocks_read_and_unread():
    from grpo.agents.records import CallRecord
    from grpo.agents.runner import AgentEpisode, tool_calls_written

    def call(tool_calls, unread=0):
        message = {"role": "assistant", "content": "x", **({"tool_calls": tool_calls} if tool_calls else {})}
        record = CallRecord(0, "chat", [1], [2], [-0.1], "stop", 0, {}, {"choices": [{"message": message}]})
        record.unread_tool_calls = unread
        return record

    two = [{"id": "a", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}] * 2
    assert [tool_calls_written(c) for c in (call(two), call(None, unread=1), call(None))] == [2, 1, 0]
    episodes = [AgentEpisode(0, {}, calls=[call(None), call(two)]), AgentEpisode(0, {}, calls=[call(None, 1)]),
                AgentEpisode(0, {}, calls=[call(None)]), AgentEpisode(0, {})]
    metrics = agent_metrics(episodes)
    assert metrics["agents/tool_calls"] == pytest.approx(3 / 4)
    assert metrics["agents/called_a_tool"] == pytest.approx(2 / 4)


class SleepingEngine(RolloutEngine):
    def generate(self, prompt_token_ids, sampling, images=None):
        time.sleep(0.05)
        return [Completion(i, [1], [0.0], "stop") for i in range(len(prompt_token_ids))]


def test_turn_times_split_a_turn_between_the_engine_and_the_loop():
    engine = TimedEngine(SleepingEngine())
    assert engine.collective_generate is False  # every other attribute is the engine's
    start = time.perf_counter()
    engine.generate([[1], [2]], SamplingSettings(n=1, max_new_tokens=1))
    engine.generate([[1]], SamplingSettings(n=1, max_new_tokens=1))
    time.sleep(0.1)  # the loop's own work
    times = TurnTimes()
    times.add(time.perf_counter() - start, engine, turns=4)
    metrics = times.metrics("agents")
    assert metrics["agents/engine_calls"] == 2.0
    assert metrics["agents/turn_engine_s"] == pytest.approx(0.1 / 4, abs=0.01)
    assert metrics["agents/turn_overhead_s"] == pytest.approx(0.1 / 4, abs=0.01)
    assert metrics["agents/turn_s"] == pytest.approx(metrics["agents/turn_engine_s"] + metrics["agents/turn_overhead_s"])
    assert TurnTimes().metrics("episodes") == {}


def test_warm_start_datasets_need_warm_start_steps():
    from grpo.config import GRPOConfig
    from grpo.errors import ConfigError

    config = GRPOConfig(dataset_names=["arith_products_agent"], warm_start_datasets="arith_products",
                        warm_start_steps=5)
    assert config.warm_start_datasets == ["arith_products"]
    with pytest.raises(ConfigError, match="warm_start_datasets"):
        GRPOConfig(dataset_names=["arith_products_agent"], warm_start_datasets=["arith_products"]).validate()
