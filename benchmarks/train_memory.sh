#!/usr/bin/env bash
# Training-phase memory/time benchmark (GPU; never run by CI): peak memory and seconds per step of the optimisation
# phase, before (fixed-row micro-batches padded to the step, full logits) and after (token-budget micro-batches,
# chunked output layer, optionally padding-free), for a random 0.68B Llama (vocab 49k) and a random
# Qwen2.5-1.5B-shaped model (vocab 151k), lora and full, 16 prompts x 8 completions of 1..1024 tokens.
#
#   bash benchmarks/train_memory.sh                                   # plain python, one GPU
#   LAUNCH=deepspeed bash benchmarks/train_memory.sh                  # through the deepspeed launcher, 1 GPU
#   ARGS="--models qwen2.5-1.5b --strategies lora --max_new 2048" bash benchmarks/train_memory.sh
#   GPU_ID=2 bash benchmarks/train_memory.sh                          # on GPU 2 alone, beside other jobs
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-outputs/bench/train_memory}
mkdir -p "$OUT_DIR"
read -r -a EXTRA <<< "${ARGS:-}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/launch.sh  # launcher, where (GPU_ID), free_port
if [ "${LAUNCH:-python}" = deepspeed ]; then
  "${launcher[@]}" "${where[@]}" --master_port "${PORT:-$(free_port)}" benchmarks/train_memory.py \
    --json "$OUT_DIR/rows.json" "${EXTRA[@]}" | tee "$OUT_DIR/table.md"
else
  env ${GPU_ID:+CUDA_VISIBLE_DEVICES=$GPU_ID} python benchmarks/train_memory.py --json "$OUT_DIR/rows.json" "${EXTRA[@]}" |
    tee "$OUT_DIR/table.md"
fi
