"""What a run shows: the console lines (through the progress bar, without bitsandbytes' missing-kernels note), the
start and end-of-run lines, and the training-curve panels, drawn from a small metrics.jsonl written here."""
import io
import json
import logging
import os

import pytest

from grpo.config import GRPOConfig
from grpo.train import plots
from grpo.runtime.console_log import BarSafeHandler, setup_console_logging
from grpo.train.reporting import RunReporter, eval_line, read_metrics
from grpo.train.run_summary import duration, plural, run_summary, steps_phrase


def _train_row(step, reward, **extra):
    return {"step": step, "reward/mean": reward, "kl": 0.0, "rewards/format": reward / 2,
            "completion/length_mean": 30.0 + step, **extra}


def _eval_row(step, reward, datasets=("arith",)):
    row = {"step": step, "eval/reward/mean": reward, "eval/rewards/format": reward / 2,
           "eval/completion/length_mean": 32.0}
    for name in datasets:
        row.update({f"eval/{name}/reward/mean": reward, f"eval/{name}/prompts": 8.0})
    return row


def write_metrics(tmp_path, rows) -> list[dict]:
    """The rows through a real metrics.jsonl, as the trainer reads them back."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_metrics(str(path))


# one dataset, eval at steps 0 and 4, the engine's log-prob gap logged at steps 1 and 3 only, no KL term
ONE_DATASET = [_eval_row(0, 0.1), _train_row(1, 0.2, **{"rollout/logprob_diff_mean": 0.002}), _train_row(2, 0.3),
               _train_row(3, 0.4, **{"rollout/logprob_diff_mean": 0.003}), _train_row(4, 0.5), _eval_row(4, 0.6)]


def _tool_row(step, share, calls, errors):
    return _train_row(step, share, **{"episodes/called_a_tool": share, "episodes/tool_calls": calls,
                                      "episodes/tool_errors": errors, "episodes/tool_timeouts": 0.0})


TOOLS = [_tool_row(1, 0.25, 0.5, 0.25), _tool_row(2, 0.5, 1.0, 0.0), _tool_row(3, 0.75, 1.0, 0.0),
         _tool_row(4, 1.0, 2.0, 0.5)]


def _axes(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def _lines(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


def test_one_dataset_draws_totals_eval_as_markers_and_rare_points_unjoined(tmp_path):
    fig = plots.draw_training_curves(write_metrics(tmp_path, ONE_DATASET))
    axes = _axes(fig)
    assert list(axes) == ["Reward", "Reward per function", "Rollout engine vs trainer: log-prob gap",
                          "Completion length (tokens)"]  # kl was 0 throughout: no KL term, no KL panel
    reward = _lines(axes["Reward"])
    assert sorted(reward) == ["eval", "train"]  # no per-dataset copy of the total with one dataset
    assert reward["train"].get_linestyle() == "-" and list(reward["train"].get_xdata()) == [1, 2, 3, 4]
    assert reward["eval"].get_linestyle() == "None" and reward["eval"].get_marker() == "o"
    assert list(reward["eval"].get_xdata()) == [0, 4]
    gap = _lines(axes["Rollout engine vs trainer: log-prob gap"])
    assert list(gap) == ["engine vs trainer"]
    assert gap["engine vs trainer"].get_linestyle() == "None"  # two points, logged at steps 1 and 3: markers
    notes = [t.get_text() for t in axes["Rollout engine vs trainer: log-prob gap"].texts]
    assert notes == [plots.GAP_NOTE] and "--logprob_check_steps" in notes[0]  # what the two points are
    per_function = _lines(axes["Reward per function"])
    assert per_function["format"].get_color() == per_function["format (eval)"].get_color()
    fig.clf()


def test_the_kl_is_drawn_when_it_was_computed(tmp_path):
    rows = [dict(r, kl=0.01 * r["step"]) if "kl" in r else r for r in ONE_DATASET]
    fig = plots.draw_training_curves(write_metrics(tmp_path, rows))
    ax = _axes(fig)["KL to reference"]
    assert _lines(ax)["KL to reference"].get_linestyle() == "-" and not ax.texts
    fig.clf()


def test_several_datasets_draw_each_beside_the_bold_total(tmp_path):
    rows = [_eval_row(0, 0.1, ("arith", "gsm8k")), _train_row(1, 0.2), _eval_row(1, 0.3, ("arith", "gsm8k"))]
    fig = plots.draw_training_curves(write_metrics(tmp_path, rows))
    reward = _lines(_axes(fig)["Reward"])
    assert sorted(reward) == ["eval", "eval arith", "eval gsm8k", "train"]
    assert reward["eval"].get_markersize() > reward["eval arith"].get_markersize()
    fig.clf()


def test_a_tool_run_gets_tool_panels(tmp_path):
    fig = plots.draw_training_curves(write_metrics(tmp_path, TOOLS))
    axes = _axes(fig)
    share = _lines(axes["Tool use (share)"])
    assert list(share["episodes with a tool call"].get_ydata()) == [0.25, 0.5, 0.75, 1.0]
    # failed share = (errors + timeouts) / calls, per-episode means: 0.25/0.5, 0/1, 0/1, 0.5/2
    assert list(share["failed calls (error/timeout)"].get_ydata()) == [0.5, 0.0, 0.0, 0.25]
    assert list(_lines(axes["Tool calls per episode"])["train"].get_ydata()) == [0.5, 1.0, 1.0, 2.0]
    fig.clf()


def test_the_plot_is_written(tmp_path):
    path = plots.plot_training_curves(ONE_DATASET, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and path.endswith("curves.png")


def test_summary_compares_first_and_last_eval_once_per_figure(tmp_path):
    (tmp_path / "adapter").mkdir()
    text = run_summary(write_metrics(tmp_path, ONE_DATASET), str(tmp_path), 125.0, 4,
                       {"lora_adapter": str(tmp_path / "adapter")})
    lines = text.splitlines()
    assert "eval at step 0" in lines[1] and "eval at step 4" in lines[1] and "change" in lines[1]
    reward = next(line for line in lines if line.split()[0] == "reward")
    assert reward.split() == ["reward", "0.100", "0.600", "+0.500"]
    assert next(line for line in lines if line.split()[0] == "format").split()[1:] == ["0.050", "0.300", "+0.250"]
    assert next(line for line in lines if "length" in line).split()[-3:] == ["32.0", "32.0", "+0.0"]
    assert not any("arith" in line for line in lines)  # one dataset: its figures are the totals, not repeated
    assert "  time: 2m 05s for 4 steps (31.2s a step, evals and saves included)" in lines
    assert any(line.split() == ["final", "lora", "adapter", "adapter"] for line in lines)
    assert any(line.split() == ["metrics", "metrics.jsonl"] for line in lines)


def test_summary_without_eval_compares_training_windows_with_tool_use(tmp_path):
    lines = run_summary(write_metrics(tmp_path, TOOLS), str(tmp_path), 30.0, 1).splitlines()
    assert "train step 1" in lines[1] and "train step 4" in lines[1]  # windows of max(1, 4 // 4) steps
    assert next(line for line in lines if line.startswith("  episodes with a tool call")).split()[-3:] == \
        ["0.250", "1.000", "+0.750"]
    assert next(line for line in lines if line.startswith("  failed tool calls")).split()[-3:] == \
        ["0.500", "0.250", "-0.250"]
    assert "  time: 30s for 1 step (30.0s a step, evals and saves included)" in lines


def test_step_counts_are_worded_for_one_and_after_a_resume():
    assert plural(1, "step") == "1 step" and plural(2, "step") == "2 steps" and plural(0, "step") == "0 steps"
    assert steps_phrase(0, 1, "4 prompts") == "1 step of 4 prompts"
    assert steps_phrase(13, 14, "4 prompts") == "14 steps of 4 prompts; 1 step left (resumed at step 13)"
    assert duration(59.4) == "59s" and duration(3725) == "1h 02m"


def test_the_eval_line_leaves_out_a_single_datasets_copies():
    one = eval_line({k: v for k, v in _eval_row(0, 0.5).items() if k != "step"})
    assert one == "reward/mean=0.5 rewards/format=0.25 completion/length_mean=32"
    several = eval_line({k: v for k, v in _eval_row(0, 0.5, ("arith", "gsm8k")).items() if k != "step"})
    assert "arith/reward/mean=0.5" in several and "gsm8k/reward/mean=0.5" in several and "prompts" not in several


@pytest.fixture
def console():
    """The grpo logger's console handler writing to a buffer; the handlers and filters restored after."""
    grpo_logger = logging.getLogger("grpo")
    bnb_logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    saved = (list(grpo_logger.handlers), list(bnb_logger.filters), grpo_logger.level, grpo_logger.propagate)
    grpo_logger.handlers = []
    stream = io.StringIO()
    setup_console_logging(True)
    handler = next(h for h in grpo_logger.handlers if isinstance(h, BarSafeHandler))
    handler.setStream(stream)
    yield stream
    grpo_logger.handlers, bnb_logger.filters = saved[0], saved[1]
    grpo_logger.setLevel(saved[2])
    grpo_logger.propagate = saved[3]


