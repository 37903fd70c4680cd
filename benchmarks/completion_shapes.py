"""Print, per training step, how the sampled completions are shaped: the share that contain a pattern at least once,
and the share that repeat it N or more times. Reads the one-sample-per-prompt log a run writes to
<output_dir>/completions/rank0.jsonl.

    python benchmarks/completion_shapes.py outputs/bench/learning/*/                  # \\boxed{ once / 3+ times
    python benchmarks/completion_shapes.py --pattern '####' --repeats 2 --steps 1 10 20 runs/*/

On `arith` this shows which reward a policy reaches first: a base that boxes from step 1 earns the format reward
before the number reward, and one that repeats the box fills the completion cap with it.
"""
import argparse
import json
import os
import re


def shapes_by_step(rows: list[dict], pattern: str, repeats: int) -> dict[int, tuple[float, float, int]]:
    """{step: (share matching at least once, share matching >= repeats times, completions)} of the logged rows."""
    regex = re.compile(pattern)
    counts: dict[int, list[int]] = {}
    for row in rows:
        counts.setdefault(row["step"], []).append(len(regex.findall(row["completion"])))
    return {step: (sum(c >= 1 for c in found) / len(found), sum(c >= repeats for c in found) / len(found), len(found))
            for step, found in sorted(counts.items())}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pattern", default=r"\\boxed\{", help="regular expression counted in each completion")
    parser.add_argument("--repeats", type=int, default=3, help="the second share counts this many matches or more")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 5, 8, 12, 20, 30, 40])
    parser.add_argument("runs", nargs="+", help="run output folders")
    args = parser.parse_args()
    print(f"share of completions with {args.pattern} once / {args.repeats}+ times, at steps {args.steps}")
    for run in args.runs:
        path = os.path.join(run, "completions", "rank0.jsonl")
        if not os.path.exists(path):
            print(f"{os.path.basename(os.path.normpath(run))}: no {path}")
            continue
        with open(path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        table = shapes_by_step(rows, args.pattern, args.repeats)
        cells = [f"{s}:{table[s][0]:.2f}/{table[s][1]:.2f}" for s in args.steps if s in table]
        print(f"{os.path.basename(os.path.normpath(run)):32s} " + " ".join(cells))


if __name__ == "__main__":
    main()
