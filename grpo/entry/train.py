"""The training process's main, behind `train_grpo.py` (and `python -m grpo.entry.train`, `grpo-train`): parse the
options, then print the memory plan alone (--plan_only), serve rollouts (a rollout rank of --rollout_mode server) or
train. Each branch imports what it needs only once taken, so a bad flag is refused before torch loads."""
import sys


def main(argv=None) -> int:
    """One run from the command line `argv` (sys.argv's by default); the process's exit code. A GRPOError is printed
    as its message alone."""
    from grpo.config import parse_args
    from grpo.errors import GRPOError

    try:
        config = parse_args(argv)
        if config.plan_only:  # the memory plan alone: no data, no weights
            from grpo.memory.planner import print_plan

            return print_plan(config)
        from grpo.runtime.roles import rollout_index, rollout_ranks_of

        if rollout_index(rollout_ranks_of(config)) is not None:  # --rollout_mode server: this rank only generates
            from grpo.entry.serve import serve_rollouts

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


def run(argv=None) -> int:
    """main, as a process runs it: on success the process owns its group and ends it on every rank together (a failed
    run has ended it already); the exit code."""
    code = main(argv)
    if code == 0:
        from grpo.runtime import distributed

        distributed.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(run())
