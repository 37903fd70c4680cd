"""The adapters of environments users already have (grpo.agents.verifiers_adapter, grpo.agents.openenv_adapter): a tiny
verifiers environment and a tiny OpenEnv environment, from their real packages, played through the real endpoint over
the tiny model. Each episode must be one token-exact sequence of the engine's samples, and its reward the
environment's own. Skipped where the extra is not installed (pip install '.[verifiers]' / '.[openenv]')."""
import asyncio
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("openai")

from grpo.agents import AgentError, AgentLimits, run_agent_episodes
from grpo.rollout.engine import SamplingSettings

from .test_agents import SpyEngine

QUESTIONS = [("What is 2 + 3 ?", "5"), ("What is 7 * 8 ?", "56")]


@pytest.fixture(autouse=True)
def signal_handlers_kept():
    """verifiers' legacy Environment installs a process-wide SIGTERM handler (teardown, then exit 143) when one is
    built: put the handlers back after each test, as a training run's own handler does after its steps."""
    import signal

    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in kept.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


def play(model_and_tokenizer, agent, rows, n=2, limits=None):
    model, tokenizer = model_and_tokenizer
    engine = SpyEngine(model, tokenizer)
    episodes = run_agent_episodes(engine, tokenizer, agent, rows, SamplingSettings(n=n, max_new_tokens=6),
                                  limits or AgentLimits(timeout_s=60))
    return engine, episodes


def assert_token_exact(engine, episode, calls: int):
    """The episode is its first prompt, then per call what the call's prompt added (mask 0) and what the engine
    sampled for it (mask 1, the engine's log-probs): nothing re-tokenized, nothing edited."""
    assert episode.ok and episode.mismatch is None, (episode.error, episode.mismatch)
    assert len(episode.calls) == episode.calls_kept == calls
    ids, mask, logprobs = [], [], []
    chain = list(episode.calls[0].prompt_ids)
    assert episode.prompt_ids == chain
    for call in episode.calls:
        sampled = engine.sample_of(call)
        assert call.prompt_ids[:len(chain)] == chain
        inserted = call.prompt_ids[len(chain):]
        ids += inserted + sampled.token_ids
        mask += [0] * len(inserted) + [1] * len(sampled.token_ids)
        logprobs += [0.0] * len(inserted) + sampled.logprobs
        chain = call.prompt_ids + call.completion_ids
    assert episode.completion_ids == ids and episode.mask == mask and episode.logprobs == logprobs


def answers_of(episode) -> list[str]:
    """The model's answer of each call, as the endpoint sent it."""
    return [call.response["choices"][0]["message"]["content"] or "" for call in episode.calls]


# ------------------------------------------------------------------------------------------- verifiers
def verifiers_env():
    """Two turns: the model answers, the environment asks for the answer, the model answers again. The rubric pays
    1 for the right answer in the last turn and 0.1 per word the model wrote over the episode."""
    vf = pytest.importorskip("verifiers")
    from datasets import Dataset

    class AskTwice(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "Give the answer ."}]

    def right_answer(completion, answer, **kwargs):
        return 1.0 if answer in completion[-1].content.split() else 0.0

    def words_written(completion, **kwargs):
        return sum(len((m.content or "").split()) for m in completion if m.role == "assistant")

    rows = Dataset.from_list([{"question": q, "answer": a} for q, a in QUESTIONS])
    return vf, AskTwice(dataset=rows, rubric=vf.Rubric(funcs=[right_answer, words_written], weights=[1.0, 0.1]),
                        max_turns=2)


