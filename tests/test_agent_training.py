"""Agents on the OpenAI API in training: a dataset that names an agent trains with GRPO end to end (HF engine, tiny
model, the real openai client against the endpoint), each episode's calls becoming one sequence whose trained tokens
are exactly those the engine sampled, with its log-probs; failing and hanging agents score 0, are counted, and the
run goes on; --agent_module's errors come before any model loads."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("openai")

from grpo.agents import AgentError
from grpo.agents.rollouts import EPISODES_KEY, episode_completion, shared_prompt
from grpo.agents.runner import AgentEpisode
from grpo.config.options import GRPOConfig
from grpo.data.registry import load_dataset_registry
from grpo.errors import ConfigError, DatasetError
from grpo.train.setup import prepare_run

from .test_tool_training import CALC_ROWS
from .trainer_setup import ROOT, add_dataset, child_env, tiny_config, train_rows, write_prompt_registry

# Agents for the tests. `two_calls` answers, is asked to check, answers again: two calls, each continuing the last.
# `sometimes_fails` does that in half its episodes; of the others, one in two raises after a call, one in two hangs
# after a call (past --agent_timeout_s). Both return the reward they want as well (agent_reward reads it).
AGENT_MODULE = '''
import asyncio

from grpo.agents import register_agent

STARTED = {"episodes": 0}


async def answer_then_check(client, row):
    messages = list(row["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [first.choices[0].message, {"role": "user", "content": "Give the answer ."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return {"completion": second.choices[0].message.content, "reward": 0.5}


@register_agent("two_calls")
async def two_calls(client, row):
    return await answer_then_check(client, row)


@register_agent("sometimes_fails")
async def sometimes_fails(client, row):
    STARTED["episodes"] += 1
    kind = STARTED["episodes"] % 4
    if kind in (1, 2):
        await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=4)
        if kind == 1:
            raise ValueError("this agent fails on purpose")
        await asyncio.sleep(3600)
    return await answer_then_check(client, row)


@register_agent("raises_at_once")
async def raises_at_once(client, row):
    raise RuntimeError("nothing to call")
'''


@pytest.fixture(scope="module")
def agent_files(tmp_path_factory):
    """The registry (`toy`, and `agent_toy` / `flaky_toy` played by the agents above) and the agent module: one
    module for the whole test file, since two files may not register the same agent names."""
    folder = tmp_path_factory.mktemp("agent_data")
    registry = write_prompt_registry(str(folder))
    add_dataset(registry, "agent_toy", CALC_ROWS, agent="two_calls", rewards={"agent_reward": 1.0})
    add_dataset(registry, "flaky_toy", CALC_ROWS, agent="sometimes_fails", rewards={"agent_reward": 1.0})
    add_dataset(registry, "unknown_agent_toy", CALC_ROWS, agent="nobody", rewards={"agent_reward": 1.0})
    add_dataset(registry, "broken_toy", CALC_ROWS, agent="raises_at_once", rewards={"agent_reward": 1.0})
    module = folder / "my_agents.py"
    module.write_text(AGENT_MODULE)
    return registry, str(module)


def final_words(completions, answers, **row):
    """Positive for every completion: an episode that scores 0 got its 0 from its agent's failure."""
    return [1.0 + len(text.split()) for text in completions]


class Recorder:
    """Every engine call's prompts and completions, and every step's rollout and batch."""

    def __init__(self, trainer):
        self.sampled: list[tuple[list[int], object]] = []
        self.steps: list[tuple[object, object]] = []
        engine, build = trainer.rollout_engine, trainer._rollout_batch
        generate = engine.generate

        def recording_generate(prompts, sampling, images=None):
            out = generate(prompts, sampling, images)
            self.sampled += [(list(prompts[c.prompt_index]), c) for c in out]
            return out

        def recording_batch(rollout):
            batch = build(rollout)
            self.steps.append((rollout, batch))
            return batch

        engine.generate = recording_generate
        trainer._rollout_batch = recording_batch

    @classmethod
    def of_run(cls, config) -> "Recorder":
        """Train a run of `config` (rewards: final_words) and return what it recorded."""
        from grpo.train.trainer import GRPOTrainer

        trainer = GRPOTrainer(config, reward_funcs=[final_words])
        recorder = cls(trainer)
        try:
            trainer.train()
        finally:
            trainer.close()
        return recorder

    def sample_of(self, call):
        """The engine's completion that answered this recorded call (a call may cut a sample to its own max_tokens:
        a prefix of it)."""
        n = len(call.completion_ids)
        for prompt, completion in self.sampled:
            if prompt == call.prompt_ids and completion.token_ids[:n] == call.completion_ids:
                return completion.token_ids[:n], completion.logprobs[:n]
        raise AssertionError(f"call {call.index} was never sampled by the engine")


