"""A run resolves its options once, on its own copy, and freezes them: what it resolved is what it uses and saves.
The options live in sections (grpo/config/sections/), each with its checks, composed into one flat GRPOConfig."""
import dataclasses
import json
import os

import pytest

from grpo.config import FLAG_GROUPS, GRPOConfig
from grpo.config.options import FrozenConfigError
from grpo.errors import ConfigError

from .trainer_setup import tiny_config


def test_a_frozen_config_refuses_every_change_and_says_how_to_make_a_changed_copy():
    config = GRPOConfig(max_steps=3)
    config.max_steps = 4  # built in a notebook: changeable until a run resolves it
    assert config.freeze() is config and config.frozen
    with pytest.raises(FrozenConfigError, match=r"frozen.*max_steps.*dataclasses\.replace\(config, max_steps=\.\.\.\)"):
        config.max_steps = 5
    with pytest.raises(AttributeError):  # (FrozenConfigError is dataclasses' FrozenInstanceError, an AttributeError)
        config.resolve(kl_beta=0.1)
    assert config.max_steps == 4 and config.kl_beta == 0.0
    copy = dataclasses.replace(config, max_steps=6)
    assert copy.max_steps == 6 and not copy.frozen
    thawed = config.thawed(max_steps=7)
    assert thawed.max_steps == 7 and not thawed.frozen and config.max_steps == 4 and config.frozen
    thawed.dataset_names.append("other")  # a deep copy: the frozen config's lists are its own
    assert config.dataset_names == ["arith"]


def test_resolve_sets_options_and_checks_them_again():
    config = GRPOConfig()
    assert config.resolve(max_seq_length=1024) is config and config.max_seq_length == 1024
    config.resolve(max_tokens_per_micro_batch="4096", report_to="TensorBoard", dataset_names="arith, gsm8k")
    assert (config.max_tokens_per_micro_batch, config.report_to, config.dataset_names) == (
        4096, ["tensorboard"], ["arith", "gsm8k"])  # text takes its form, as at construction
    with pytest.raises(ConfigError, match="--k_samples: must be at least 2"):
        GRPOConfig().resolve(k_samples=1)
    with pytest.raises(TypeError, match="not_an_option is no option"):
        GRPOConfig().resolve(not_an_option=1)


def test_every_option_is_in_one_section_with_its_group():
    from grpo.config.sections import (algorithm, data, distributed, guide, logging, model, optimization, rollout,
                                      tools)

    sections = [model.ModelOptions, data.DataOptions, optimization.OptimizationOptions,
                algorithm.AlgorithmOptions, rollout.RolloutOptions, tools.ToolOptions, logging.LoggingOptions,
                distributed.DistributedOptions, guide.GuideSpellings]
    owned = [f.name for section in sections for f in dataclasses.fields(section)]
    assert owned == [f.name for f in dataclasses.fields(GRPOConfig)]  # each once, in the order --help lists them
    assert set(FLAG_GROUPS) == set(owned) and FLAG_GROUPS["qlora_block_size"] == "experimental"
    for section in sections[:-1]:  # each checks its own options (the guide's spellings are folded into them)
        assert any(name.startswith("check_") for name in vars(section)), section


def test_the_config_package_imports_nothing_above_it():
    from .test_import_graph import import_graph

    graph = import_graph()
    above = {name: sorted(dep for dep in deps if not dep.startswith(("grpo.config", "grpo.errors", "grpo.algorithm"))
                          and dep != "grpo")
             for name, deps in graph.items() if name.startswith("grpo.config")}
    assert {name: deps for name, deps in above.items() if deps} == {}


def test_the_run_freezes_the_options_it_resolved_and_saves_them(tiny_model, registry, tmp_path, monkeypatch):
    import importlib.util

    from grpo.train.trainer import GRPOTrainer

    find_spec = importlib.util.find_spec  # wandb missing: the run resolves --use_wandb off
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    out = tmp_path / "run"
    given = tiny_config(tiny_model, registry, str(out), max_steps=1, save_steps=1, use_wandb=True)
    trainer = GRPOTrainer(given)
    try:
        resolved = trainer.config
        assert resolved is not given and resolved.frozen and not given.frozen
        assert (resolved.use_wandb, given.use_wandb) == (False, True)  # the caller's options stay as given
        with pytest.raises(FrozenConfigError):
            resolved.max_steps = 2
        trainer.train()
    finally:
        trainer.close()
    saved = json.loads((out / "grpo_config.json").read_text())
    assert saved == json.loads(json.dumps(resolved.to_dict()))  # what the run resolved is what it saved
    checkpoint = json.loads((out / "checkpoint-1" / "grpo_config.json").read_text())
    assert checkpoint == saved and saved["use_wandb"] is False
    assert os.path.isfile(out / "metrics.jsonl")


def test_the_rollout_ranks_resolve_their_own_copy_of_the_options_and_freeze_it(monkeypatch, tmp_path):
    """Server mode's rollout ranks resolve the options as the training ranks do (CPU sizing here), once, on their own
    copy, which is frozen before the rank serves."""
    import torch

    from grpo.config import parse_args
    from grpo.entry import serve
    from grpo.runtime import console_log

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")  # the last rank: the rollout rank
    given = parse_args(["--rollout_mode", "server", "--rollout_gpus", "1", "--output_dir", str(tmp_path / "run")])
    served = []
    monkeypatch.setattr(console_log, "setup_console_logging", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(serve, "connect_store", lambda timeout: None)
    monkeypatch.setattr(serve, "RolloutBridge", lambda *a: None)
    monkeypatch.setattr(serve, "_serve", lambda bridge, config, *a: served.append(config) or 0)
    assert serve.serve_rollouts(given) == 0
    resolved = served[0]
    assert resolved is not given and resolved.frozen and not given.frozen
    assert (resolved.max_steps, given.max_steps) == (14, GRPOConfig().max_steps)  # sized for a CPU, on the copy
    with pytest.raises(FrozenConfigError):
        resolved.max_steps = 2