def test_verifiers_environment_plays_token_exactly_and_its_rubric_scores(model_and_tokenizer, tmp_path):
    from grpo.agents.verifiers_adapter import VerifiersEpisodes

    vf, env = verifiers_env()
    episodes_of = VerifiersEpisodes(env)
    path = episodes_of.write_rows(str(tmp_path / "rows.jsonl"))
    rows = [{"messages": r["prompt"], "answer": r["answer"]} for r in map(__import__("json").loads, open(path))]
    assert [(r["messages"], r["answer"]) for r in rows] == [([{"role": "user", "content": q}], a) for q, a in QUESTIONS]

    async def agent(client, row):
        return await episodes_of.play(client, row)

    engine, episodes = play(model_and_tokenizer, agent, rows)
    assert [e.prompt_index for e in episodes] == [0, 0, 1, 1]
    for episode in episodes:
        assert_token_exact(engine, episode, calls=2)
        # the environment's turn is in the sequence, masked
        inserted = [t for t, m in zip(episode.completion_ids, episode.mask) if m == 0]
        assert "Give the answer ." in model_and_tokenizer[1].decode(inserted)
        first, last = answers_of(episode)
        answer = QUESTIONS[episode.prompt_index][1]
        expected = (1.0 if answer in last.split() else 0.0) + 0.1 * (len(first.split()) + len(last.split()))
        assert episode.result["reward"] == pytest.approx(expected)
        assert episode.result["completion"] == last
        assert set(episode.result["metrics"]) >= {"right_answer", "words_written"}


