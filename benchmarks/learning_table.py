"""Print the learning benchmark's table from finished runs: held-out accuracy at step 0 and at the end.

    python benchmarks/learning_table.py outputs/bench/learning/*/

Each run folder holds metrics.jsonl (written by the trainer) and bench.json (written by learning.sh: dataset,
strategy, seed, learning rate, accuracy key, wall seconds, GPU). Below the table: for datasets with tools, the share of
held-out episodes that called a tool at step 0 and at the end; qlora's final accuracy against lora's, per dataset, tag
and seed, and as a mean over the seeds that both have.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.train.reporting import read_metrics  # noqa: E402


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
            # datasets with tools: the share of held-out episodes that called a tool
            "calls_start": first.get("eval/episodes/called_a_tool") if first else None,
            "calls_end": last.get("eval/episodes/called_a_tool") if last else None,
            "steps": train[-1]["step"] if train else 0,
            "train_s": sum(r.get("time/step", 0.0) for r in train),
            "reward_first": train[0]["reward/mean"] if train else None,
            "reward_last5": sum(r["reward/mean"] for r in train[-5:]) / len(train[-5:]) if train else None}


def fmt(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


def qlora_against_lora(runs: list[dict]) -> list[str]:
    """One line per (dataset, tag, seed) where both finished: qlora's end accuracy, lora's, and their ratio; then
    the same for the mean over those seeds."""
    ends = {}
    for r in runs:
        base, _, tag = r["strategy"].partition("-")  # learning.sh appends -<TAG> to the strategy
        if base in ("lora", "qlora") and r["acc_end"] is not None:
            ends[(r["dataset"], f"-{tag}" if tag else "", r["seed"], base)] = r["acc_end"]

    def line(label: str, q: float, lora: float) -> str:
        return f"{label}: qlora {q:.3f}, lora {lora:.3f}, qlora / lora {f'{q / lora:.2f}' if lora > 0 else '-'}"

    lines, pairs = [], {}
    for (dataset, tag, seed, base), q in sorted(ends.items(), key=lambda item: item[0][:3]):
        lora = ends.get((dataset, tag, seed, "lora"))
        if base == "qlora" and lora is not None:
            pairs.setdefault((dataset, tag), []).append((q, lora))
            lines.append(line(f"{dataset}{tag} seed {seed}", q, lora))
    for (dataset, tag), both in pairs.items():
        lines.append(line(f"{dataset}{tag}, mean over {len(both)} seed(s)", *(sum(v) / len(both) for v in zip(*both))))
    return lines


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
    tool_runs = [r for r in runs if r["calls_start"] is not None or r["calls_end"] is not None]
    if tool_runs:
        print()
    for r in tool_runs:
        print(f"{r['dataset']} {r['strategy']} seed {r['seed']}: held-out episodes that called a tool "
              f"{fmt(r['calls_start'])} at step 0 -> {fmt(r['calls_end'])} at the end")
    comparison = qlora_against_lora(runs)
    if comparison:
        print()
        print("\n".join(comparison))


if __name__ == "__main__":
    main(sys.argv[1:])
