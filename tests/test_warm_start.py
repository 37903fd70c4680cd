"""Warm start (--warm_start_steps): demonstrations laid out as sampled episodes, the update at advantage 1 is the
supervised gradient, a run learns its demonstrations before GRPO's first step, and a missing or malformed
demonstrations file stops before any model loads."""
import json
import os

import pytest
import torch

from grpo.algorithm import LossSettings, policy_loss
from grpo.data.loading import load_demonstrations
from grpo.errors import DatasetError
from grpo.rollout.episodes import EpisodeLimits, EpisodePrompt, scripted_episode
from grpo.tools import get_environment, tool_schemas, tools_system_prompt
from grpo.tools.template import EnvironmentTurns

from .test_episodes import smollm2_tokenizer
from .tiny_models import make_tiny_model_dir
from .trainer_setup import add_dataset, tiny_config, train_rows, write_prompt_registry

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "38 + 3"}}\n</tool_call>'
ANSWER = "The answer is \\boxed{41}."


def test_the_update_at_advantage_one_is_the_supervised_gradient():
    """With old log-probs = the pass's own (ratio 1) and every advantage 1, token_mean's loss has the gradient of the
    mean negative log-likelihood over the masked tokens: d loss / d lp = -mask / D, D = 3 model tokens here."""
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = policy_loss(lp, lp.detach(), torch.ones(2), mask, LossSettings())
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)  # -(1 + 1 + 1) / 3: each ratio is 1
    assert lp.grad.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, 0.0, -1 / 3, 0.0, 0.0])


def test_a_demonstration_is_laid_out_as_a_sampled_episode():
    """The reply's tokens and the template's end-of-turn token, the calculator's real answer as the environment's
    tokens (out of the mask), then the final reply: the ids a sampled episode with the same text would have."""
    tokenizer = smollm2_tokenizer()
    messages = [{"role": "system", "content": tools_system_prompt(tool_schemas(["calculator"]))},
                {"role": "user", "content": "What is 38 + 3?"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = EpisodePrompt(list(prompt_ids), messages, {"tools": ["calculator"], "answer": "41"},
                           environment=get_environment("tools"))
    episode = scripted_episode(prompt, [CALL, ANSWER], tokenizer, EpisodeLimits(max_turns=4, max_episode_tokens=400))

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = tokenizer.encode(CALL, add_special_tokens=False) + [end]
    tool_turn = EnvironmentTurns(tokenizer).ids([{"role": "tool", "content": "41"}], end)
    last = tokenizer.encode(ANSWER, add_special_tokens=False) + [end]
    assert episode.completion_ids == first + tool_turn + last
    assert episode.mask == [1] * len(first) + [0] * len(tool_turn) + [1] * len(last)
    assert [m["role"] for m in episode.messages[2:]] == ["assistant", "tool", "assistant"]
    assert episode.messages[3]["content"] == "41" and episode.tool_calls == 1 and episode.tool_errors == 0
    assert episode.turns == 2 and episode.finish_reason == "stop"

    cut = scripted_episode(prompt, [CALL, ANSWER], tokenizer, EpisodeLimits(max_turns=4, max_episode_tokens=5))
    assert cut.completion_ids == first[:5] and cut.finish_reason == "budget"  # the budget holds as for a sample


def demonstrations_registry(folder, rows) -> str:
    """`toy`, and `calc_toy` with the calculator and a demonstrations file of `rows`."""
    registry = write_prompt_registry(str(folder))
    add_dataset(registry, "calc_toy", [("What is 1 + 1?", "2")], tools=["calculator"],
                demonstrations="calc_demonstrations.jsonl")
    with open(os.path.join(str(folder), "calc_demonstrations.jsonl"), "w") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)
    return registry


def demonstration_rows(count: int) -> list[dict]:
    rows = []
    for a in range(1, count + 1):
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} + 3"}})
        rows.append({"question": f"What is {a} + 3?", "answer": str(a + 3),
                     "demonstration": [f"<tool_call>\n{call}\n</tool_call>", f"\\boxed{{{a + 3}}}"]})
    return rows


