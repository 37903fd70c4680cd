"""Generate the bundled `arith` set: easy arithmetic a small instruct model can learn to answer with RL.

    python scripts/make_arith_dataset.py            # writes data/arith/train.jsonl (deterministic)
    python scripts/make_arith_dataset.py --demonstrations 256   # and data/arith/calc_demonstrations.jsonl

Demonstrations (`arith_calc`'s, for --warm_start_steps) are further problems of the same draw, none of them in
train.jsonl, each with the model's two turns written out: a calculator call, then the boxed answer.

Rows are {"question": "What is 23 + 48?", "answer": "71"}, without repeats: addition of numbers 1..50 (half the
draws), subtraction within 1..60 with a non-negative result (a quarter), and the one-digit times table 2..9 (a
quarter of the draws, but only its 64 distinct questions). Easy on purpose: a 135M-parameter model gets some right
from the start, so group-relative advantages are non-zero and the reward can rise within a few dozen steps.
"""
import argparse
import json
import os
import random

DISTINCT_PROBLEMS = 50 * 50 + sum(range(2, 61)) + 8 * 8  # additions + subtractions + products = 4393
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "arith", "train.jsonl")


def make_rows(count: int, seed: int) -> list[dict]:
    """`count` distinct problems drawn by a `random.Random(seed)`: the same arguments give the same rows."""
    if not 0 < count <= DISTINCT_PROBLEMS:
        raise ValueError(f"count must be in 1..{DISTINCT_PROBLEMS} (the distinct problems there are), got {count}")
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < count:
        kind = rng.choice(["add", "add", "sub", "mul"])
        if kind == "add":
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            question, answer = f"What is {a} + {b}?", a + b
        elif kind == "sub":
            a = rng.randint(2, 60)
            b = rng.randint(1, a)
            question, answer = f"What is {a} - {b}?", a - b
        else:
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            question, answer = f"What is {a} * {b}?", a * b
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": str(answer)})
    return rows


def calculator_demonstration(row: dict) -> dict:
    """The row with the turns a model using the calculator writes: the call (Hermes style), then the answer."""
    expression = row["question"].removeprefix("What is ").removesuffix("?")
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return {**row, "demonstration": [f"<tool_call>\n{call}\n</tool_call>",
                                     f"The answer is \\boxed{{{row['answer']}}}."]}


def to_jsonl(rows: list[dict]) -> str:
    """One JSON object per line, as data/arith/train.jsonl holds them."""
    return "".join(json.dumps(row) + "\n" for row in rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000,
                        help=f"distinct problems to write (at most {DISTINCT_PROBLEMS})")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--demonstrations", type=int, default=0,
                        help="also write this many calculator demonstrations (problems after the --count drawn)")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # the same generator draws the training rows first, so the rows after them are never training rows
    rows = make_rows(args.count + args.demonstrations, args.seed)
    with open(args.out, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(to_jsonl(rows[:args.count]))
    print(f"wrote {args.count} rows to {os.path.normpath(args.out)}")
    if args.demonstrations:
        out = os.path.join(os.path.dirname(os.path.abspath(args.out)), "calc_demonstrations.jsonl")
        with open(out, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(to_jsonl([calculator_demonstration(row) for row in rows[args.count:]]))
        print(f"wrote {args.demonstrations} demonstrations to {os.path.normpath(out)}")


if __name__ == "__main__":
    main()
