"""Generate the bundled `arith` set: easy arithmetic a small instruct model can learn to answer with RL.

    python scripts/make_arith_dataset.py            # writes data/arith/train.jsonl (deterministic)
"""
import argparse
import json
import os
import random


def make_rows(count: int, seed: int) -> list[dict]:
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "data", "arith", "train.jsonl"))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        for row in make_rows(args.count, args.seed):
            fh.write(json.dumps(row) + "\n")
    print(f"wrote {args.count} rows to {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
