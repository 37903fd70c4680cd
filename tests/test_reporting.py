"""What a run shows: the console line and the training-curve panels leave out a KL that no KL term produced."""
import logging

from grpo.config import GRPOConfig
from grpo.train.reporting import _PANELS, RunReporter, panel_keys, plot_training_curves

ROWS = [{"step": 1, "reward/mean": 0.1, "kl": 0.0, "rollout/logprob_diff_mean": 0.002, "rewards/format": 0.5},
        {"step": 2, "reward/mean": 0.3, "kl": 0.0, "rollout/logprob_diff_mean": 0.003, "rewards/format": 0.7}]


def test_a_kl_that_is_zero_throughout_gets_no_line():
    kl_panel = dict(_PANELS)["KL to reference, engine log-prob gap"]
    assert panel_keys(ROWS, kl_panel) == ["rollout/logprob_diff_mean"]
    with_kl = [dict(r, kl=0.01 * r["step"]) for r in ROWS]
    assert panel_keys(with_kl, kl_panel) == ["kl", "rollout/logprob_diff_mean"]
    assert panel_keys(ROWS, dict(_PANELS)["Reward per function"]) == ["rewards/format"]


def test_the_plot_is_written(tmp_path):
    path = plot_training_curves(ROWS, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and path.endswith("curves.png")


def console_line(tmp_path, caplog, **options) -> str:
    config = GRPOConfig(output_dir=str(tmp_path), **options)
    reporter = RunReporter(config, True, total_steps=2)
    logger = logging.getLogger("grpo")
    propagate, logger.propagate = logger.propagate, True  # caplog listens at the root
    try:
        with caplog.at_level(logging.INFO, logger="grpo"):
            reporter.log_step(1, {"reward/mean": 0.5, "kl": 0.0, "time/step": 1.0, "time/rollout": 0.5})
    finally:
        logger.propagate = propagate
        reporter.close()
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1:"))


def test_the_console_shows_kl_only_with_a_kl_term(tmp_path, caplog):
    assert "kl=" not in console_line(tmp_path / "off", caplog)
    caplog.clear()
    assert "kl=0" in console_line(tmp_path / "on", caplog, kl_beta=0.04)
