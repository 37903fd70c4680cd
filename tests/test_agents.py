"""Agents on the OpenAI API: the real `openai` client against the endpoint, over the HF engine on the tiny model.

Each episode's calls must come back as one sequence whose sampled ids, mask and log-probs are the engine's exactly.
"""
import asyncio
import json
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")

from grpo.agents import (AgentError, AgentLimits, agent_metrics, assemble_calls, check_agents, load_agent_module,
                         register_agent, run_agent_episodes)
from grpo.agents.records import CallRecord
from grpo.rollout.engine import Completion, RolloutEngine, SamplingSettings
from grpo.rollout.hf import HFRolloutEngine
from grpo.tools import calculator, tool_schemas

from .tiny_models import WORDS, make_tiny_tokenizer

TOOLS = tool_schemas(["calculator"])


class SpyEngine(HFRolloutEngine):
    """The HF engine, remembering every prompt it was given and what it sampled for it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampled: list[tuple[list[int], Completion]] = []
        self.calls = 0

    def generate(self, prompt_token_ids, sampling, images=None):
        out = super().generate(prompt_token_ids, sampling, images)
        self.calls += 1
        self.sampled += [(list(prompt), completion) for prompt, completion in zip(prompt_token_ids, out)]
        return out

    def sample_of(self, call) -> Completion:
        """What the engine sampled for this recorded call (given its prompt; the endpoint may cut a sample to the
        call's own max_tokens, a prefix): each sample answers one call."""
        for i, (prompt, completion) in enumerate(self.sampled):
            n = len(call.completion_ids)
            if prompt == call.prompt_ids and completion.token_ids[:n] == call.completion_ids and \
                    completion.logprobs[:n] == call.logprobs:
                assert n == len(completion.token_ids) or call.finish_reason == "length"
                del self.sampled[i]
                return Completion(0, completion.token_ids[:n], completion.logprobs[:n], call.finish_reason)
        raise AssertionError(f"call {call.index}'s prompt and ids were never sampled by the engine")


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


def spy(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    return SpyEngine(model, tokenizer), tokenizer


async def three_turns(client, row):
    """A tool call, its result, a user turn: three calls, each passing back the answer it got."""
    messages = [{"role": "user", "content": row["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6)
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6)
    messages += [second.choices[0].message, {"role": "user", "content": "Give the answer ."}]
    third = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, logprobs=True)
    return third.choices[0].message.content


def test_three_turn_agent_is_one_token_exact_sequence(model_and_tokenizer):
    engine, tokenizer = spy(model_and_tokenizer)
    rows = [{"question": "What is 2 + 3 ?"}, {"question": "What is 7 * 8 ?"}]
    episodes = run_agent_episodes(engine, tokenizer, three_turns, rows, SamplingSettings(n=2, max_new_tokens=8),
                                  AgentLimits(timeout_s=60), policy_version=7)
    assert [e.prompt_index for e in episodes] == [0, 0, 1, 1]
    model = model_and_tokenizer[0]
    for episode in episodes:
        assert episode.ok and episode.mismatch is None and episode.calls_kept == 3, episode.error
        expected_ids, expected_mask, expected_logprobs = [], [], []
        chain = list(episode.calls[0].prompt_ids)
        assert episode.prompt_ids == chain
        for call in episode.calls:
            assert call.policy_version == 7
            sampled = engine.sample_of(call)  # the engine was given exactly the recorded prompt and sampled this
            inserted = call.prompt_ids[len(chain):]
            assert call.prompt_ids[:len(chain)] == chain
            expected_ids += inserted + sampled.token_ids
            expected_mask += [0] * len(inserted) + [1] * len(sampled.token_ids)
            expected_logprobs += [0.0] * len(inserted) + sampled.logprobs
            chain = call.prompt_ids + call.completion_ids
        assert episode.completion_ids == expected_ids
        assert episode.mask == expected_mask and episode.logprobs == expected_logprobs
        assert sum(episode.mask) == sum(len(c.completion_ids) for c in episode.calls)
        # the tool result and the user turn are in the sequence, masked
        inserted_text = tokenizer.decode([t for t, m in zip(episode.completion_ids, episode.mask) if m == 0])
        assert "5" in inserted_text and "Give the answer ." in inserted_text
        # scoring the assembled sequence gives the engine's log-probs on the sampled tokens
        ids = torch.tensor([episode.prompt_ids + episode.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        start = len(episode.prompt_ids)
        scored = torch.log_softmax(logits[start - 1:-1], -1).gather(-1, ids[0, start:, None]).squeeze(-1)
        mask = torch.tensor(episode.mask, dtype=torch.bool)
        assert torch.allclose(scored[mask], torch.tensor(episode.logprobs)[mask], atol=1e-4)
        # the response carried what the client asked for
        last = episode.calls[-1].response["choices"][0]
        assert len(last["logprobs"]["content"]) == len(episode.calls[-1].completion_ids)
        assert episode.final_text == last["message"]["content"]
    metrics = agent_metrics(episodes)
    assert metrics["agents/errors"] == 0 and metrics["agents/mismatches"] == 0 and metrics["agents/calls"] == 3


# ------------------------------------------------------------------------------------------- tool calls
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


class ScriptedEngine(RolloutEngine):
    """Answers a prompt without a tool result with a tool call (one token), and one with a result with "42"."""

    def __init__(self, tokenizer):
        self.call_id = tokenizer.convert_tokens_to_ids(CALL_TEXT)
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.answer_id = tokenizer.convert_tokens_to_ids("42")

    def generate(self, prompt_token_ids, sampling, images=None):
        out = []
        for i, prompt in enumerate(prompt_token_ids):
            tokens = [self.answer_id, self.end] if self.call_id in prompt else [self.call_id, self.end]
            out.append(Completion(i, tokens, [-0.25, -0.5], "stop"))
        return out


async def calculator_agent(client, row):
    messages = [{"role": "user", "content": row["question"]}]
    while True:
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return {"completion": message.content, "finish": response.choices[0].finish_reason}
        for call in message.tool_calls:
            result = calculator(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})


def test_tool_calls_come_back_in_openai_form_and_chain():
    tokenizer = make_tiny_tokenizer(words=WORDS + [CALL_TEXT])
    engine = ScriptedEngine(tokenizer)
    episodes = run_agent_episodes(engine, tokenizer, calculator_agent, [{"question": "What is 6 * 7 ?"}],
                                  SamplingSettings(n=1, max_new_tokens=8), AgentLimits(timeout_s=30))
    episode = episodes[0]
    assert episode.ok, episode.error
    first = episode.calls[0].response["choices"][0]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    (call,) = first["message"]["tool_calls"]
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "6 * 7"}
    assert episode.result == {"completion": "42", "finish": "stop"}
    # the second call was built on the first's ids: the call token, its stop token, then the tool's turn
    assert episode.calls[1].extends == 0 and episode.mismatch is None and episode.calls_kept == 2
    assert episode.completion_ids[:2] == [engine.call_id, engine.end]
    assert episode.mask == [1, 1] + [0] * (len(episode.mask) - 4) + [1, 1]
    assert episode.logprobs[-2:] == [-0.25, -0.5]
    assert "42" in tokenizer.decode(episode.completion_ids[2:-2])  # the calculator's result, inserted


# ------------------------------------------------------------------------------------------- mismatches
async def editing_agent(client, row):
    """Rewrites the model's first answer before the next call."""
    messages = [{"role": "user", "content": row["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": "5 . " + (first.choices[0].message.content or "")},
                 {"role": "user", "content": "Give the answer ."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [second.choices[0].message, {"role": "user", "content": "What is 1 + 1 ?"}]
    third = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return third.choices[0].message.content


@pytest.mark.parametrize("on_mismatch", ["truncate", "drop"])
def test_an_agent_that_edits_the_history_is_a_mismatch(model_and_tokenizer, on_mismatch, grpo_log):
    engine, tokenizer = spy(model_and_tokenizer)
    episodes = run_agent_episodes(engine, tokenizer, editing_agent, [{"question": "What is 2 + 3 ?"}],
                                  SamplingSettings(n=2, max_new_tokens=4),
                                  AgentLimits(timeout_s=60, on_mismatch=on_mismatch))
    for episode in episodes:
        assert episode.ok and len(episode.calls) == 3
        assert episode.mismatch is not None and "call 1's prompt does not begin" in episode.mismatch
        assert episode.calls[1].extends is None and episode.calls[2].extends == 1
        if on_mismatch == "truncate":  # the first call alone is trained on
            assert episode.calls_kept == 1 and not episode.dropped
            assert episode.completion_ids == episode.calls[0].completion_ids and all(episode.mask)
        else:
            assert episode.dropped and episode.completion_ids == [] and episode.mask == []
    metrics = agent_metrics(episodes)
    assert metrics["agents/mismatches"] == 1.0 and metrics["agents/dropped"] == float(on_mismatch == "drop")
    assert any("does not continue their earlier calls" in line for line in grpo_log)


# ------------------------------------------------------------------------------------------- many at once
async def two_turns(client, row):
    messages = [{"role": "user", "content": row["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [first.choices[0].message, {"role": "user", "content": "Give the answer ."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return second.choices[0].message.content


def test_64_concurrent_episodes_share_engine_calls(model_and_tokenizer):
    engine, tokenizer = spy(model_and_tokenizer)
    rows = [{"question": f"What is {i} + {i + 1} ?"} for i in range(16)]
    started = time.monotonic()
    episodes = run_agent_episodes(engine, tokenizer, two_turns, rows, SamplingSettings(n=4, max_new_tokens=4),
                                  AgentLimits(timeout_s=120, max_concurrency=64))
    assert len(episodes) == 64 and [e.prompt_index for e in episodes] == [i // 4 for i in range(64)]
    assert all(e.ok and e.calls_kept == 2 and e.mismatch is None for e in episodes), \
        [e.error or e.mismatch for e in episodes if not e.ok or e.mismatch]
    for episode in episodes:  # each its own: the prompt of its own row, its own sampled ids
        assert rows[episode.prompt_index]["question"] in tokenizer.decode(episode.prompt_ids)
        for call in episode.calls:
            engine.sample_of(call)
    # 128 calls in far fewer engine calls: the running episodes' calls are generated together
    assert engine.calls <= 16, engine.calls
    assert time.monotonic() - started < 120


class CountingEngine(ScriptedEngine):
    """The scripted calculator model, keeping each generate call's batch size."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.batches: list[int] = []

    def generate(self, prompt_token_ids, sampling, images=None):
        self.batches.append(len(prompt_token_ids))
        return super().generate(prompt_token_ids, sampling, images)


def test_a_round_of_turns_is_one_engine_call():
    """32 concurrent 2-call episodes (a tool call, then the answer): every round of turns waits until each running
    episode has its call in, then goes to the engine as one batch: 2 engine calls, not up to 64 (the window is long
    here, so that only the barrier decides)."""
    tokenizer = make_tiny_tokenizer(words=WORDS + [CALL_TEXT])
    engine = CountingEngine(tokenizer)
    rows = [{"question": f"What is {i} * 7 ?"} for i in range(4)]
    episodes = run_agent_episodes(engine, tokenizer, calculator_agent, rows, SamplingSettings(n=8, max_new_tokens=8),
                                  AgentLimits(timeout_s=60, gather_s=5.0, gather_max_s=30.0))
    assert all(e.ok and e.calls_kept == 2 and e.result["completion"] == "42" for e in episodes), \
        [e.error for e in episodes]
    assert engine.batches == [32, 32]


@pytest.mark.parametrize("limit, batches", [(0, [128, 128]), (64, [64, 64, 64, 64])])
def test_every_episode_of_a_step_runs_at_once_unless_limited(limit, batches):
    """A step of 16 prompts x 8 two-call episodes: by default all 128 run at once, a round of turns one engine call
    (as the trainer's own episode loop); under --agent_max_concurrency 64 the second half starts as the first ends,
    and the step takes twice the engine calls, each half the size."""
    tokenizer = make_tiny_tokenizer(words=WORDS + [CALL_TEXT])
    engine = CountingEngine(tokenizer)
    rows = [{"question": f"What is {i} * 7 ?"} for i in range(16)]
    episodes = run_agent_episodes(engine, tokenizer, calculator_agent, rows, SamplingSettings(n=8, max_new_tokens=8),
                                  AgentLimits(timeout_s=60, max_concurrency=limit, gather_s=5.0, gather_max_s=30.0))
    assert len(episodes) == 128 and all(e.ok and e.calls_kept == 2 for e in episodes), [e.error for e in episodes]
    assert engine.batches == batches


async def slow_between_turns(client, row):
    """Two calls; the agent of row "slow" works 1.5 s between them (a slow tool)."""
    messages = [{"role": "user", "content": "What is 6 * 7 ?"}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    if row["kind"] == "slow":
        await asyncio.sleep(1.5)
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": "call_0", "content": "42"}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    return second.choices[0].message.content


def test_an_agent_slow_between_turns_holds_the_others_no_longer_than_the_window():
    tokenizer = make_tiny_tokenizer(words=WORDS + [CALL_TEXT])
    engine = CountingEngine(tokenizer)
    rows = [{"kind": "slow"}] + [{"kind": "quick"}] * 7
    episodes = run_agent_episodes(engine, tokenizer, slow_between_turns, rows, SamplingSettings(n=1, max_new_tokens=8),
                                  AgentLimits(timeout_s=60, gather_s=0.05))
    assert all(e.ok and e.calls_kept == 2 and e.result == "42" for e in episodes), [e.error for e in episodes]
    slow, quick = episodes[0], episodes[1:]
    assert slow.seconds >= 1.5
    assert max(e.seconds for e in quick) < 1.0, [e.seconds for e in quick]  # not held for the slow one's 1.5 s
    # the first round together; the quick ones' second calls without the slow one; its own second call alone
    assert engine.batches[0] == 8 and engine.batches[-1] == 1 and sum(engine.batches) == 16, engine.batches


# ------------------------------------------------------------------------------------------- failures
async def sometimes_failing(client, row):
    first = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "What is ?"}],
                                                 max_tokens=2)
    if row["kind"] == "hang":
        await asyncio.sleep(3600)
    if row["kind"] == "fail":
        raise ValueError("the agent gave up")
    return first.choices[0].message.content


def test_hanging_and_failing_agents_give_error_results(model_and_tokenizer):
    engine, tokenizer = spy(model_and_tokenizer)
    rows = [{"kind": "ok"}, {"kind": "hang"}, {"kind": "fail"}]
    started = time.monotonic()
    episodes = run_agent_episodes(engine, tokenizer, sometimes_failing, rows, SamplingSettings(n=2, max_new_tokens=2),
                                  AgentLimits(timeout_s=3))
    assert time.monotonic() - started < 30
    assert not [t for t in threading.enumerate() if t.name == "grpo-agents"]
    ok, hung, failed = episodes[0], episodes[2], episodes[4]
    assert ok.ok and ok.calls_kept == 1
    assert hung.timed_out and hung.error == "the agent did not finish within 3 s"
    assert not failed.timed_out and failed.error.startswith("ValueError: the agent gave up (at ")
    # their calls were recorded all the same: what the policy sampled
    assert hung.calls_kept == 1 and failed.calls_kept == 1
    metrics = agent_metrics(episodes)
    assert metrics["agents/errors"] == pytest.approx(4 / 6) and metrics["agents/timeouts"] == pytest.approx(2 / 6)


def test_requests_outside_what_the_endpoint_serves_are_refused(model_and_tokenizer):
    engine, tokenizer = spy(model_and_tokenizer)

    async def agent(client, row):
        refused = {}
        for name, kwargs in [("stream", {"stream": True}), ("n", {"n": 2}), ("stop", {"stop": ["."]})]:
            try:
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}],
                                                     **kwargs)
            except openai.BadRequestError as exc:
                refused[name] = exc.body["message"]
        long = [{"role": "user", "content": " ".join(["1"] * 40)}]
        try:
            await client.chat.completions.create(model="policy", messages=long)
        except openai.BadRequestError as exc:
            refused["long"] = exc.body["code"]
        models = await client.models.list()
        refused["models"] = [m.id for m in models.data]
        return refused

    (episode,) = run_agent_episodes(engine, tokenizer, agent, [{}], SamplingSettings(n=1, max_new_tokens=2),
                                    AgentLimits(timeout_s=30, max_prompt_tokens=20))
    assert episode.ok, episode.error
    assert "streaming is not supported" in episode.result["stream"]
    assert "n > 1 is not supported" in episode.result["n"] and "stop sequences" in episode.result["stop"]
    assert episode.result["long"] == "context_length_exceeded" and episode.result["models"] == ["policy"]
    assert episode.calls == [] and episode.refused_calls == 4


def test_episode_token_budget_refuses_a_call_past_it(model_and_tokenizer):
    engine, tokenizer = spy(model_and_tokenizer)

    async def agent(client, row):
        messages = [{"role": "user", "content": "What is 2 + 3 ?"}]
        for _ in range(10):
            try:
                response = await client.chat.completions.create(model="policy", messages=messages)
            except openai.BadRequestError as exc:
                return exc.body["code"]
            messages += [response.choices[0].message, {"role": "user", "content": "Give the answer ."}]

    (episode,) = run_agent_episodes(engine, tokenizer, agent, [{}], SamplingSettings(n=1, max_new_tokens=8),
                                    AgentLimits(timeout_s=60, max_episode_tokens=24))
    assert episode.result == "context_length_exceeded" and episode.refused_calls == 1
    assert len(episode.completion_ids) <= 24 and episode.mismatch is None


# ------------------------------------------------------------------------------------------- /v1/completions
def test_text_completions_chain_on_recorded_ids(model_and_tokenizer):
    engine, tokenizer = spy(model_and_tokenizer)

    async def agent(client, row):
        prompt = "<|im_start|> user What is 2 + 3 ? <|im_end|> <|im_start|> assistant"
        first = await client.completions.create(model="policy", prompt=prompt, max_tokens=4, logprobs=1,
                                                extra_body={"return_token_ids": True})
        prompt += first.choices[0].text + " <|im_end|> <|im_start|> user Give the answer . <|im_end|>"
        await client.completions.create(model="policy", prompt=prompt, max_tokens=4)
        ids = first.prompt_token_ids + first.choices[0].token_ids + [5, 6]
        third = await client.completions.create(model="policy", prompt=ids, max_tokens=4)
        return first.choices[0].logprobs.token_logprobs, third.choices[0].text

    (episode,) = run_agent_episodes(engine, tokenizer, agent, [{}], SamplingSettings(n=1, max_new_tokens=4),
                                    AgentLimits(timeout_s=60))
    assert episode.ok, episode.error
    first, second, third = episode.calls
    assert second.extends == 0 and second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == \
        first.prompt_ids + first.completion_ids
    assert episode.result[0] == pytest.approx(first.logprobs)
    # the third prompt came as ids: first call's prompt and answer, then two ids, not the second call's chain
    assert episode.mismatch is not None and episode.calls_kept == 2


# ------------------------------------------------------------------------------------------- assembly, registry
def _record(index, prompt, completion):
    return CallRecord(index, "chat", prompt, completion, [-1.0] * len(completion), "stop", 0)


def test_assemble_calls_by_hand():
    calls = [_record(0, [1, 2], [3, 4]), _record(1, [1, 2, 3, 4, 9], [5]), _record(2, [1, 2, 3, 4, 9, 5], [6, 7])]
    episode = assemble_calls(calls)
    assert episode.prompt_ids == [1, 2] and episode.completion_ids == [3, 4, 9, 5, 6, 7]
    assert episode.mask == [1, 1, 0, 1, 1, 1] and episode.logprobs == [-1, -1, 0, -1, -1, -1]
    assert episode.calls_kept == 3 and episode.mismatch is None
    edited = [calls[0], _record(1, [1, 2, 3, 8, 9], [5])]
    truncated = assemble_calls(edited)
    assert truncated.completion_ids == [3, 4] and truncated.calls_kept == 1
    assert "differs at id 3 of 4" in truncated.mismatch
    dropped = assemble_calls(edited, "drop")
    assert dropped.dropped and dropped.completion_ids == [] and dropped.prompt_ids == [1, 2]
    shorter = assemble_calls([calls[0], _record(1, [1, 2, 3], [5])])
    assert "stops at id 3" in shorter.mismatch
    assert assemble_calls([]).completion_ids == [] and assemble_calls([]).calls_kept == 0


def test_agent_registry_and_module(tmp_path):
    with pytest.raises(AgentError, match="must be an async function"):
        register_agent("not_async")(lambda client, row: None)
    with pytest.raises(AgentError, match="two arguments"):
        register_agent("one_argument")(_one_argument)
    module = tmp_path / "my_agent.py"
    module.write_text("from grpo.agents import register_agent\n\n\n@register_agent('echo_agent')\n"
                      "async def echo(client, row):\n    return row['question']\n")
    (agent,) = check_agents(["echo_agent"], str(module))
    assert asyncio.run(agent(None, {"question": "q"})) == "q"
    load_agent_module(str(module))  # importing it again registers the same function again
    with pytest.raises(AgentError, match="unknown agent 'nobody'.*--agent_module"):
        check_agents(["nobody"])
    with pytest.raises(AgentError, match="--agent_module: file not found"):
        load_agent_module(str(tmp_path / "missing.py"))


async def _one_argument(client):
    return None


class FailingEngine(RolloutEngine):
    def generate(self, prompt_token_ids, sampling, images=None):
        raise RuntimeError("out of memory (a stand-in)")


def test_an_engine_failure_stops_the_run(model_and_tokenizer):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="out of memory"):
        run_agent_episodes(FailingEngine(), model_and_tokenizer[1], two_turns, [{"question": "What is 1 + 1 ?"}],
                           SamplingSettings(n=4, max_new_tokens=4), AgentLimits(timeout_s=60))
    assert time.monotonic() - started < 20
    assert not [t for t in threading.enumerate() if t.name == "grpo-agents"]  # the agents' loop has ended


def test_tools_reach_the_model_whether_or_not_the_template_renders_them():
    """A template that ignores `tools=` (the tiny ChatML one) gets the tools' instructions in the system message, as
    the trainer's own tool prompts do; one that renders them gets them through `tools=`, untouched."""
    from grpo.agents.endpoint import AgentEndpoint, EndpointLimits
    from grpo.tools import tools_system_prompt

    from .test_episodes import make_tool_tokenizer

    messages = [{"role": "system", "content": "Solve it ."}, {"role": "user", "content": "What is 2 + 3 ?"}]
    limits, sampling = EndpointLimits(8, 512, 512), SamplingSettings(n=1, max_new_tokens=8)
    plain = make_tiny_tokenizer()
    ids = AgentEndpoint(plain, sampling, limits)._render(messages, TOOLS)
    told = [{"role": "system", "content": "Solve it .\n\n" + tools_system_prompt(TOOLS)}, messages[1]]
    assert ids == plain.apply_chat_template(told, add_generation_prompt=True, tokenize=True, return_dict=False)
    alone = [{"role": "system", "content": tools_system_prompt(TOOLS)}, messages[1]]  # no system message of its own
    assert AgentEndpoint(plain, sampling, limits)._render(messages[1:], TOOLS) == plain.apply_chat_template(
        alone, add_generation_prompt=True, tokenize=True, return_dict=False)
    shows = make_tool_tokenizer()
    ids = AgentEndpoint(shows, sampling, limits)._render(messages, TOOLS)
    assert ids == shows.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
