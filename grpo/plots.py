"""Training curves as one PNG (reward, accuracy, KL, completion length), drawn from metrics.jsonl rows."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display on training machines
import matplotlib.pyplot as plt  # noqa: E402

_PANELS = [
    # eval: the total and each eval dataset's own line (eval/<dataset>/reward/mean)
    ("Reward", lambda k: k == "reward/mean" or (k.startswith("eval/") and k.endswith("/reward/mean"))),
    ("Accuracy (per reward function)", lambda k: k.startswith("rewards/") or k.startswith("eval/rewards/")),
    ("KL to reference", lambda k: k in ("kl", "rollout/logprob_diff_mean")),
    ("Completion length (tokens)", lambda k: k in ("completion/length_mean", "eval/completion/length_mean")),
]


def plot_training_curves(rows: list[dict], path: str) -> str:
    """Write the 2x2 figure to `path` and return it. Rows are metrics.jsonl records (train and eval)."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (title, wanted) in zip(axes.flat, _PANELS):
        keys = sorted({k for r in rows for k in r if wanted(k)})
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, markersize=4,
                        linestyle="--" if key.startswith("eval/") else "-", label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if keys:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
