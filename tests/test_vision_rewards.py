"""Image rewards: VQA exact match, multiple-choice letters, box IoU, with numbers worked by hand."""
import pytest

from grpo.errors import RewardError
from grpo.rewards import (box_iou, choice_accuracy, get_reward, iou_reward, normalize_text, parse_box, parse_choice,
                          vqa_accuracy)


def test_registered_under_their_names():
    assert get_reward("vqa_accuracy") is vqa_accuracy
    assert get_reward("choice_accuracy") is choice_accuracy
    assert get_reward("iou") is iou_reward


def test_vqa_normalization_and_accepted_answers():
    assert normalize_text("  The RED, circle! ") == "red circle"
    assert normalize_text("Three") == "3"
    completions = ["Red.", "<answer>three</answer>", "blue", "crimson", "", "<answer>a red one</answer>"]
    answers = ["red", "3", "red|crimson", '["red", "crimson"]', "red", "red"]
    assert vqa_accuracy(completions, answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    # the \boxed{} answer counts when there is no <answer> block
    assert vqa_accuracy(["I see \\boxed{Green}"], ["green"]) == [1.0]


def test_choice_letters():
    assert parse_choice("(B) blue") == "B"
    assert parse_choice("C. the circle") == "C"
    assert parse_choice("I think the answer is D") == "D"
    assert parse_choice("<answer>A</answer>") == "A"
    assert parse_choice("no letter here") is None  # lower-case words hold no standalone capital letter
    assert choice_accuracy(["(B)", "answer: C", "A", "E"], ["B", "(B)", "A", "A"]) == [1.0, 0.0, 1.0, 0.0]
    assert choice_accuracy(["E"], ["E"], choices="ABCDE") == [1.0]
    with pytest.raises(RewardError, match="not one of the letters"):
        choice_accuracy(["A"], ["7"])


def test_box_iou_by_hand():
    # overlap 1x1 = 1, union 4 + 4 - 1 = 7
    assert box_iou([0, 0, 2, 2], [1, 1, 3, 3]) == pytest.approx(1 / 7)
    # overlap 5x10 = 50, union 100 + 100 - 50 = 150
    assert box_iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(1 / 3)
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0
    assert box_iou([5, 5, 5, 9], [0, 0, 10, 10]) == 0.0  # empty box


def test_iou_reward_parses_the_last_box_and_thresholds():
    assert parse_box("first [1, 2, 3, 4] then (5, 6.5, 7, 8)") == (5.0, 6.5, 7.0, 8.0)
    assert parse_box("<answer>[0,0,2,2]</answer> later [9, 9, 9, 9]") == (0.0, 0.0, 2.0, 2.0)
    completions = ["the box is [5, 0, 15, 10]", "no box", "<answer>[0, 0, 10, 10]</answer>"]
    gold = ["[0, 0, 10, 10]"] * 3
    assert iou_reward(completions, gold) == pytest.approx([1 / 3, 0.0, 1.0])
    assert iou_reward(completions, gold, threshold=0.5) == [0.0, 0.0, 1.0]
    assert iou_reward(completions, gold, threshold=1 / 3) == [1.0, 0.0, 1.0]
    with pytest.raises(RewardError, match="threshold"):
        iou_reward(completions, gold, threshold=1.5)
    with pytest.raises(RewardError, match="not a box"):
        iou_reward(["[1, 2, 3, 4]"], ["red"])
