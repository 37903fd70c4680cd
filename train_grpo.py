#!/usr/bin/env python
"""GRPO fine-tuning from the command line.

    python train_grpo.py --help
    deepspeed --num_gpus 8 train_grpo.py --tuning_strategy qlora --model_name_or_path ... --dataset_names gsm8k
"""
import sys


def main(argv=None) -> int:
    from grpo.config import parse_args
    from grpo.errors import GRPOError

    try:
        config = parse_args(argv)
        if config.plan_only:  # the memory plan alone: no data, no weights
            from grpo.memory.planner import print_plan

            return print_plan(config)
        from grpo.runtime.roles import rollout_index, rollout_ranks_of

        if rollout_index(rollout_ranks_of(config)) is not None:  # --rollout_mode server: this rank only generates
            from grpo.rollout.serve import serve_rollouts

            return serve_rollouts(config)
        from grpo.train.setup import prepare_run

        # flags, registry, rewards, data and tokenizer checked before DeepSpeed and the model code are imported
        prepared = prepare_run(config)
        from grpo.train.trainer import GRPOTrainer

        trainer = GRPOTrainer(config, prepared=prepared)
        try:
            trainer.train()
        finally:
            trainer.close()
    except GRPOError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    if code == 0:  # the process owns its group: end it on every rank together (a failed run has ended it already)
        from grpo.runtime import distributed

        distributed.shutdown()
    sys.exit(code)