def test_verifiers_tool_env_calls_its_tool_through_the_endpoint():
    """A vf.ToolEnv offers its tool with tools=, gets the model's call back as tool_calls, runs it and passes the
    result back: one chain of two calls (the scripted engine calls the calculator, then answers 42)."""
    vf = pytest.importorskip("verifiers")
    from datasets import Dataset

    from grpo.agents.verifiers_adapter import VerifiersEpisodes

    from .test_agents import CALL_TEXT, ScriptedEngine
    from .tiny_models import WORDS, make_tiny_tokenizer

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: numbers with + - * /
        """
        a, op, b = expression.split()
        return str(int(a) * int(b) if op == "*" else int(a) + int(b))

    def right_answer(completion, answer, **kwargs):
        return 1.0 if completion[-1].content == answer else 0.0

    rows = Dataset.from_list([{"question": "What is 6 * 7 ?", "answer": "42"}])
    episodes_of = VerifiersEpisodes(vf.ToolEnv(dataset=rows, tools=[calculator], rubric=vf.Rubric(funcs=[right_answer]),
                                               max_turns=3))

    async def agent(client, row):
        return await episodes_of.play(client, row)

    tokenizer = make_tiny_tokenizer(words=WORDS + [CALL_TEXT])
    engine = ScriptedEngine(tokenizer)
    (episode,) = run_agent_episodes(engine, tokenizer, agent, [{"messages": r["prompt"], "answer": r["answer"]}
                                                               for r in episodes_of.rows()],
                                    SamplingSettings(n=1, max_new_tokens=6), AgentLimits(timeout_s=60))
    assert episode.ok and episode.mismatch is None and episode.calls_kept == 2, (episode.error, episode.mismatch)
    assert episode.calls[0].request["tools"][0]["function"]["name"] == "calculator"
    assert episode.calls[0].response["choices"][0]["finish_reason"] == "tool_calls"
    assert episode.mask == [1, 1] + [0] * (len(episode.mask) - 4) + [1, 1]
    assert "42" in tokenizer.decode(episode.completion_ids[2:-2])  # the tool's result, inserted
    assert episode.result["reward"] == 1.0 and episode.result["metrics"]["calculator_calls"] == 1.0


def test_verifiers_episode_out_of_room_ends_and_is_scored(model_and_tokenizer):
    """The endpoint refuses the second call (context_length_exceeded): the environment's rollout ends there, as
    verifiers ends an overlong prompt, and its rubric scores the one answer; a first prompt that does not fit fails."""
    from grpo.agents.verifiers_adapter import VerifiersEpisodes

    _, env = verifiers_env()
    episodes_of = VerifiersEpisodes(env)

    async def agent(client, row):
        return await episodes_of.play(client, row)

    rows = [{"messages": r["prompt"], "answer": r["answer"]} for r in episodes_of.rows()]
    engine, episodes = play(model_and_tokenizer, agent, rows, n=1, limits=AgentLimits(timeout_s=60,
                                                                                       max_episode_tokens=10))
    for episode in episodes:
        assert episode.ok and episode.refused_calls == 1, episode.error
        assert_token_exact(engine, episode, calls=1)
        (answer,) = answers_of(episode)
        right = 1.0 if QUESTIONS[episode.prompt_index][1] in answer.split() else 0.0
        assert episode.result["reward"] == pytest.approx(right + 0.1 * len(answer.split()))
    _, episodes = play(model_and_tokenizer, agent, rows[:1], n=1, limits=AgentLimits(timeout_s=60,
                                                                                      max_prompt_tokens=4))
    assert not episodes[0].ok and "first prompt does not fit" in episodes[0].error


def test_verifiers_rows_unknown_to_the_environment_play_from_their_messages(model_and_tokenizer):
    from grpo.agents.verifiers_adapter import VerifiersEpisodes

    _, env = verifiers_env()
    episodes_of = VerifiersEpisodes(env)
    row = {"messages": [{"role": "system", "content": "think"}, {"role": "user", "content": "What is 1 + 1 ?"}],
           "answer": "2", "index": 5}
    assert episodes_of.input_of(row)["prompt"] == row["messages"]
    known = episodes_of.input_of({"messages": [{"role": "user", "content": QUESTIONS[1][0]}], "answer": "56"})
    assert known["example_id"] == 1


def test_verifiers_adapter_refuses_what_is_not_an_environment():
    pytest.importorskip("verifiers")
    from grpo.agents.verifiers_adapter import VerifiersEpisodes

    with pytest.raises(AgentError, match="verifiers environment"):
        VerifiersEpisodes(object())
    vf, env = verifiers_env()

    def longest_of_group(completions, **kwargs):
        return [float(len(c)) for c in completions]

    env.rubric.add_reward_func(longest_of_group)
    with pytest.raises(AgentError, match="group-level reward functions"):
        VerifiersEpisodes(env)


# ------------------------------------------------------------------------------------------- OpenEnv
def guess_environment():
    """A two-step OpenEnv environment: it asks a question, then for the answer; each step pays 1 when the action holds
    the number, else 0.25 per word (at most 1)."""
    pytest.importorskip("openenv")
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class TextAction(Action):
        text: str

    class Question(Observation):
        prompt: str = ""

    class AskTwice(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(episode_id="0", step_count=0)

        def reset(self, seed=None, episode_id=None, **kwargs):
            self._state = State(episode_id=episode_id or "0", step_count=0)
            return Question(prompt="What is 2 + 3 ?")

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            words = action.text.split()
            reward = 1.0 if "5" in words else min(1.0, 0.25 * len(words))
            return Question(prompt="Give the answer .", reward=reward, done=self._state.step_count >= 2)

        @property
        def state(self):
            return self._state

    return AskTwice, TextAction, Question


def step_reward(text: str) -> float:
    words = text.split()
    return 1.0 if "5" in words else min(1.0, 0.25 * len(words))


def check_openenv_episodes(engine, episodes, tokenizer):
    for episode in episodes:
        assert_token_exact(engine, episode, calls=2)
        inserted = tokenizer.decode([t for t, m in zip(episode.completion_ids, episode.mask) if m == 0])
        assert "Give the answer ." in inserted
        texts = answers_of(episode)
        assert episode.result["rewards"] == pytest.approx([step_reward(t) for t in texts])
        assert episode.result["reward"] == pytest.approx(sum(step_reward(t) for t in texts))
        assert episode.result["done"] and episode.result["turns"] == 2
        # the reset observation is the first prompt's last user message
        assert episode.calls[0].request["messages"][-1] == {"role": "user", "content": "What is 2 + 3 ?"}


def test_openenv_environment_in_process_plays_token_exactly_and_its_reward_counts(model_and_tokenizer):
    from grpo.agents.openenv_adapter import OpenEnvEpisodes

    AskTwice, TextAction, _ = guess_environment()
    episodes_of = OpenEnvEpisodes(AskTwice, action_of=lambda text: TextAction(text=text),
                                  observation_text=lambda observation: observation.prompt, max_turns=4)

    async def agent(client, row):
        return await episodes_of.play(client, row)

    engine, episodes = play(model_and_tokenizer, agent, [{"messages": [{"role": "system", "content": "think"}]}])
    check_openenv_episodes(engine, episodes, model_and_tokenizer[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def openenv_server():
    """The environment behind OpenEnv's own FastAPI app, served by uvicorn on a local port for the test."""
    AskTwice, TextAction, Question = guess_environment()
    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_fastapi_app(AskTwice, TextAction, Question, max_concurrent_envs=8),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_openenv_client_against_its_server_plays_token_exactly(model_and_tokenizer, openenv_server):
    from openenv.core.generic_client import GenericEnvClient

    from grpo.agents.openenv_adapter import OpenEnvEpisodes

    episodes_of = OpenEnvEpisodes(lambda: GenericEnvClient(base_url=openenv_server),
                                  action_of=lambda text: {"text": text},
                                  observation_text=lambda observation: observation.get("prompt"), max_turns=4)

    async def agent(client, row):
        return await episodes_of.play(client, row)

    engine, episodes = play(model_and_tokenizer, agent, [{"messages": []}])
    check_openenv_episodes(engine, episodes, model_and_tokenizer[1])


