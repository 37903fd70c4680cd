"""Training curves as one PNG, drawn from metrics.jsonl rows: reward, each reward function, completion length and,
where the rows hold them, the KL to the reference, the rollout engine's log-prob gap to the trainer and tool use.

Training figures logged every step are lines; eval points and figures logged only now and then are markers (a line
between two rare points says nothing). Totals are drawn bold; per-dataset eval figures only when there are several
datasets (with one they repeat the total). The eval markers of the reward functions are hollow, each of its own
shape, so that two functions with one value at one step both show. A panel with nothing to show is left out."""
from __future__ import annotations

from typing import Callable, Optional

TRAIN_STYLE = dict(linewidth=2.0)
EVAL_STYLE = dict(linestyle="none", marker="o", markersize=7)
SPARSE_STYLE = dict(linestyle="none", marker="s", markersize=5)
PER_DATASET_STYLE = dict(linestyle="none", marker="^", markersize=5, alpha=0.6)

# one shape per reward function's eval markers (hollow): markers of equal values stay visible inside each other
EVAL_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*")
GAP_KEYS = ("rollout/logprob_diff_mean", "rollout/offpolicy_logprob_diff_mean")
GAP_NOTE = ("mean |log p engine - log p trainer| per sampled token, every --logprob_check_steps steps;\n"
            "near 0: the rollout engine samples the policy being trained")


def series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of every row that holds `key`."""
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def ratio_series(rows: list[dict], numerators: tuple[str, ...], denominator: str) -> list[tuple[float, float]]:
    """(step, sum(numerators) / denominator) of the rows holding them all with a denominator > 0."""
    return [(r["step"], sum(r[k] for k in numerators) / r[denominator]) for r in rows
            if all(r.get(k) is not None for k in numerators) and (r.get(denominator) or 0) > 0]


def eval_datasets(rows: list[dict]) -> list[str]:
    """The eval datasets named in the rows (eval/<dataset>/prompts is logged once per dataset)."""
    return sorted({k.split("/")[1] for r in rows for k in r if k.startswith("eval/") and k.endswith("/prompts")})


def train_steps(rows: list[dict]) -> int:
    return len({r["step"] for r in rows if "reward/mean" in r})


def kl_was_computed(rows: list[dict]) -> bool:
    """The trainer logs kl = 0 when there is no KL term: a KL that is 0 throughout was never computed."""
    return any(r.get("kl") for r in rows)


def has_engine_gap(rows: list[dict]) -> bool:
    return any(r.get(key) is not None for r in rows for key in GAP_KEYS)


def _draw(ax, pts, label: str, style: dict, color: Optional[str] = None) -> None:
    if pts:
        xs, ys = zip(*pts)
        if style is TRAIN_STYLE and len(pts) < 30:  # a short run's points stay visible (one point draws no line)
            style = dict(style, marker=".", markersize=6)
        ax.plot(xs, ys, label=label, color=color, **style)


def _train_style(pts, rows) -> dict:
    """A line for a figure of (nearly) every step; markers for one logged now and then (every N steps)."""
    return TRAIN_STYLE if len(pts) >= max(2, 0.8 * train_steps(rows)) else SPARSE_STYLE


def _reward_panel(ax, rows) -> None:
    _draw(ax, series(rows, "reward/mean"), "train", TRAIN_STYLE, "C0")
    _draw(ax, series(rows, "eval/reward/mean"), "eval", EVAL_STYLE, "C1")
    names = eval_datasets(rows)
    if len(names) > 1:
        for i, name in enumerate(names):
            _draw(ax, series(rows, f"eval/{name}/reward/mean"), f"eval {name}", PER_DATASET_STYLE, f"C{i + 2}")


def _reward_function_panel(ax, rows) -> None:
    names = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("rewards/")}
                   | {k.split("/", 2)[2] for r in rows for k in r if k.startswith("eval/rewards/")})
    for i, name in enumerate(names):
        pts = series(rows, f"rewards/{name}")
        _draw(ax, pts, name, _train_style(pts, rows), f"C{i}")
        _draw(ax, series(rows, f"eval/rewards/{name}"), f"{name} (eval)", eval_marker_style(i), f"C{i}")


def eval_marker_style(i: int) -> dict:
    """The i-th reward function's eval markers: hollow, of their own shape, a little smaller than the one before."""
    return dict(EVAL_STYLE, marker=EVAL_MARKERS[i % len(EVAL_MARKERS)], markerfacecolor="none", markeredgewidth=1.6,
                markersize=max(4.0, EVAL_STYLE["markersize"] + 2 - 1.0 * (i % len(EVAL_MARKERS))))


