"""Dynamic sampling (DAPO): which groups a step keeps, and how rounds are drawn, against hand-picked cases."""
import pytest
import torch

from grpo.rollout.dynamic_sampling import RolloutRound, dynamic_rollouts, informative_groups, select_groups
from grpo.rewards import RewardResult
from grpo.rollout.engine import Completion


def test_informative_groups_by_hand():
    # groups of 3: [1,1,1] uniform, [0,1,0] differs, [2,2,2] uniform, [0,0,1] differs
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 2, 2, 2, 0, 0, 1])
    assert informative_groups(rewards, 3) == [1, 3]
    # differences below the tolerance count as equal: std of [0.5, 0.5 + 1e-9, 0.5] is ~6e-10 < 1e-6
    assert informative_groups(torch.tensor([0.5, 0.5 + 1e-9, 0.5, 0.0, 0.1, 0.0], dtype=torch.float64), 3) == [1]
    with pytest.raises(ValueError):
        informative_groups(torch.zeros(5), 2)


def test_select_groups_keeps_the_first_informative_then_tops_up():
    # enough informative groups: the first `target` of them, in draw order
    assert select_groups([1, 3, 4, 6, 7], num_groups=8, target=3) == [1, 3, 4]
    # too few: the informative ones plus the earliest uniform groups, so the step keeps its size
    assert select_groups([1, 3], num_groups=8, target=4) == [0, 1, 2, 3]
    assert select_groups([5], num_groups=8, target=3) == [0, 1, 5]
    # nothing informative: the first `target` groups, as without dynamic sampling
    assert select_groups([], num_groups=4, target=2) == [0, 1]


def fake_rounds(reward_rows):
    """run_round() returning one round per entry of `reward_rows` (a list of groups' rewards); prompts are numbered,
    and each completion's prompt_index counts within its round, as an engine's does."""
    drawn = {"n": 0}

    def run_round():
        groups = reward_rows[drawn["n"]]
        base = sum(len(g) for g in reward_rows[:drawn["n"]])
        drawn["n"] += 1
        prompts = [{"index": base + i} for i in range(len(groups))]
        total = [float(r) for g in groups for r in g]
        texts = [f"p{base + i}c{j}" for i, g in enumerate(groups) for j in range(len(g))]
        completions = [Completion(prompt_index=i, token_ids=[base + i, j], logprobs=[], finish_reason="stop")
                       for i, g in enumerate(groups) for j in range(len(g))]
        return RolloutRound(prompts, completions, texts, RewardResult(total, {"acc": list(total)}),
                            times={"rollout": 1.0})
    return run_round, drawn


def test_dynamic_rollouts_draws_until_full():
    # target 2 groups of 2; round 1: one informative ([0, 1]); round 2: one more ([1, 0]) -> stop after 2 rounds
    run_round, drawn = fake_rounds([[[1, 1], [0, 1]], [[1, 0], [0, 0]], [[0, 1], [1, 0]]])
    kept, all_drawn = dynamic_rollouts(run_round, group_size=2, target=2, max_rounds=3)
    assert drawn["n"] == 2
    assert [p["index"] for p in kept.prompts] == [1, 2]
    assert kept.texts == ["p1c0", "p1c1", "p2c0", "p2c1"] and kept.result.total == [0.0, 1.0, 1.0, 0.0]
    assert kept.result.per_function["acc"] == [0.0, 1.0, 1.0, 0.0]
    assert kept.stats == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/groups_kept": 2.0,
                          "dynamic_sampling/informative_groups": 2.0, "dynamic_sampling/prompts_drawn": 4.0}
    assert len(all_drawn.texts) == 8 and all_drawn.times["rollout"] == 2.0
    # prompt 2 was round 2's first prompt (prompt_index 0 there); kept second, its completions must point at 1
    assert [c.prompt_index for c in kept.completions] == [0, 0, 1, 1]
    assert_paired(kept) and assert_paired(all_drawn)


def assert_paired(rollouts):
    """Every completion points at its own prompt: token_ids[0] is the number of the prompt it was sampled for."""
    for c in rollouts.completions:
        assert rollouts.prompts[c.prompt_index]["index"] == c.token_ids[0], c
    return True


def test_dynamic_rollouts_stops_at_max_rounds_and_tops_up():
    # every round uniform but one group: after 2 rounds (the limit) 1 informative group + 1 uniform filler
    run_round, drawn = fake_rounds([[[1, 1], [0, 0]], [[1, 1], [1, 0]], [[0, 1], [1, 0]]])
    kept, _ = dynamic_rollouts(run_round, group_size=2, target=2, max_rounds=2)
    assert drawn["n"] == 2
    assert [p["index"] for p in kept.prompts] == [0, 3]
    assert_paired(kept)
    assert kept.stats["dynamic_sampling/groups_kept"] == 1.0 and kept.stats["dynamic_sampling/prompts_drawn"] == 4.0


def test_dynamic_rollouts_rounds_are_collective():
    # this rank is full after one round, but another rank is not (any_rank says so): it draws a second round too
    run_round, drawn = fake_rounds([[[0, 1], [1, 0]], [[0, 1], [1, 0]]])
    calls = []
    kept, _ = dynamic_rollouts(run_round, group_size=2, target=2, max_rounds=3,
                               any_rank=lambda short: calls.append(short) or len(calls) < 2)
    assert drawn["n"] == 2 and calls == [False, False]
    assert [p["index"] for p in kept.prompts] == [0, 1]