def test_openenv_adapter_refuses_what_is_not_an_environment():
    pytest.importorskip("openenv")
    from grpo.agents.openenv_adapter import OpenEnvEpisodes

    episodes_of = OpenEnvEpisodes(lambda: object(), action_of=str, observation_text=str)
    with pytest.raises(AgentError, match="EnvClient or Environment"):
        asyncio.run(episodes_of.play(None, {"messages": []}))
    with pytest.raises(AgentError, match="reward must be"):
        OpenEnvEpisodes(lambda: object(), action_of=str, observation_text=str, reward="mean")


# ------------------------------------------------------------------------------------------- training
# A user's agent file, as docs/agents.md writes it: a verifiers environment (its rows written where the registry
# reads them) and an OpenEnv environment, each registered as an agent.
ADAPTER_MODULE = '''
import os

import verifiers as vf
from datasets import Dataset
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from grpo.agents import register_agent
from grpo.agents.openenv_adapter import OpenEnvEpisodes
from grpo.agents.verifiers_adapter import VerifiersEpisodes


class AskTwice(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Give the answer ."}]


def words_written(completion, **kwargs):
    return 0.1 * sum(len((m.content or "").split()) for m in completion if m.role == "assistant")


rows = Dataset.from_list([{"question": f"What is {a} + {b} ?", "answer": str(a + b)} for a in range(4) for b in (1, 2)])
ask_twice = VerifiersEpisodes(AskTwice(dataset=rows, rubric=vf.Rubric(funcs=[words_written]), max_turns=2))
ask_twice.write_rows(os.path.join(os.path.dirname(__file__), "vf_ask_twice.jsonl"))


@register_agent("vf_ask_twice")
async def vf_ask_twice(client, row):
    return await ask_twice.play(client, row)


class TextAction(Action):
    text: str


class Question(Observation):
    prompt: str = ""


class CountWords(Environment):
    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(step_count=0)
        return Question(prompt="Give the answer .")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        return Question(reward=0.25 * len(action.text.split()), done=self._state.step_count >= 2,
                        prompt="Give the answer .")

    @property
    def state(self):
        return self._state


count_words = OpenEnvEpisodes(CountWords, action_of=lambda text: TextAction(text=text),
                              observation_text=lambda observation: observation.prompt, max_turns=2)


@register_agent("openenv_count_words")
async def openenv_count_words(client, row):
    return await count_words.play(client, row)
'''


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory):
    """The registry (`toy`, `vf_ask_twice` reading the rows the verifiers environment writes, `openenv_count_words`
    on arithmetic prompts) and the agent module."""
    pytest.importorskip("verifiers")
    pytest.importorskip("openenv")
    import json

    from .test_tool_training import CALC_ROWS
    from .trainer_setup import add_dataset, write_prompt_registry

    folder = tmp_path_factory.mktemp("adapter_data")
    registry = write_prompt_registry(str(folder))
    add_dataset(registry, "openenv_count_words", CALC_ROWS, agent="openenv_count_words",
                rewards={"agent_reward": 1.0})
    with open(registry) as fh:
        entries = json.load(fh)
    entries["vf_ask_twice"] = {"path": "vf_ask_twice.jsonl", "messages_field": "prompt", "answer_field": "answer",
                               "agent": "vf_ask_twice", "rewards": {"agent_reward": 1.0}}
    with open(registry, "w") as fh:
        json.dump(entries, fh)
    module = folder / "my_environments.py"
    module.write_text(ADAPTER_MODULE)
    return registry, str(module)