def test_demonstrations_files_are_checked_before_any_model_loads(tmp_path):
    registry = demonstrations_registry(tmp_path / "ok", demonstration_rows(3))
    rows = load_demonstrations(registry, ["toy", "calc_toy"])
    assert len(rows) == 3 and rows[0]["data_source"] == "calc_toy" and rows[0]["demonstration"][1] == "\\boxed{4}"
    assert rows[0]["messages"][-1] == {"role": "user", "content": "What is 1 + 3?"}

    with pytest.raises(DatasetError, match=r"none of the datasets toy has \"demonstrations\".*drop --warm_start_steps"):
        load_demonstrations(registry, ["toy"])
    bad = demonstrations_registry(tmp_path / "bad", demonstration_rows(2) + [{"question": "q", "answer": "1",
                                                                             "demonstration": "\\boxed{1}"}])
    with pytest.raises(DatasetError, match=r"record 3 of .*calc_demonstrations.jsonl.*non-empty list"):
        load_demonstrations(bad, ["calc_toy"])
    missing = demonstrations_registry(tmp_path / "missing", [{"question": "q", "answer": "1"}])
    with pytest.raises(DatasetError, match=r"no \"demonstration\" column"):
        load_demonstrations(missing, ["calc_toy"])
    os.remove(tmp_path / "ok" / "calc_demonstrations.jsonl")
    with pytest.raises(DatasetError, match="data file not found"):
        load_demonstrations(registry, ["calc_toy"])


def test_a_warm_start_learns_its_demonstrations_before_grpo_starts(tmp_path):
    """Four supervised steps on eight calculator demonstrations (all of them each step): the loss, the mean negative
    log-likelihood of the demonstrated turns, falls; then GRPO runs its step on the tool episodes."""
    from grpo import GRPOTrainer

    model = make_tiny_model_dir(str(tmp_path / "model"))
    registry = demonstrations_registry(tmp_path / "data", demonstration_rows(8))
    config = tiny_config(model, registry, str(tmp_path / "out"), dataset_names=["calc_toy", "toy"],
                         warm_start_steps=4, learning_rate=1e-2, max_steps=1, max_prompt_length=224,
                         max_seq_length=320, max_turns=2, rollout_max_new_tokens=8, eval_on_start=False)
    trainer = GRPOTrainer(config)
    trainer.train()
    losses = trainer.warm_start_losses
    assert len(losses) == 4 and all(loss > 0 for loss in losses)
    assert losses[-1] < 0.8 * losses[0]  # the demonstrated turns became likelier
    assert [row["step"] for row in train_rows(tmp_path / "out")] == [1]
    # GRPO's one update found a fresh optimizer: Adam counts 1 step, not 5
    from grpo.train.update import base_optimizer

    states = list(base_optimizer(trainer.engine.optimizer).state.values())
    assert states and all(int(state["step"]) == 1 for state in states)
    log = open(tmp_path / "out" / "train.log").read()
    assert "warm start 4/4: loss=" in log


def test_demonstrations_of_a_one_turn_dataset_are_one_completion():
    """A dataset without tools: the first reply and EOS, every token in the loss; a tool dataset's row beside it keeps
    its episode's mask."""
    from grpo.tools import get_environment
    from grpo.data.episode_datasets import EpisodeDataset
    from grpo.train.warm_start import demonstration_batch

    tokenizer = smollm2_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 38 + 3?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    rows = [{"prompt_ids": list(prompt), "messages": [{"role": "user", "content": "What is 38 + 3?"}],
             "answer": "41", "data_source": "plain", "demonstration": [ANSWER, "never used"]},
            {"prompt_ids": list(prompt), "messages": [{"role": "user", "content": "What is 38 + 3?"}],
             "answer": "41", "data_source": "calc", "demonstration": [CALL, ANSWER]}]
    calc = EpisodeDataset(["calculator"], get_environment("tools"))
    batch = demonstration_batch(rows, tokenizer, {"calc": calc}, EpisodeLimits(max_turns=3, max_episode_tokens=200))
    one_turn = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert batch.completion_id_lists[0] == one_turn
    assert batch.completion_mask[0].sum().item() == len(one_turn)
    model_tokens = len(tokenizer.encode(CALL, add_special_tokens=False)) + 1 + len(one_turn)  # each turn ends in <|im_end|>
    assert batch.completion_mask[1].sum().item() == model_tokens < len(batch.completion_id_lists[1])
