#!/usr/bin/env python
"""GRPO fine-tuning from the command line.

    python train_grpo.py --help
    deepspeed --num_gpus 8 train_grpo.py --tuning_strategy qlora --model_name_or_path ... --dataset_names gsm8k

The process's main is grpo/entry/train.py (also `python -m grpo.entry.train`).
"""
import sys

from grpo.entry.train import main, run

__all__ = ["main", "run"]  # main(argv): a run in this process, exit code returned; run(argv): and the group ended

if __name__ == "__main__":
    sys.exit(run())
