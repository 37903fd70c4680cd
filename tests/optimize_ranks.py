"""Launched on 2 CPU ranks by tests/test_optimize.py: `deepspeed --num_gpus 2 optimize_ranks.py MODEL OUT ZERO`.

Each rank holds half of the step's rows (rank 0 in micro-batches of a small token budget, rank 1 in one), runs
one update per aggregation and rank 0 saves the updated weights (gathered under ZeRO-3) to OUT/<aggregation>.pt.
"""
import os
import sys

import torch

from grpo.runtime import distributed as dist_utils
from grpo.config.choices import AGGREGATIONS
from grpo.train.micro_batches import cut_rows
from grpo.train.step_data import StepData
from grpo.train.update import step_micro_batches, step_normaliser, update
from tests.spawn_ranks import end_rank
from tests.optimize_setup import make_engine, make_step, old_and_ref, step_config


def main(model_dir: str, out: str, zero_stage: int) -> None:
    from transformers import AutoModelForCausalLM

    dist_utils.init_distributed()
    rank = dist_utils.rank()
    full, advantages = make_step()
    rows = list(range(4)) if rank == 0 else list(range(4, 8))
    for aggregation in AGGREGATIONS:
        cfg = step_config(aggregation, max_tokens_per_micro_batch=20 if rank == 0 else 10 ** 6)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        old, ref = old_and_ref(model, full, cfg)
        engine = make_engine(model, zero_stage)
        mine = cut_rows(full, rows)
        width = mine.completion_width
        micro_batches = step_micro_batches(mine, cfg)
        step = StepData(mine, micro_batches, advantages[rows], normaliser=step_normaliser(mine, cfg),
                        old_logprobs=old[rows, :width], ref_logprobs=ref[rows, :width])
        result = update(engine, step, cfg)
        assert not result.bad, result
        if zero_stage == 3:
            state = engine._zero3_consolidated_16bit_state_dict()
        else:
            state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        if rank == 0:
            print(f"{aggregation}: rank 0 ran {len(micro_batches)} micro-batches", flush=True)
            torch.save({n: v.float() for n, v in state.items()}, os.path.join(out, f"{aggregation}.pt"))
        dist_utils.barrier()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank=N
    main(args[0], args[1], int(args[2]))
    end_rank()
