"""Generate the bundled `arith_products` set: arithmetic a 135M model cannot do in its head, so the calculator pays.

    python scripts/make_arith_products_dataset.py    # writes data/arith_products/{train,eval,calc_demonstrations}.jsonl

Rows are {"question": "What is 47 * 86 + 312?", "answer": "4354"}: a product of two two-digit numbers (10..99), half
of them with a three-digit number (100..999) added or subtracted after it. The embedded SmolLM2-135M gets almost none
right without a tool; with one calculator call every one is right. Deterministic (one `random.Random(seed)`).

The three files share no question: one generator draws the training rows first, then the demonstrations (the
model's two turns written out: a calculator call, then the boxed answer; few on purpose, for a short warm start that
leaves most episodes without a call), then the held-out rows (`arith_products_eval`, evaluated with
--eval_dataset_names, never trained on).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import random  # noqa: E402

from make_arith_dataset import calculator_demonstration, to_jsonl  # noqa: E402

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "arith_products")


def make_rows(count: int, seed: int) -> list[dict]:
    """`count` distinct problems drawn by a `random.Random(seed)`: the same arguments give the same rows."""
    if count <= 0:
        raise ValueError(f"count must be positive, got {count}")
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < count:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        kind = rng.choice(["mul", "mul", "add", "sub"])
        if kind == "mul":
            question, answer = f"What is {a} * {b}?", a * b
        else:
            c = rng.randint(100, 999)
            sign = 1 if kind == "add" else -1
            question, answer = f"What is {a} * {b} {'+' if sign > 0 else '-'} {c}?", a * b + sign * c
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": str(answer)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=2000, help="training rows (train.jsonl)")
    parser.add_argument("--demonstrations", type=int, default=32, help="calculator demonstrations")
    parser.add_argument("--eval", type=int, default=200, help="held-out rows (eval.jsonl)")
    parser.add_argument("--seed", type=int, default=4321)
    parser.add_argument("--out_dir", default=DEFAULT_DIR)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    rows = make_rows(args.train + args.demonstrations + args.eval, args.seed)
    train, demos = rows[:args.train], rows[args.train:args.train + args.demonstrations]
    held_out = rows[args.train + args.demonstrations:]
    for name, part in (("train.jsonl", train), ("calc_demonstrations.jsonl", [calculator_demonstration(r) for r in demos]),
                       ("eval.jsonl", held_out)):
        path = os.path.join(args.out_dir, name)
        with open(path, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(to_jsonl(part))
        print(f"wrote {len(part)} rows to {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