@pytest.fixture(scope="module")
def flaky_run(tiny_model, agent_files, tmp_path_factory):
    """Two GRPO steps on `flaky_toy` (2 prompts x 4 episodes per step), the engine's log-probs asked for every step;
    returns the recorder and the output folder."""
    registry, module = agent_files
    out = str(tmp_path_factory.mktemp("flaky_out"))
    config = tiny_config(tiny_model, registry, out, dataset_names=["flaky_toy"], agent_module=module,
                         agent_timeout_s=15.0, rollout_max_new_tokens=8, max_prompt_length=64, max_seq_length=160,
                         logprob_check_steps=1, train_split_ratio=1.0)  # (time enough on a busy machine)
    return Recorder.of_run(config), out


def test_agent_episodes_train_token_exactly(flaky_run):
    """Each batch row is its episode's first prompt and assembled calls, id for id; its mask is 1 on exactly the ids
    the engine sampled for the agent's calls, and the batch's rollout log-probs there are the engine's own."""
    recorder, out = flaky_run
    assert len(recorder.steps) == 2
    for rollout, batch in recorder.steps:
        episodes = [e for p in rollout.prompts for e in p[EPISODES_KEY]]
        assert len(episodes) == batch.input_ids.shape[0] == 8
        for row, episode in enumerate(episodes):
            assert isinstance(episode, AgentEpisode) and episode.mismatch is None and episode.calls
            sampled_ids, sampled_logprobs = [], []
            for call in episode.calls:
                ids, logprobs = recorder.sample_of(call)
                sampled_ids += ids
                sampled_logprobs += logprobs
            width = batch.input_ids.shape[1] - batch.completion_width
            length = int(batch.attention_mask[row, width:].sum())
            sequence = [t for t, a in zip(batch.input_ids[row].tolist(), batch.attention_mask[row].tolist()) if a]
            assert sequence == episode.prompt_ids + episode.completion_ids
            mask = batch.completion_mask[row, :length]
            trained = batch.completion_ids[row, :length][mask == 1].tolist()
            assert trained == sampled_ids and len(trained) == sum(episode.mask)
            assert batch.completion_mask[row, length:].sum() == 0
            torch.testing.assert_close(batch.rollout_logprobs[row, :length][mask == 1],
                                       torch.tensor(sampled_logprobs), rtol=0, atol=0)
            assert len(episode.calls) == (2 if episode.ok else 1)
    rows = train_rows(out)
    for row in rows:
        # the trainer's log-probs of the sampled tokens, in the sequence laid out so, are the engine's
        assert row["rollout/logprob_diff_mean"] < 1e-4 and row["rollout/logprob_diff_max"] < 1e-3, row
    assert rows[0]["grad_norm"] > 0


def test_failing_and_hanging_agents_score_zero_and_are_counted(flaky_run):
    recorder, out = flaky_run
    for rollout, _ in recorder.steps:
        episodes = [e for p in rollout.prompts for e in p[EPISODES_KEY]]
        failed = [e for e in episodes if not e.ok]
        assert len(failed) == 4 and sum(e.timed_out for e in failed) == 2, [(e.error, e.seconds) for e in episodes]
        assert any("this agent fails on purpose" in e.error and "my_agents.py" in e.error for e in failed)
        for i, episode in enumerate(episodes):
            if episode.ok:
                assert rollout.result.per_function["agent_reward"][i] == 0.5
                assert rollout.result.total[i] > 1.5  # its agent's 0.5 and final_words
            else:
                assert rollout.result.total[i] == 0.0 and rollout.result.per_function["agent_reward"][i] == 0.0
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["agents/episodes"] == 8
        assert row["agents/errors"] == 0.5 and row["agents/timeouts"] == 0.25
        assert row["agents/calls"] == 1.5 and row["agents/mismatches"] == 0
        assert "agents/rerender_differs" in row
    assert os.path.isdir(os.path.join(out, "lora_adapter"))  # the run went on to its end