def test_log_lines_go_through_the_bar_and_the_bitsandbytes_note_is_dropped(console):
    from tqdm import tqdm

    with tqdm(total=3, file=console, ascii=True, disable=False) as bar:
        bar.update(1)
        logging.getLogger("grpo").info("training lora")
    text = console.getvalue()
    # tqdm.write clears the bar's line first: the log line starts a line of its own
    assert any(line.endswith("INFO training lora") for line in text.replace("\r", "\n").splitlines())
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    kept = []
    bnb.addHandler(collect := logging.Handler())
    collect.emit = kept.append
    try:
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", "x")
        bnb.warning("a real bitsandbytes warning")
    finally:
        bnb.removeHandler(collect)
    assert [r.getMessage() for r in kept] == ["a real bitsandbytes warning"]


def console_line(tmp_path, caplog, metrics, **options) -> str:
    config = GRPOConfig(output_dir=str(tmp_path), **options)
    reporter = RunReporter(config, True, total_steps=2)
    logger = logging.getLogger("grpo")
    propagate, logger.propagate = logger.propagate, True  # caplog listens at the root
    try:
        with caplog.at_level(logging.INFO, logger="grpo"):
            reporter.log_step(1, metrics)
    finally:
        logger.propagate = propagate
        reporter.close()
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1:"))