@pytest.mark.parametrize("dataset", ["vf_ask_twice", "openenv_count_words"])
def test_adapted_environments_train_two_steps(tiny_model, adapter_files, dataset, tmp_path):
    """Two GRPO steps on each environment's episodes (--agent_module brings it): every episode plays both turns
    token-exactly, the reward trained on is the environment's, and the policy moves."""
    from grpo.agents.rollouts import EPISODES_KEY
    from grpo.train.trainer import GRPOTrainer

    from .test_agent_training import Recorder
    from .trainer_setup import tiny_config, train_rows

    registry, module = adapter_files
    out = tmp_path / "out"
    config = tiny_config(tiny_model, registry, str(out), dataset_names=[dataset], agent_module=module,
                         agent_timeout_s=60.0, rollout_max_new_tokens=6, max_prompt_length=64, max_seq_length=160,
                         train_split_ratio=1.0)
    trainer = GRPOTrainer(config)
    recorder = Recorder(trainer)
    try:
        trainer.train()
    finally:
        trainer.close()
    assert len(recorder.steps) == 2
    for rollout, _ in recorder.steps:
        episodes = [e for p in rollout.prompts for e in p[EPISODES_KEY]]
        assert len(episodes) == 8
        for i, episode in enumerate(episodes):
            assert episode.ok and episode.mismatch is None and episode.calls_kept == 2, (episode.error,
                                                                                        episode.mismatch)
            for call in episode.calls:
                assert recorder.sample_of(call)[0] == call.completion_ids
            words = sum(len(text.split()) for text in answers_of(episode))
            expected = 0.1 * words if dataset == "vf_ask_twice" else 0.25 * words
            assert episode.result["reward"] == pytest.approx(expected)
            assert rollout.result.per_function["agent_reward"][i] == pytest.approx(expected)
    rows = train_rows(out)
    assert len(rows) == 2 and rows[0]["agents/errors"] == 0 and rows[0]["agents/mismatches"] == 0
    assert rows[0]["grad_norm"] > 0


@pytest.mark.parametrize("package, build", [
    ("verifiers", lambda: __import__("grpo.agents.verifiers_adapter", fromlist=["_"]).VerifiersEpisodes(None)),
    ("openenv", lambda: __import__("grpo.agents.openenv_adapter", fromlist=["_"]).OpenEnvEpisodes(None, str, str)),
])
def test_a_missing_extra_says_how_to_install_it(monkeypatch, package, build):
    import sys

    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(AgentError, match=rf"pip install '\.\[{package}\]'"):
        build()
