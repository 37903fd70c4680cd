"""Multi-turn tool episodes in training: train_grpo.py runs them end to end (HF engine, tiny model), environment tokens
carry no gradient while the sampled ids reach the loss exactly, and bad tool set-ups stop before any model loads."""
import json
import os
import subprocess
import sys

import pytest
import torch

from grpo.algorithm import LossSettings, policy_loss
from grpo.config.options import GRPOConfig
from grpo.data.registry import load_dataset_registry
from grpo.errors import ConfigError, DatasetError
from grpo.rewards import RewardRouter
from grpo.rollout.engine import Completion
from grpo.tools import tool_schemas, tools_system_prompt
from grpo.train.logprobs import completion_logprobs
from grpo.train.reporting import read_metrics
from grpo.train.step_data import build_rollout_batch
from grpo.data.episode_datasets import check_episode_datasets, prompts_with_tools
from grpo.train.update import step_normaliser

from .tiny_models import make_tiny_model_dir, make_tiny_tokenizer
from .trainer_setup import ROOT, add_dataset, child_env, train_rows, write_prompt_registry

SHIPPED_REGISTRY = os.path.join(ROOT, "configs", "dataset_config.json")
CALC_ROWS = [(f"What is {a} + {b} ?", str(a + b)) for a in range(1, 9) for b in range(1, 6)]

# an environment that asks the calculator the row's question after the model's first turn and ends the episode after
# its second: every episode that is not cut has two model turns and one tool call, whatever a random model writes
TOOL_MODULE = '''
from grpo.tools import EnvironmentStep, ToolCall, execute_calls, register_environment


@register_environment("calculator_then_done")
def calculator_then_done(messages, answer, tools=(), **fields):
    if sum(m["role"] == "assistant" for m in messages) > 1:
        return EnvironmentStep(done=True)
    question = next(m["content"] for m in messages if m["role"] == "user")
    expression = question.replace("What is", "").replace("?", "")
    results = execute_calls([ToolCall("calculator", {"expression": expression})], available=list(tools))
    return EnvironmentStep([r.message for r in results], tool_calls=1,
                           tool_errors=sum(r.status != "ok" for r in results))
'''

# a reward that reads the whole episode (1 when a tool message holds the row's answer), and one that differs between
# a random model's samples (the words of its last message), so that advantages are not all 0
REWARD_MODULE = '''
from grpo.rewards import register_reward


@register_reward("final_words")
def final_words(completions, answers, **row):
    return [float(len(text.split())) for text in completions]


@register_reward("tool_said_the_answer")
def tool_said_the_answer(completions, answers, messages, **row):
    return [float(any(m["role"] == "tool" and m["content"] == a for m in conversation))
            for conversation, a in zip(messages, answers)]
'''