def test_shared_prompt_leads_each_completion_with_the_rest_of_its_own():
    """Episodes whose first prompts differ share their common ids as the row's prompt; the rest of each one's first
    prompt leads its completion, masked, so that every row is its own episode id for id."""
    def episode(prompt, completion):
        return AgentEpisode(0, {}, prompt_ids=prompt, completion_ids=completion, mask=[1] * len(completion),
                            logprobs=[-0.5] * len(completion), finish_reason="stop")

    group = [episode([1, 2, 3, 4], [9, 9]), episode([1, 2, 5], [8]), episode([7], [])]
    shared = shared_prompt(group, fallback=[1, 2, 3])
    assert shared == [1, 2]
    first, second, nothing = (episode_completion(e, shared) for e in group)
    assert (first.token_ids, first.mask, first.logprobs) == ([3, 4, 9, 9], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.5])
    assert (second.token_ids, second.mask) == ([5, 8], [0, 1])
    assert (nothing.token_ids, nothing.mask) == ([], [])  # no sampled id: nothing to train on
    assert shared_prompt([episode([4], []), episode([5], [])], fallback=[1, 2]) == [1, 2]
    # first prompts that share no id: the row keeps the first one's first id, the other is not trained on
    apart = [episode([1, 2], [9]), episode([3, 4], [8])]
    assert shared_prompt(apart, fallback=[0]) == [1]
    assert episode_completion(apart[1], [1]).token_ids == []


def start_run(tiny_model, registry, tmp_path, **options):
    config = tiny_config(tiny_model, registry, str(tmp_path / "out"), dataset_names=["agent_toy"], **options)
    return prepare_run(config)


