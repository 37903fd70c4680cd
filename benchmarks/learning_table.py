"""Print the learning benchmark's table from finished runs: held-out accuracy at step 0 and at the end.

    python benchmarks/learning_table.py outputs/bench/learning/*/

Each run folder holds metrics.jsonl (written by the trainer) and bench.json (written by learning.sh: dataset,
strategy, seed, learning rate, accuracy key, wall seconds, GPU).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.reporting import read_metrics  # noqa: E402


def summarize(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "bench.json")) as fh:
        info = json.load(fh)
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    key = f"eval/rewards/{info['accuracy']}"
    evals = [r for r in rows if key in r]
    train = [r for r in rows if "loss" in r]
    first = next((r for r in evals if r["step"] == 0), None)
    last = evals[-1] if evals and evals[-1]["step"] > 0 else None
    return {**info, "acc_start": first[key] if first else None, "acc_end": last[key] if last else None,
            "len_end": last.get("eval/completion/length_mean") if last else None,
            "steps": train[-1]["step"] if train else 0,
            "train_s": sum(r.get("time/step", 0.0) for r in train),
            "reward_first": train[0]["reward/mean"] if train else None,
            "reward_last5": sum(r["reward/mean"] for r in train[-5:]) / len(train[-5:]) if train else None}


def fmt(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


def main(paths: list[str]) -> None:
    runs = [summarize(p) for p in paths if os.path.isfile(os.path.join(p, "bench.json"))]
    print("| dataset | strategy | seed | lr | held-out acc, step 0 | held-out acc, end | eval length, end | steps "
          "| batch reward, step 1 -> last 5 | train s | wall s | GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['dataset']} | {r['strategy']} | {r['seed']} | {r['lr']} | {fmt(r['acc_start'])} | "
              f"**{fmt(r['acc_end'])}** | {fmt(r['len_end'], '.1f')} | {r['steps']} | "
              f"{fmt(r['reward_first'], '.2f')} -> {fmt(r['reward_last5'], '.2f')} | {r['train_s']:.0f} | "
              f"{r['wall_s']:.0f} | {r['gpu']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
