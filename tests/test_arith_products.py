"""The shipped arith_products entry: files as the script writes them, disjoint splits, answers that are the arithmetic."""
import importlib.util
import json
import os

from grpo.data.loading import load_prompt_datasets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "configs", "dataset_config.json")
DATA = os.path.join(ROOT, "data", "arith_products")


def _script():
    spec = importlib.util.spec_from_file_location(
        "make_arith_products", os.path.join(ROOT, "scripts", "make_arith_products_dataset.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _rows(name):
    with open(os.path.join(DATA, name)) as fh:
        return [json.loads(line) for line in fh]


def test_files_are_what_the_script_generates_and_share_no_question():
    script = _script()
    rows = script.make_rows(2000 + 32 + 200, seed=4321)
    train, demos, held_out = _rows("train.jsonl"), _rows("calc_demonstrations.jsonl"), _rows("eval.jsonl")
    assert train == rows[:2000] and held_out == rows[2032:]
    assert [{k: d[k] for k in ("question", "answer")} for d in demos] == rows[2000:2032]
    questions = [{r["question"] for r in part} for part in (train, demos, held_out)]
    assert not (questions[0] & questions[1] or questions[0] & questions[2] or questions[1] & questions[2])
    # a demonstration is one calculator call on the question's expression, then the boxed answer
    call = json.loads(demos[0]["demonstration"][0].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call == {"name": "calculator", "arguments": {"expression": demos[0]["question"][8:-1]}}
    assert demos[0]["demonstration"][1] == f"The answer is \\boxed{{{demos[0]['answer']}}}."


def test_answers_are_the_arithmetic_of_the_questions():
    for row in _rows("eval.jsonl"):
        words = row["question"][8:-1].split()
        value = int(words[0]) * int(words[2])
        if len(words) == 5:
            value = value + int(words[4]) if words[3] == "+" else value - int(words[4])
        assert int(row["answer"]) == value and 10 <= int(words[0]) <= 99 and 10 <= int(words[2]) <= 99


def test_shipped_entries_load_with_the_held_out_file_as_eval():
    train, held_out = load_prompt_datasets(SHIPPED, ["arith_products"], 1.0, seed=0, eval_names=["arith_products_eval"])
    assert (len(train), len(held_out)) == (2000, 200)
    assert set(held_out["data_source"]) == {"arith_products_eval"}
    assert "\\boxed{}" in held_out[0]["messages"][-1]["content"]


def test_a_short_run_on_arith_products_warm_starts_trains_and_logs_tool_metrics(tmp_path):
    """One warm-start step on the shipped demonstrations, one GRPO step, eval on the held-out entry before and after:
    the tool metrics are logged for both evaluations and the step (a tiny random model: whether it calls is chance)."""
    import subprocess
    import sys

    from grpo.train.reporting import read_metrics

    from .tiny_models import make_tiny_model_dir
    from .trainer_setup import child_env

    model = make_tiny_model_dir(str(tmp_path / "model"))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train_grpo.py"), "--model_name_or_path", model,
         "--dataset_names", "arith_products", "--eval_dataset_names", "arith_products_eval", "--warm_start_steps", "1",
         "--max_steps", "1", "--per_device_train_batch_size", "2", "--k_samples", "2", "--rollout_engine", "hf",
         "--rollout_max_new_tokens", "8", "--max_turns", "2", "--max_episode_tokens", "24", "--max_prompt_length",
         "512", "--max_seq_length", "560", "--eval_max_prompts", "2", "--eval_on_start", "true", "--save_steps", "0",
         "--lora_rank", "4", "--lora_alpha", "8", "--output_dir", str(out)],
        capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warm start 1/1" in proc.stderr + proc.stdout
    rows = read_metrics(str(out / "metrics.jsonl"))
    evals = [r for r in rows if "eval/episodes/called_a_tool" in r]
    assert [r["step"] for r in evals] == [0, 1]
    assert all(0.0 <= r["eval/episodes/called_a_tool"] <= 1.0 for r in evals)
    assert any("episodes/called_a_tool" in r and "loss" in r for r in rows)
