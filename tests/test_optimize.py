"""The gradient of a step does not depend on how it is split into micro-batches, nor over how many ranks."""
import os
import shutil
import subprocess

import pytest
import torch

from grpo.runtime import distributed as dist_utils
from grpo.algorithm import AGGREGATIONS
from grpo.train.micro_batches import micro_batch_groups

from .optimize_setup import make_engine, make_step, old_and_ref, reference_update, run_split, step_config
from .tiny_models import make_tiny_model_dir
from .trainer_setup import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLITS = {1: [list(range(8))], 3: [[1, 6], [0, 3, 5, 7], [2, 4]], 8: [[i] for i in range(8)]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("opt_model")))


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Per aggregation: the weights after one plain-torch SGD step on the whole step."""
    batch, advantages = make_step()
    out = {}
    for aggregation in AGGREGATIONS:
        cfg = step_config(aggregation)
        model = load(model_dir)
        old, ref = old_and_ref(model, batch, cfg)
        out[aggregation] = reference_update(model, batch, advantages, old, ref, cfg)
    return out


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_any_split_gives_the_one_batch_update(aggregation, model_dir, reference):
    dist_utils.init_distributed()
    batch, advantages = make_step()
    cfg = step_config(aggregation)
    whole_step_metrics = None
    for parts, groups in SPLITS.items():
        model = load(model_dir)
        old, ref = old_and_ref(model, batch, cfg)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = make_engine(model)
        result = run_split(engine, batch, advantages, old, ref, cfg, groups)
        assert not result.bad and torch.isfinite(torch.tensor(result.metrics["loss"]))
        # the logged values (kl, entropy, clip fractions, ratios) are the step's too, whatever the split
        whole_step_metrics = whole_step_metrics or result.metrics
        assert result.metrics == pytest.approx(whole_step_metrics, rel=1e-5, abs=1e-7), parts
        moved = 0
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(p.detach(), reference[aggregation][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{parts} micro-batches, {name}: {m}")
            moved += int(not torch.equal(p.detach(), before[name]))
        assert moved == len(before)  # every parameter got a gradient


def test_micro_batch_metrics_combine_token_weighted():
    from grpo.train.update import combine_micro_batch_metrics

    combined = combine_micro_batch_metrics([({"kl": 0.1, "ratio_max": 1.2, "entropy_loss": -0.01}, 10),
                                            ({"kl": 0.4, "ratio_max": 1.5, "entropy_loss": -0.02}, 30)])
    # kl: (10 * 0.1 + 30 * 0.4) / 40 = 13 / 40; the largest ratio; the entropy term's shares add up
    assert combined == pytest.approx({"kl": 0.325, "ratio_max": 1.5, "entropy_loss": -0.03})


def test_token_budget_split_gives_the_one_batch_update(model_dir, reference):
    """Micro-batches formed by --max_tokens_per_micro_batch (with the padded-free, chunked forward)."""
    dist_utils.init_distributed()
    batch, advantages = make_step()
    cfg = step_config("token_mean", max_tokens_per_micro_batch=24, padding_free=True)
    groups = micro_batch_groups(batch, cfg.max_tokens_per_micro_batch, 0)
    assert len(groups) >= 3
    model = load(model_dir)
    old, ref = old_and_ref(model, batch, cfg)
    engine = make_engine(model)
    run_split(engine, batch, advantages, old, ref, cfg, groups)
    for name, p in engine.module.named_parameters():
        torch.testing.assert_close(p.detach(), reference["token_mean"][name], rtol=1e-5, atol=1e-6)


def test_filler_micro_batches_change_nothing(model_dir, reference):
    """A rank with fewer micro-batches than another runs empty ones: the update stays the one-batch update."""
    dist_utils.init_distributed()
    batch, advantages = make_step()
    cfg = step_config("seq_mean_token_mean")
    model = load(model_dir)
    old, ref = old_and_ref(model, batch, cfg)
    engine = make_engine(model)
    run_split(engine, batch, advantages, old, ref, cfg, SPLITS[3], count=5)
    for name, p in engine.module.named_parameters():
        torch.testing.assert_close(p.detach(), reference["seq_mean_token_mean"][name], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_give_the_one_batch_update(zero_stage, model_dir, reference, tmp_path):
    """Rank 0 holds rows 0-3 in several micro-batches, rank 1 rows 4-7 in one: same weights as one batch."""
    env = child_env()
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(dist_utils._free_port()),
           os.path.join(ROOT, "tests", "optimize_ranks.py"), model_dir, str(tmp_path), str(zero_stage)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for aggregation in AGGREGATIONS:
        weights = torch.load(tmp_path / f"{aggregation}.pt")
        assert set(weights) == set(reference[aggregation])
        for name, value in weights.items():
            torch.testing.assert_close(value, reference[aggregation][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{aggregation}, {name}: {m}")