STEP = {"reward/mean": 0.5, "kl": 0.0, "time/step": 1.0, "time/rollout": 0.5}


def test_the_console_shows_kl_only_with_a_kl_term_and_tool_share_with_tools(tmp_path, caplog):
    assert "kl=" not in console_line(tmp_path / "off", caplog, STEP)
    caplog.clear()
    assert "kl=0" in console_line(tmp_path / "on", caplog, STEP, kl_beta=0.04)
    caplog.clear()
    assert "tool=0.75" in console_line(tmp_path / "tools", caplog, {**STEP, "episodes/called_a_tool": 0.75})


def test_a_resumed_run_drops_its_logs_past_the_checkpoint_and_a_fresh_one_starts_them_empty(tmp_path):
    def write(name, steps):
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in steps))

    def rows(name):
        return [r["step"] for r in read_metrics(str(tmp_path / name))]

    write("metrics.jsonl", [1, 2, 3, 4])
    write("completions/rank0.jsonl", [1, 2, 3, 4])
    write("completions/rank1.jsonl", [1, 2, 3, 4])
    write("eval/samples_step2.jsonl", [2])
    write("eval/samples_step4.jsonl", [4])
    RunReporter(GRPOConfig(output_dir=str(tmp_path)), True, total_steps=6, start_step=2).close()
    assert rows("metrics.jsonl") == rows("completions/rank0.jsonl") == rows("completions/rank1.jsonl") == [1, 2]
    assert sorted(os.listdir(tmp_path / "eval")) == ["samples_step2.jsonl"]
    RunReporter(GRPOConfig(output_dir=str(tmp_path)), True, total_steps=6, start_step=0).close()
    assert not (tmp_path / "metrics.jsonl").exists() and os.listdir(tmp_path / "completions") == []
    assert os.listdir(tmp_path / "eval") == []

