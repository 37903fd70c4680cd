"""The training curves show what the rows hold: no panel without anything to draw, the engine's log-prob gap with a
note saying what its sparse points are, and eval markers of reward functions that share a value all visible."""
import json

from grpo.train import plots
from grpo.train.reporting import read_metrics


def curves(tmp_path, rows):
    """The figure of the rows, read back through a real metrics.jsonl as the trainer does."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return plots.draw_training_curves(read_metrics(str(path)))


def axes_by_title(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def train_row(step, **extra):
    return {"step": step, "reward/mean": 0.1 * step, "kl": 0.0, "rewards/format": 0.5,
            "completion/length_mean": 30.0, **extra}


# the embedded run's shape: three reward functions, eval at steps 0 and 14 where two of them share a value, the
# engine gap of the HF engine (the policy itself: about 1e-6) at steps 1 and 11, no KL term
EVAL = {0: {"boxed_accuracy": 0.0, "format": 0.0, "number_accuracy": 0.1},
        14: {"boxed_accuracy": 0.7, "format": 0.97, "number_accuracy": 0.7}}
EMBEDDED_RUN = (
    [{"step": s, "eval/reward/mean": 0.5, **{f"eval/rewards/{k}": v for k, v in EVAL[s].items()}} for s in (0,)]
    + [train_row(s, **({"rollout/logprob_diff_mean": 1.2e-6} if s in (1, 11) else {}),
                 **{"rewards/boxed_accuracy": 0.05 * s, "rewards/number_accuracy": 0.05 * s}) for s in range(1, 15)]
    + [{"step": 14, "eval/reward/mean": 0.9, **{f"eval/rewards/{k}": v for k, v in EVAL[14].items()}}])


def test_no_kl_term_and_no_gap_leave_their_panels_out(tmp_path):
    rows = [r if "eval/reward/mean" in r else {k: v for k, v in r.items() if k != "rollout/logprob_diff_mean"}
            for r in EMBEDDED_RUN]
    fig = curves(tmp_path, rows)
    assert list(axes_by_title(fig)) == ["Reward", "Reward per function", "Completion length (tokens)"]
    fig.clf()


def test_the_engine_gap_says_what_its_points_are(tmp_path):
    fig = curves(tmp_path, EMBEDDED_RUN)
    axes = axes_by_title(fig)
    assert "KL to reference" not in axes  # kl 0 throughout: never computed
    gap = axes["Rollout engine vs trainer: log-prob gap"]
    line, = gap.get_lines()
    assert list(line.get_xdata()) == [1, 11] and line.get_linestyle() == "None"
    note, = [t.get_text() for t in gap.texts]
    assert "every --logprob_check_steps steps" in note and "near 0" in note
    assert gap.get_ylabel() == "nats per token"
    fig.clf()


def test_the_kl_gets_its_own_panel_when_computed(tmp_path):
    rows = [dict(r, kl=0.01 * r["step"]) if "kl" in r else r for r in EMBEDDED_RUN]
    fig = curves(tmp_path, rows)
    axes = axes_by_title(fig)
    assert list(axes) == ["Reward", "Reward per function", "KL to reference",
                          "Rollout engine vs trainer: log-prob gap", "Completion length (tokens)"]
    assert [line.get_label() for line in axes["KL to reference"].get_lines()] == ["KL to reference"]
    fig.clf()


def test_eval_markers_of_equal_values_stay_visible(tmp_path):
    fig = curves(tmp_path, EMBEDDED_RUN)
    lines = {line.get_label(): line for line in axes_by_title(fig)["Reward per function"].get_lines()}
    evals = [lines[f"{name} (eval)"] for name in ("boxed_accuracy", "format", "number_accuracy")]
    # boxed_accuracy shares format's value at step 0 and number_accuracy's at step 14
    assert evals[0].get_ydata()[0] == evals[1].get_ydata()[0] and evals[0].get_ydata()[1] == evals[2].get_ydata()[1]
    assert len({line.get_marker() for line in evals}) == 3  # a shape each
    assert all(line.get_markerfacecolor() == "none" for line in evals)  # hollow: one inside the other shows
    sizes = [line.get_markersize() for line in evals]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3
    assert lines["format (eval)"].get_color() == lines["format"].get_color()  # its function's colour
    fig.clf()


def test_the_embedded_runs_curves_are_written(tmp_path):
    path = plots.plot_training_curves(EMBEDDED_RUN, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and path.endswith("curves.png")