def test_agent_module_errors_come_before_any_model_loads(agent_files, tmp_path, monkeypatch):
    """A missing file, a file that registers no agent, an agent name nobody registered: each a clear error, raised
    before the tokenizer or any model is loaded."""
    import grpo.model.loading as loading

    def no_loading(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the agents were checked")
    monkeypatch.setattr(loading, "load_tokenizer", no_loading)
    registry, module = agent_files
    missing = str(tmp_path / "missing.py")
    with pytest.raises(AgentError, match=r"--agent_module: file not found: .*missing\.py"):
        start_run("/no/such/model", registry, tmp_path, agent_module=missing)
    empty = tmp_path / "no_agents.py"
    empty.write_text("X = 1\n")
    with pytest.raises(AgentError, match=r"--agent_module .*no_agents\.py registers no agent: decorate an `async def "
                                         r"agent\(client, row\)`"):
        start_run("/no/such/model", registry, tmp_path, agent_module=str(empty))
    with pytest.raises(AgentError, match=r"dataset 'unknown_agent_toy' in .*: unknown agent 'nobody' \(after "
                                         r"importing .*my_agents\.py\)\. Registered: .*sometimes_fails.*two_calls"):
        config = tiny_config("/no/such/model", registry, str(tmp_path / "out"), dataset_names=["unknown_agent_toy"],
                             agent_module=module)
        prepare_run(config)


def test_options_agent_episodes_do_not_run_with_are_refused(tmp_path):
    from grpo.train.agent_setup import check_agent_options

    with pytest.raises(ConfigError, match="agent episodes run against the engine of the process that trains"):
        check_agent_options(_Options(rollout_mode="server"), ["agent_toy"])
    with pytest.raises(ConfigError, match="use --vllm_tp 1"):
        check_agent_options(_Options(vllm_tp=2), ["agent_toy"])
    with pytest.raises(ConfigError, match="use --sequence_parallel_size 1"):
        check_agent_options(_Options(sequence_parallel_size=2), ["agent_toy"])
    with pytest.raises(ConfigError, match="drop --routing_replay"):
        check_agent_options(_Options(routing_replay=True), ["agent_toy"])
    automatic = GRPOConfig(output_dir=str(tmp_path))  # the run's own copy, resolved before it is frozen
    check_agent_options(automatic, ["agent_toy"])
    assert automatic.routing_replay is False  # decided here, before the model's config could turn it on
    with pytest.raises(ConfigError, match="--agent_timeout_s: must be a number of seconds > 0"):
        GRPOConfig(output_dir=str(tmp_path), agent_timeout_s=-1)
    with pytest.raises(ConfigError, match="--agent_max_concurrency: must be >= 0"):
        GRPOConfig(output_dir=str(tmp_path), agent_max_concurrency=-1)


class _Options:
    def __init__(self, rollout_mode="colocate", vllm_tp=1, sequence_parallel_size=1, routing_replay=None):
        self.rollout_mode, self.vllm_tp, self.sequence_parallel_size = rollout_mode, vllm_tp, sequence_parallel_size
        self.routing_replay = routing_replay


def test_registry_key_agent_is_checked(tmp_path):
    registry = write_prompt_registry(str(tmp_path))
    add_dataset(registry, "bad", CALC_ROWS, agent="  ")
    with pytest.raises(DatasetError, match='"agent" must be the name of a registered agent'):
        load_dataset_registry(registry)
    add_dataset(registry, "bad", CALC_ROWS, agent="two_calls", tools=["calculator"])
    with pytest.raises(DatasetError, match='an "agent" plays the whole episode .* does not combine with "tools"'):
        load_dataset_registry(registry)
    add_dataset(registry, "bad", CALC_ROWS, agent="two_calls", demonstrations="demos.jsonl")
    with pytest.raises(DatasetError, match='"demonstrations" are laid out as the trainer\'s own tool episodes'):
        load_dataset_registry(registry)


def test_shipped_example_agent_and_its_dataset(tmp_path):
    """arith_agent names the example agent; with --agent_module examples/calculator_agent.py its check passes."""
    from grpo.train.agent_setup import check_agent_datasets

    shipped = os.path.join(ROOT, "configs", "dataset_config.json")
    config = GRPOConfig(output_dir=str(tmp_path), dataset_config_path=shipped, dataset_names=["arith_agent"],
                        agent_module=os.path.join(ROOT, "examples", "calculator_agent.py"))
    found = check_agent_datasets(config, load_dataset_registry(shipped), config.dataset_names)
    assert list(found) == ["arith_agent"] and found["arith_agent"].agent_name == "calculator_agent"


def test_train_grpo_says_what_is_wrong_with_agent_module(agent_files, tmp_path):
    registry, _ = agent_files
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "--dataset_config_path", registry,
                           "--dataset_names", "agent_toy", "--agent_module", str(tmp_path / "nope.py"),
                           "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=300)
    assert proc.returncode == 1
    assert "error: --agent_module: file not found" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_an_answer_after_the_agents_loop_closed_is_dropped():
    """Every episode may time out while the engine generates their last calls: the loop is closed by the time the
    answers come, and answering them must not stop the run."""
    import asyncio

    from grpo.agents.endpoint import GenerationRequest
    from grpo.rollout.engine import Completion

    loop = asyncio.new_event_loop()
    future = loop.create_future()
    loop.close()
    GenerationRequest([1, 2], 4, future, loop).answer(Completion(0, [3], [-0.5], "stop"))
    assert not future.done()


def long_context_copy(model_dir: str, folder) -> str:
    """The tiny model with room for 1024 positions (rotary: nothing else changes): the calculator's instructions
    take ~170 of its word-level tokens."""
    import shutil

    shutil.copytree(model_dir, folder)
    with open(os.path.join(folder, "config.json")) as fh:
        config = json.load(fh)
    config["max_position_embeddings"] = 1024
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh)
    return str(folder)


