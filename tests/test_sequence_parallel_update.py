"""A GRPO update through grpo.train.update with --sequence_parallel_size 2 (2 gloo CPU ranks, one group, DeepSpeed's
Ulysses attention, ZeRO-2) gives the same loss, metrics and SGD-updated weights as the same step on one process."""

import torch

from tests.optimize_setup import LR, make_step, old_and_ref, run_split, step_config
from tests.spawn_ranks import join_world, spawn_ranks

GROUPS = [[0, 1, 2], [3, 4, 5, 6, 7]]  # two micro-batches, one with an empty completion


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)


def _config(sp_size: int):
    cfg = step_config("token_mean", entropy_coef=0.01)
    cfg.sequence_parallel_size = sp_size  # set after validation, which checks it against WORLD_SIZE
    return cfg


def _engine(model, mpu):
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": 2, "overlap_comm": False}, "zero_allow_untested_optimizer": True,
          "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=torch.optim.SGD(params, lr=LR),
                                      config=ds, mpu=mpu)
    return engine


def _step(path, sp_size, mpu_of):
    batch, advantages = make_step()
    cfg = _config(sp_size)
    model = _load(path)
    old, ref = old_and_ref(model, batch, cfg)  # before Ulysses replaces the attention
    engine = _engine(model, mpu_of(model))
    result = run_split(engine, batch, advantages, old, ref, cfg, GROUPS)
    assert not result.bad
    return result.metrics, {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _rank_main(rank, port, path, out):
    join_world(rank, port)
    import deepspeed

    from grpo.runtime.sequence_parallel import register_ulysses

    deepspeed.init_distributed(dist_backend="gloo")
    metrics, weights = _step(path, 2, lambda model: register_ulysses(model, 2))
    if rank == 0:
        torch.save({"metrics": metrics, "weights": weights}, out)
    deepspeed.comm.barrier()


def _single_main(rank, port, path, out):
    join_world(rank, port, world=1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    metrics, weights = _step(path, 1, lambda model: None)
    torch.save({"metrics": metrics, "weights": weights}, out)


def test_a_sequence_parallel_update_matches_one_process(tmp_path):
    from tests.tiny_models import make_tiny_model_dir

    path = make_tiny_model_dir(str(tmp_path / "model"))
    spawn_ranks(_single_main, path, str(tmp_path / "one.pt"), nprocs=1)
    spawn_ranks(_rank_main, path, str(tmp_path / "sp.pt"))
    one, sp = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "sp.pt")
    assert one["metrics"]["loss"] != 0
    for key in ("loss", "pg_loss", "entropy", "logprob_mean", "kl"):
        assert abs(sp["metrics"][key] - one["metrics"][key]) < 1e-5, (key, sp["metrics"], one["metrics"])
    moved = 0
    for name, weight in one["weights"].items():
        assert torch.allclose(sp["weights"][name], weight, atol=1e-5), name
    base = _load(path).state_dict()
    moved = sum(not torch.equal(base[n], w) for n, w in one["weights"].items() if n in base)
    assert moved > 0  # the step changed the weights