def make_stopping_model_dir(path: str) -> str:
    """The tiny model made to end its turn early: every position predicts the same distribution, <|im_end|> with
    probability 1/2, so a turn of at most 8 tokens almost always ends with the stop token (and the environment
    answers it). Its residual stream is the embedding of one shared vector, the output layer maps it to fixed logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_tiny_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    stop = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        for layer in model.model.layers:  # the layers add nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        shared = model.model.embed_tokens.weight[stop].clone()                 # (not the pad row: that one is 0)
        model.model.embed_tokens.weight.copy_(shared.expand_as(model.model.embed_tokens.weight))
        hidden = model.model.norm(shared[None])[0]                              # [H], the same at every position
        vocab = model.lm_head.weight.shape[0]
        logits = torch.zeros(vocab)
        logits[stop] = torch.log(torch.tensor(vocab - 1.0))                    # p(stop) = 1/2
        model.lm_head.weight.copy_(logits[:, None] * hidden[None, :] / hidden.pow(2).sum())
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def stopping_model(tmp_path_factory):
    return make_stopping_model_dir(str(tmp_path_factory.mktemp("stopping_model")))


def tool_registry(folder, **calc_entry) -> str:
    """`toy` (plain prompts) and `calc_toy` (the calculator and the environment above), with the user files."""
    registry = write_prompt_registry(str(folder))
    entry = dict(tools=["calculator"], environment="calculator_then_done",
                 rewards={"boxed_accuracy": 1.0, "tool_said_the_answer": 1.0, "final_words": 0.1})
    add_dataset(registry, "calc_toy", CALC_ROWS, **{**entry, **calc_entry})
    with open(os.path.join(str(folder), "my_tools.py"), "w") as fh:
        fh.write(TOOL_MODULE)
    with open(os.path.join(str(folder), "my_rewards.py"), "w") as fh:
        fh.write(REWARD_MODULE)
    return registry


@pytest.fixture(scope="module")
def shared_tools(tmp_path_factory):
    """A folder of the registry and user files for the tests that import the tool module in this process: one file
    for all of them, since two files may not register the same environment name."""
    folder = tmp_path_factory.mktemp("shared_tools")
    tool_registry(folder)
    return folder


def run_train_grpo(*args, timeout=900):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=child_env(), timeout=timeout)


def test_train_grpo_runs_tool_episodes(stopping_model, tmp_path):
    """Two steps of train_grpo.py on the HF engine, plain and tool rows in one step: the episodes have two model
    turns around one calculator call, the rewards read the calculator's result, and the metrics say so."""
    registry = tool_registry(tmp_path / "data")
    out = tmp_path / "out"
    proc = run_train_grpo(
        "--model_name_or_path", stopping_model, "--dataset_config_path", registry, "--dataset_names", "toy,calc_toy",
        "--tool_module", str(tmp_path / "data" / "my_tools.py"),
        "--reward_module", str(tmp_path / "data" / "my_rewards.py"), "--output_dir", str(out),
        "--rollout_engine", "hf", "--max_steps", "2", "--per_device_train_batch_size", "4", "--k_samples", "4",
        "--rollout_max_new_tokens", "8", "--max_turns", "3", "--max_prompt_length", "192", "--max_seq_length", "240",
        "--max_episode_tokens", "40", "--train_split_ratio", "0.9", "--eval_max_prompts", "4", "--save_steps", "0",
        "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--learning_rate", "1e-2",
        "--loss_aggregation", "seq_mean_token_sum_norm", "--seed", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = train_rows(out)
    assert len(rows) == 2
    for row in rows:
        assert row["episodes/turns"] > 1.5, row            # a turn, the tool, a turn (rarely cut by 8 tokens)
        assert row["episodes/tool_calls"] == row["episodes/called_a_tool"] > 0.5
        assert row["episodes/tool_errors"] == row["episodes/tool_timeouts"] == 0
        assert row["rewards/tool_said_the_answer"] == row["episodes/tool_calls"]  # the calculator was right each time
        assert row["advantage/abs_mean"] > 0
    logged = [json.loads(line) for line in open(out / "completions" / "rank0.jsonl")]
    episodes = [r for r in logged if r["data_source"] == "calc_toy"]
    # the tool's turn as inserted (the tiny vocabulary has no word "tool"), the calculator's result in it
    assert episodes and all(f"<|im_start|> <unk> {r['answer']} <|im_end|>" in r["episode"] for r in episodes)
    assert all("episode" not in r for r in logged if r["data_source"] == "toy")
    evals = [r for r in read_metrics(str(out / "metrics.jsonl")) if "eval/episodes/turns" in r]
    assert max(row["grad_norm"] for row in rows) > 0  # the model tokens' loss moves the policy
    assert [r["step"] for r in evals] == [0, 2]  # greedy episodes, before and after training
    assert evals[0]["eval/episodes/turns"] == 2 and evals[0]["eval/calc_toy/rewards/tool_said_the_answer"] == 1


# an environment that asks again after every model turn and never ends the episode: it ends at --max_turns
ASK_AGAIN_MODULE = '''
from grpo.tools import EnvironmentStep, register_environment


@register_environment("ask_again")
def ask_again(messages, **fields):
    return EnvironmentStep([{"role": "user", "content": "What is 2 + 2 ?"}])
'''


def make_quick_stopping_model_dir(path: str) -> str:
    """The tiny random model, its turns also ended by the number tokens 0-24 (the generation config's EOS list): a
    turn of at most 16 tokens almost always ends with a stop token (and the environment answers it), while every
    log-prob stays a function of the whole context, the environment's tokens included."""
    from transformers import AutoTokenizer, GenerationConfig

    make_tiny_model_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    stops = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids([str(i) for i in range(25)])
    GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return path


def test_engine_logprobs_of_multi_turn_episodes_match_the_trainer(tmp_path):
    """The CPU twin of tests/gpu/test_multi_turn_sync.py: train_grpo.py on the HF engine in fp32, episodes of up to
    three model turns with the environment's tokens between them, the engine's log-probs asked for at every step. The
    HF engine samples from the policy being trained itself, so the trainer's log-probs of the model's tokens equal
    the engine's up to the float rounding of a cached decode against a full forward (measured: 3e-7 per token on
    average, 1.4e-6 at most); a next turn scored in another context than the one it was sampled in would be 0.08-0.5
    nats per token off (this model: one environment token too many or too few, none at all, a shift by one)."""
    model = make_quick_stopping_model_dir(str(tmp_path / "model"))
    registry = write_prompt_registry(str(tmp_path / "data"))
    add_dataset(registry, "ask_toy", CALC_ROWS, environment="ask_again", rewards={"length_penalty": 1.0},
                reward_kwargs={"length_penalty": {"target_chars": 2, "max_chars": 30}})  # differs within groups
    module = tmp_path / "data" / "ask_again.py"
    module.write_text(ASK_AGAIN_MODULE)
    out = tmp_path / "out"
    proc = run_train_grpo(
        "--model_name_or_path", model, "--dataset_config_path", registry, "--dataset_names", "ask_toy",
        "--tool_module", str(module), "--output_dir", str(out), "--rollout_engine", "hf", "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--k_samples", "4", "--rollout_max_new_tokens", "16", "--max_turns",
        "3", "--max_prompt_length", "32", "--max_seq_length", "128", "--logprob_check_steps", "1",
        "--train_split_ratio", "0.9", "--eval_max_prompts", "2", "--eval_on_start", "false", "--save_steps", "0",
        "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--learning_rate", "1e-2", "--seed", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["episodes/turns"] >= 2.0 and row["episodes/max_turns"] > 0.5, row  # multi-turn, as a rule
        assert row["rollout/logprob_diff_mean"] < 1e-4 and row["rollout/logprob_diff_max"] < 1e-3, row
    assert rows[0]["grad_norm"] > 0  # step 2 samples from an updated adapter


def test_environment_tokens_get_no_gradient_and_sampled_ids_reach_the_loss(tmp_path):
    """A hand-built episode (model turn, environment turn, model turn) through build_rollout_batch and the loss with
    KL and entropy terms: the loss's gradient with respect to the environment tokens' log-probs is exactly 0, the
    model tokens' is not, and the log-probs the loss reads are the model's own for exactly the ids sampled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model_dir(str(tmp_path / "model")))
    prompt = [2, 7, 30, 40, 3]
    model_turn_1, environment_turn, model_turn_2 = [50, 51, 3], [2, 8, 60, 3, 2, 9], [61, 62, 3]
    ids = model_turn_1 + environment_turn + model_turn_2
    mask = [1] * 3 + [0] * 6 + [1] * 3
    episode = Completion(0, ids, [-1.0] * len(ids), "stop", mask=mask)
    plain = Completion(0, [70, 71], [-1.0, -1.0], "stop")
    batch = build_rollout_batch([prompt], [episode, plain], pad_id=0)
    assert batch.completion_ids[0].tolist() == ids
    assert batch.completion_mask.tolist() == [[float(m) for m in mask], [1.0, 1.0] + [0.0] * 10]
    assert batch.input_ids[0].tolist() == prompt + ids

    logprobs, entropy = completion_logprobs(model, batch, temperature=1.0, with_entropy=True, chunk_tokens=4,
                                            entropy_grad=True)
    logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]   # [T, V] predicting each id
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    torch.testing.assert_close(logprobs[0], expected, rtol=1e-5, atol=1e-5)

    logprobs.retain_grad()
    entropy.retain_grad()
    old = logprobs.detach() - 0.1
    ref = logprobs.detach() + 0.3
    settings = LossSettings(beta=0.5, entropy_coef=0.1)
    loss, _ = policy_loss(logprobs, old, torch.tensor([1.0, -1.0]), batch.completion_mask, settings,
                          ref_logprobs=ref, entropy=entropy)
    loss.backward()
    environment = torch.tensor(mask) == 0
    assert torch.all(logprobs.grad[0, environment] == 0) and torch.all(entropy.grad[0, environment] == 0)
    assert torch.all(logprobs.grad[0, ~environment] != 0) and torch.all(entropy.grad[0, ~environment] != 0)


def test_episode_masks_follow_their_rows_through_dynamic_sampling():
    """Groups picked from several rounds keep each completion's mask (the batch is built from them)."""
    from grpo.rewards import RewardResult
    from grpo.rollout.dynamic_sampling import RolloutRound, concat_rounds, pick_groups

    def round_of(masks, rewards):
        completions = [Completion(0, [5] * (len(m) if m else 2), [], "stop", mask=m) for m in masks]
        return RolloutRound([{"index": len(masks)}], completions, [""] * len(masks), RewardResult(rewards, {}))

    drawn = concat_rounds([round_of([[1, 0], [1, 1]], [0.0, 0.0]), round_of([[1, 0, 0], None], [1.0, 0.0])], 2)
    kept = pick_groups(drawn, [1], 2)
    assert [c.mask for c in kept.completions] == [[1, 0, 0], None]
    batch = build_rollout_batch([[1, 2]], kept.completions, pad_id=0)
    assert batch.completion_mask.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


def test_constant_length_aggregation_counts_the_episode_budget(tmp_path):
    """seq_mean_token_sum_norm divides by a constant per sequence: a run with episodes passes its episode budget."""
    config = GRPOConfig(output_dir=str(tmp_path), loss_aggregation="seq_mean_token_sum_norm",
                        rollout_max_new_tokens=16, max_prompt_length=32, max_seq_length=128)
    batch = build_rollout_batch([[1, 2]], [Completion(0, [3, 4, 5], [], "stop", mask=[1, 0, 1])] * 2, pad_id=0)
    assert config.episode_token_budget == 96
    assert step_normaliser(batch, config) == 2 * 16
    assert step_normaliser(batch, config, config.episode_token_budget) == 2 * 96


def test_episode_options_are_checked():
    with pytest.raises(ConfigError, match="--max_episode_tokens: the prompt and an episode must fit --max_seq_length"):
        GRPOConfig(max_prompt_length=256, max_seq_length=768, max_episode_tokens=600)
    with pytest.raises(ConfigError, match="--max_turns: must be >= 1"):
        GRPOConfig(max_turns=0)


def test_registry_keys_for_tools_are_checked(tmp_path):
    registry = write_prompt_registry(str(tmp_path))
    add_dataset(registry, "bad", CALC_ROWS, tools="calculator")
    with pytest.raises(DatasetError, match='dataset \'bad\' .*"tools" must be a list of tool names'):
        load_dataset_registry(registry)
    add_dataset(registry, "bad", CALC_ROWS, tools=["calculator"], environment=3)
    with pytest.raises(DatasetError, match='"environment" must be the name of a registered environment'):
        load_dataset_registry(registry)


def test_shipped_arith_calc_offers_the_calculator_in_its_system_prompt(tmp_path):
    """arith_calc checks out, and a ChatML template that ignores tools= (SmolLM2's kind) gets the tool instructions in
    the system message, after the entry's own system prompt; other datasets' rows are untouched."""
    import datasets

    config = GRPOConfig(output_dir=str(tmp_path), dataset_config_path=SHIPPED_REGISTRY,
                        dataset_names=["arith", "arith_calc"])
    found = check_episode_datasets(config, load_dataset_registry(SHIPPED_REGISTRY), config.dataset_names)
    assert list(found) == ["arith_calc"] and found["arith_calc"].tools == ["calculator"]
    system = {"role": "system", "content": "Solve it."}
    rows = datasets.Dataset.from_list([
        {"messages": [system, {"role": "user", "content": "What is 2 + 2?"}], "data_source": source}
        for source in ("arith", "arith_calc")])
    rendered, in_template = prompts_with_tools(rows, make_tiny_tokenizer(), found)
    assert in_template == {}
    assert rendered[0]["messages"][0]["content"] == "Solve it."
    assert rendered[1]["messages"][0]["content"] == "Solve it.\n\n" + tools_system_prompt(tool_schemas(["calculator"]))


def test_a_template_that_shows_tools_gets_them_as_tools(shared_tools, tmp_path):
    import datasets

    from grpo.data.render import render_prompts
    from .test_episodes import make_tool_tokenizer

    tokenizer = make_tool_tokenizer()
    registry = str(shared_tools / "registry.json")
    config = GRPOConfig(output_dir=str(tmp_path), dataset_config_path=registry, dataset_names=["calc_toy"],
                        tool_module=str(shared_tools / "my_tools.py"))
    found = check_episode_datasets(config, load_dataset_registry(registry), ["calc_toy"])
    rows = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "What is 6 * 7?"}], "answer": "42",
                                        "data_source": "calc_toy"}])
    rows, in_template = prompts_with_tools(rows, tokenizer, found)
    assert in_template == {"calc_toy": tool_schemas(["calculator"])}
    text = render_prompts(rows, tokenizer, 512, tools_by_source=in_template)[0]["prompt_text"]
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n") and '"name": "calculator"' in text


