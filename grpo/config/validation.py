"""GRPOConfig's checks: every section checks its own options beside its fields (grpo/config/sections/); `validate`
runs them all, at construction, before any data or model is touched. Invalid values and combinations raise
ConfigError naming the flag."""
from __future__ import annotations

from grpo.config.sections.data import reward_model_name  # noqa: F401 (read from here too)
from grpo.config.sections.optimization import token_budget  # noqa: F401 (read from here too)


def validate(cfg) -> None:
    """Every value and combination checked, section by section; a ConfigError names the flag and what to give
    instead."""
    cfg.check_model()
    cfg.check_data()
    cfg.check_optimization()
    cfg.check_algorithm()
    cfg.check_rollout()
    cfg.check_tools()
    cfg.check_logging()
    cfg.check_distributed()
