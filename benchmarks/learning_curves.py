"""Print compact per-step curves of finished runs (every Nth step): reward, length, entropy, mismatch, grad norm.

The rollout/trainer mismatch (lp_diff) is measured every --logprob_check_steps steps (1, 11, 21, ... by default), so
those steps are printed too; "-" marks a metric the step did not log.

    python benchmarks/learning_curves.py --every 4 outputs/bench/learning/*/
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grpo.train.reporting import read_metrics  # noqa: E402

COLUMNS = [("reward/mean", "reward"), ("completion/length_mean", "len"), ("completion/truncated_frac", "trunc"),
           ("entropy", "entropy"), ("rollout/logprob_diff_mean", "lp_diff"), ("grad_norm", "gnorm"),
           ("reward/zero_std_group_frac", "zero_std")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    for run in args.runs:
        rows = [r for r in read_metrics(os.path.join(run, "metrics.jsonl")) if "loss" in r]
        print(f"== {os.path.basename(os.path.normpath(run))}")
        print("step " + " ".join(f"{short:>8}" for _, short in COLUMNS))
        for r in rows:
            if r["step"] == 1 or r["step"] % args.every == 0 or "rollout/logprob_diff_mean" in r:
                print(f"{r['step']:4d} " + " ".join(f"{r[key]:8.3f}" if key in r else f"{'-':>8}"
                                                    for key, _ in COLUMNS))


if __name__ == "__main__":
    main()