def test_train_grpo_trains_the_example_agent(tiny_model, tmp_path):
    """train_grpo.py as the docs write it: the shipped arith_agent, examples/calculator_agent.py brought with
    --agent_module, one step and an evaluation on the tiny model; the calculator's schema reaches the model through
    the system message (the tiny ChatML template ignores `tools=`)."""
    out = tmp_path / "out"
    model = long_context_copy(tiny_model, tmp_path / "model")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train_grpo.py"), "--model_name_or_path", model,
         "--dataset_names", "arith_agent", "--agent_module", os.path.join(ROOT, "examples", "calculator_agent.py"),
         "--rollout_engine", "hf", "--output_dir", str(out), "--max_steps", "1", "--per_device_train_batch_size", "2",
         "--k_samples", "2", "--rollout_max_new_tokens", "8", "--max_prompt_length", "320", "--max_seq_length", "400",
         "--eval_max_prompts", "2", "--eval_on_start", "false", "--save_steps", "0", "--lora_rank", "4",
         "--lora_alpha", "8", "--lora_dropout", "0", "--seed", "0"],
        capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = train_rows(out)
    assert len(rows) == 1 and rows[0]["agents/episodes"] == 4 and rows[0]["agents/errors"] == 0
    assert 1 <= rows[0]["agents/calls"] <= 3
    evals = [r for r in json.loads("[" + ",".join(open(out / "metrics.jsonl")) + "]") if "eval/reward/mean" in r]
    assert evals and "eval/arith_agent/rewards/boxed_accuracy" in evals[-1]
    assert evals[-1]["eval/agents/episodes"] == 2 and evals[-1]["eval/agents/errors"] == 0  # one per eval prompt


def test_agent_rows_and_plain_rows_train_in_one_step(tiny_model, agent_files, tmp_path):
    """A step of plain prompts and agent episodes together: the plain rows generate in one turn (no mask), the agent
    rows are their episodes, and both train."""
    registry, module = agent_files
    config = tiny_config(tiny_model, registry, str(tmp_path / "out"), dataset_names=["toy", "agent_toy"],
                         agent_module=module, per_device_train_batch_size=4, max_steps=1, rollout_max_new_tokens=8,
                         max_prompt_length=64, max_seq_length=160, train_split_ratio=1.0, seed=3)
    (rollout, batch), = Recorder.of_run(config).steps
    sources = [p["data_source"] for p in rollout.prompts]
    assert set(sources) == {"toy", "agent_toy"}, sources  # (seed 3 draws both)
    for g, prompt in enumerate(rollout.prompts):
        group = rollout.completions[g * 4:(g + 1) * 4]
        if prompt["data_source"] == "toy":
            assert EPISODES_KEY not in prompt and all(c.mask is None for c in group)
        else:
            assert [c.mask for c in group] == [episode_completion(e, prompt["prompt_ids"]).mask
                                               for e in prompt[EPISODES_KEY]]
            assert all(e.ok and len(e.calls) == 2 for e in prompt[EPISODES_KEY])
    row = train_rows(tmp_path / "out")[0]
    assert row["agents/episodes"] == 4 * sources.count("agent_toy") and row["agents/errors"] == 0
    assert row["grad_norm"] > 0


def test_engines_the_endpoint_cannot_drive_alone_are_refused(tmp_path):
    from grpo.agents.rollouts import AgentDataset, agent_rollouts

    class ServerEngine:
        runs_episodes, generates_in_step = True, True

    datasets = {"agent_toy": AgentDataset("agent_toy", "two_calls", lambda client, row: None)}
    with pytest.raises(ConfigError, match="generates with every rank together"):
        agent_rollouts(GRPOConfig(output_dir=str(tmp_path)), datasets, ServerEngine())


def test_a_step_whose_agents_all_fail_before_calling_goes_on(tiny_model, agent_files, tmp_path):
    """Every episode of the step fails before its first call: nothing to train on (empty completions, reward 0), and
    the run takes its step and ends as usual."""
    from grpo.train.trainer import GRPOTrainer

    registry, module = agent_files
    config = tiny_config(tiny_model, registry, str(tmp_path / "out"), dataset_names=["broken_toy"],
                         agent_module=module, max_steps=1, train_split_ratio=1.0)
    trainer = GRPOTrainer(config, reward_funcs=[final_words])
    try:
        trainer.train()
    finally:
        trainer.close()
    row = train_rows(tmp_path / "out")[0]
    assert row["agents/errors"] == 1 and row["agents/calls"] == 0 and row["reward/mean"] == 0
    assert os.path.isdir(tmp_path / "out" / "lora_adapter")