def _kl_panel(ax, rows) -> None:
    pts = series(rows, "kl")
    _draw(ax, pts, "KL to reference", _train_style(pts, rows), "C0")


def _engine_gap_panel(ax, rows) -> None:
    for i, key in enumerate(GAP_KEYS):
        pts = series(rows, key)
        label = "behind the policy (--async_rollout)" if "offpolicy" in key else "engine vs trainer"
        _draw(ax, pts, label, _train_style(pts, rows), f"C{i + 1}")
    ax.set_ylabel("nats per token")
    ax.text(0.02, 0.97, GAP_NOTE, transform=ax.transAxes, ha="left", va="top", fontsize=7, color="0.35")
    top = max((value for key in GAP_KEYS for _, value in series(rows, key)), default=0.0)
    ax.set_ylim(0.0, 1.5 * top if top > 0 else 1.0)  # a gap is >= 0; room for the note above the points


def _length_panel(ax, rows) -> None:
    _draw(ax, series(rows, "completion/length_mean"), "train", TRAIN_STYLE, "C0")
    _draw(ax, series(rows, "eval/completion/length_mean"), "eval", EVAL_STYLE, "C1")


def _tool_share_panel(ax, rows) -> None:
    for prefix, style, label in (("", TRAIN_STYLE, ""), ("eval/", EVAL_STYLE, " (eval)")):
        _draw(ax, series(rows, f"{prefix}episodes/called_a_tool"), "episodes with a tool call" + label, style, "C0")
        _draw(ax, ratio_series(rows, (f"{prefix}episodes/tool_errors", f"{prefix}episodes/tool_timeouts"),
                               f"{prefix}episodes/tool_calls"), "failed calls (error/timeout)" + label, style, "C3")
    ax.set_ylim(-0.05, 1.05)


def _tool_calls_panel(ax, rows) -> None:
    _draw(ax, series(rows, "episodes/tool_calls"), "train", TRAIN_STYLE, "C0")
    _draw(ax, series(rows, "eval/episodes/tool_calls"), "eval", EVAL_STYLE, "C1")


def has_tools(rows: list[dict]) -> bool:
    return any(k in r for r in rows for k in ("episodes/tool_calls", "eval/episodes/tool_calls"))


def panels(rows: list[dict]) -> list[tuple[str, Callable]]:
    """(title, draw) of each panel the rows call for: reward, reward per function and completion length always; the
    KL where a KL term was computed; the engine's log-prob gap where it was measured; two more for a run with
    tools."""
    out = [("Reward", _reward_panel), ("Reward per function", _reward_function_panel)]
    if kl_was_computed(rows):
        out.append(("KL to reference", _kl_panel))
    if has_engine_gap(rows):
        out.append(("Rollout engine vs trainer: log-prob gap", _engine_gap_panel))
    out.append(("Completion length (tokens)", _length_panel))
    if has_tools(rows):
        out += [("Tool use (share)", _tool_share_panel), ("Tool calls per episode", _tool_calls_panel)]
    return out


def draw_training_curves(rows: list[dict]):
    """The figure (matplotlib, not yet saved) of the rows: metrics.jsonl records, train and eval."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    chosen = panels(rows)
    n_rows = (len(chosen) + 1) // 2
    # one step axis for every panel: a figure logged at one step only still sits where that step is
    fig, axes = plt.subplots(n_rows, 2, figsize=(11, 3.5 * n_rows), squeeze=False, sharex=True)
    for ax, (title, draw) in zip(axes.flat, chosen):
        draw(ax, rows)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.tick_params(labelbottom=True)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(chosen):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def plot_training_curves(rows: list[dict], path: str) -> str:
    """Write the figure of the rows to `path` and return it."""
    fig = draw_training_curves(rows)  # (selects the Agg backend before pyplot is imported)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
