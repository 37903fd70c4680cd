#!/usr/bin/env bash
# Peak resident memory of the CPU demo (run_grpo.sh on a machine without a GPU), per phase and for the whole process,
# on a short run (default 2 steps, no checkpoint). Never run by CI.
#
#   bash benchmarks/cpu_demo_memory.sh                       # 2 steps
#   MAX_STEPS=14 SAVE_STEPS=7 bash benchmarks/cpu_demo_memory.sh   # the whole demo
# Prints "[phase_rss] ..." lines (benchmarks/phase_rss.py): each phase's peak and the process peak. The peak resets
# also reset the kernel's figure that /usr/bin/time reads, so its "Maximum resident set size" here is only the last
# phase's; for the whole-process figure alone run  /usr/bin/time -v bash run_grpo.sh  instead.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=${WANDB_MODE:-disabled}
export MAX_STEPS=${MAX_STEPS:-2} SAVE_STEPS=${SAVE_STEPS:-0}
export OUTPUT_DIR=${OUTPUT_DIR:-outputs/bench/cpu_demo_memory}
export PYTHON="${PYTHON:-python3} benchmarks/phase_rss.py"
/usr/bin/time -v bash run_grpo.sh "$@" 2> >(grep --line-buffered -E "phase_rss|Maximum resident|Elapsed|Traceback|Error" >&2)