def test_rewards_get_the_episode_only_when_they_take_it():
    """`messages` reaches a reward that names it (or takes **kwargs), never one written without it."""
    seen = {}

    def strict(completions, answers, prompts, data_source):
        return [1.0] * len(completions)

    def reads_episode(completions, answers, prompts, data_source, messages):
        seen["messages"] = messages
        return [float(len(m)) for m in messages]

    router = RewardRouter({"d": {}}, extra_funcs=[strict, reads_episode])
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    result = router(["a"], ["1"], ["d"], messages=[conversation])
    assert result.per_function == {"strict": [1.0], "reads_episode": [2.0]}
    assert seen["messages"] == [conversation]


@pytest.mark.parametrize("problem, fragments", [
    ("unknown tool", ["dataset 'calc_toy'", "unknown tool 'abacus'", "Registered: ", "calculator",
                      "--tool_module"]),
    ("missing module", ["--tool_module: file not found: ", "no_such_tools.py"]),
    ("unknown environment", ["dataset 'calc_toy'", "unknown environment 'arena'", "--tool_module"]),
])
def test_bad_tool_setups_fail_before_any_model_loads(problem, fragments, tmp_path):
    """Each is one message and no traceback; the model path does not even exist, so nothing was loaded."""
    entry = {"unknown tool": dict(tools=["calculator", "abacus"]), "unknown environment": dict(environment="arena"),
             "missing module": {}}[problem]
    registry = tool_registry(tmp_path, **entry)
    module = str(tmp_path / ("no_such_tools.py" if problem == "missing module" else "my_tools.py"))
    proc = run_train_grpo("--model_name_or_path", str(tmp_path / "no_model_here"), "--dataset_config_path",
                          registry, "--dataset_names", "calc_toy", "--tool_module", module,
                          "--reward_module", str(tmp_path / "my_rewards.py"), "--output_dir", str(tmp_path / "out"),
                          timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in error[0], error[0]
    assert "no_model_here" not in error[0]


def test_tool_datasets_are_found_and_refused_with_images(shared_tools, tmp_path):
    """The datasets that run as episodes are found (in server mode too, --async_rollout included: the rollout ranks
    run them); one with images is one ConfigError, given before the tokenizer loads. (check_episode_datasets reads
    only these options; GRPOConfig itself needs a job of several ranks for server mode.)"""
    from types import SimpleNamespace

    registry = str(tmp_path / "registry.json")
    with open(shared_tools / "registry.json") as src, open(registry, "w") as dst:
        dst.write(src.read())
    options = dict(tool_module=str(shared_tools / "my_tools.py"), dataset_config_path=registry)
    server = SimpleNamespace(rollout_mode="server", async_rollout=True, **options)
    found = check_episode_datasets(server, load_dataset_registry(registry), ["toy", "calc_toy"])
    assert list(found) == ["calc_toy"] and found["calc_toy"].tools == ["calculator"]
    add_dataset(registry, "calc_images", CALC_ROWS, tools=["calculator"], image_field="image")
    with pytest.raises(ConfigError, match="dataset 'calc_images'.*\"image_field\""):
        check_episode_datasets(SimpleNamespace(rollout_mode="colocate", async_rollout=False, **options),
                               load_dataset_registry(registry), ["calc_images"])
    # plain datasets pass in any mode
    assert check_episode_datasets(SimpleNamespace(rollout_mode="server", async_rollout=True, **options),
                                  load_dataset_registry(registry), ["toy"]) == {}


def test_a_rollout_rank_checks_it_finds_the_trainers_episode_datasets(shared_tools, stopping_model, tmp_path):
    """Server mode: a rollout rank finds the episode datasets the trainer named in its registry (read on its own
    node) before its engine loads, and says so clearly when they differ."""
    from types import SimpleNamespace

    from grpo.entry.serve import EpisodeHost

    options = dict(tool_module=str(shared_tools / "my_tools.py"),
                   dataset_config_path=str(shared_tools / "registry.json"), dataset_names=["toy", "calc_toy"], eval_dataset_names=[], model_name_or_path=stopping_model,
                   trust_remote_code=False, rollout_mode="server")
    host = EpisodeHost.for_run(SimpleNamespace(**options), ["calc_toy"])
    assert list(host.datasets) == ["calc_toy"] and host.tokenizer is not None
    assert EpisodeHost.for_run(SimpleNamespace(**options), []).datasets == {}  # no episodes: the registry is not read
    with pytest.raises(ConfigError, match=r"runs dataset\(s\) calc_toy, other_toy as episodes.*would run calc_toy.*"
                                          r"same on every node"):
        EpisodeHost.for_run(SimpleNamespace(**options), ["calc_toy", "other_toy"])

