#!/usr/bin/env bash
# GPU memory and step time of lora / qlora runs at real model sizes (GPU only; never run by CI). For each random model
# of SHAPES (benchmarks/train_memory.py's shapes, SmolLM2's tokenizer, built on the GPU and saved in bf16), each
# strategy of STRATEGIES, each --rollout_weights mode of MODES and each completion length of MAX_NEW (a list: "4096 8192
# 16384"), one train_grpo.py run with the defaults otherwise: `arith`, vLLM colocated, PROMPTS prompts x SAMPLES (8) samples x
# MAX_NEW new tokens (a random model runs every completion to the limit), STEPS steps. Per run it prints
#   peak   GPU memory of the whole job as the driver reports it (nvidia-smi, polled every 0.2 s: vLLM included)
#   s/step by phase (rollout, train, sync; the first step left out when there are more), sync MiB per step,
#   and the engine-vs-trainer log-prob gap (rollout/logprob_diff_mean, every step)
# GPU_MEMORY_GIB caps what a run may use (a smaller card's budget; a list, "16 24 40 80", runs each): the memory
# plan's budget. SHAPES, STRATEGIES, MODES, MAX_NEW and GPU_MEMORY_GIB are lists: the matrix is one command (runs one
# at a time; benchmarks/memory_matrix.py runs published configs' shapes side by side and sets plans beside peaks).
# MAX_POSITIONS=65536 builds the models with a longer context than their checkpoints' 32768 (Qwen2.5 shapes).
# FOUR_BIT=1 builds the models saved in 4 bits (random_model.py --four_bit: a 32B model without its 65 GB bf16 form).
# GPU_ID=<n> builds, runs and measures on GPU n alone (DeepSpeed's launcher ignores CUDA_VISIBLE_DEVICES), so other
# jobs can use the other GPUs meanwhile; each run's launcher takes a port the OS reports free. GPUS="0,1" runs on
# those GPUs together (one rank each; the model is built on the first); peak is then the largest of any of them.
#
#   bash benchmarks/memory_scale.sh                                   # qwen2.5-7b, qlora, adapter and merged
#   SHAPES="qwen2.5-7b qwen2.5-14b" STRATEGIES="qlora lora" MODES=adapter bash benchmarks/memory_scale.sh
#   SHAPES=qwen2.5-32b FOUR_BIT=1 MODES=auto bash benchmarks/memory_scale.sh      # 32B qlora on one 80 GB GPU
#   MODES=auto PROMPTS=4 MAX_NEW="4096 8192 16384" STEPS=2 bash benchmarks/memory_scale.sh   # reasoning lengths
#   GPUS=0,1 MAX_POSITIONS=65536 PROMPTS=1 SAMPLES=2 MAX_NEW=32768 MODES=merged GPU_MEMORY_GIB=80 STEPS=3 \
#     EXTRA_ARGS="--sequence_parallel_size 2 --max_seq_length 33280" bash benchmarks/memory_scale.sh
#                                        # a 32k-token completion at the 7B shape, sequence parallel over 2 GPUs
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/bench/memory_scale}
SHAPES=${SHAPES:-qwen2.5-7b}
STRATEGIES=${STRATEGIES:-qlora}
MODES=${MODES:-adapter merged}
STEPS=${STEPS:-3}
PROMPTS=${PROMPTS:-8}
MAX_NEW=${MAX_NEW:-256}
LIMIT=${LIMIT:-600}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled \
  PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
source scripts/launch.sh  # launcher, where (GPU_ID), free_port
[ -n "${GPUS:-}" ] && where=(--include "localhost:$GPUS") && GPU_ID=${GPUS%%,*}
gpus=${GPUS:-${GPU_ID:-0}}
nvidia-smi -i "$gpus" --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for shape in $SHAPES; do
  model="${MODEL_ROOT:-$OUT}/$shape${FOUR_BIT:+-4bit}${MAX_POSITIONS:+-$MAX_POSITIONS}"
  timeout 1200 env ${GPU_ID:+CUDA_VISIBLE_DEVICES=$GPU_ID} python benchmarks/random_model.py --shape "$shape" \
      --out "$model" ${FOUR_BIT:+--four_bit} ${MAX_POSITIONS:+--max_positions $MAX_POSITIONS} ||
    { echo "$shape: no model"; continue; }
  for strategy in $STRATEGIES; do
    for mode in $MODES; do
     for new in $MAX_NEW; do
      for budget in ${GPU_MEMORY_GIB:-none}; do
      cap=()
      [ "$budget" != none ] && cap=(--gpu_memory_gib "$budget")
      name="$shape-$strategy-$mode-${new}new${cap:+-${budget}gib}"
      dir="$OUT/runs/$name"
      rm -rf "$dir"; mkdir -p "$dir"
      nvidia-smi -i "$gpus" --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$dir/gpu_memory.txt" &
      poller=$!
      start=$SECONDS
      timeout -k 30 "$LIMIT" "${launcher[@]}" "${where[@]}" --master_port "$(free_port)" train_grpo.py \
        --model_name_or_path "$model" --tuning_strategy "$strategy" --rollout_engine vllm --rollout_weights "$mode" --dataset_names arith \
        --per_device_train_batch_size "$PROMPTS" --k_samples "${SAMPLES:-8}" --rollout_max_new_tokens "$new" \
        --max_steps "$STEPS" --save_steps 0 --eval_on_start false --train_split_ratio 1.0 --logging_steps 1 --logprob_check_steps 1 \
        --output_dir "$dir" --overwrite_output_dir "${cap[@]}" ${EXTRA_ARGS:-} > "$dir.log" 2>&1
      rc=$?
      kill "$poller" 2>/dev/null
      python - "$name" "$rc" $((SECONDS - start)) "$dir" <<'PY'
import json, os, sys
name, rc, wall, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
used = [int(x) for x in open(os.path.join(folder, "gpu_memory.txt")).read().split() if x.isdigit()]
rows = []
if os.path.exists(os.path.join(folder, "metrics.jsonl")):
    rows = [r for r in map(json.loads, open(os.path.join(folder, "metrics.jsonl"))) if "time/rollout" in r]
timed = rows[1:] if len(rows) > 1 else rows
def mean(key):
    values = [r[key] for r in timed if key in r]
    return round(sum(values) / len(values), 3) if values else None
result = {"run": name, "rc": rc, "wall_s": wall, "steps": len(rows), "peak_gib": round(max(used, default=0) / 1024, 2),
          "step_s": mean("time/step"), "rollout_s": mean("time/rollout"), "train_s": mean("time/train"),
          "sync_s": mean("time/sync"), "sync_mib": round((mean("sync/bytes") or 0) / 2**20, 1),
          "logprob_gap": mean("rollout/logprob_diff_mean")}
print(json.dumps(result))
with open(os.path.join(os.path.dirname(folder), "results.jsonl"), "a") as f:
    f.write(json.dumps(result) + "\n")
PY
      grep -E "KV cache|micro-batch" "$dir.log" | head -3
      [ "$rc" = 0 ] || grep -E "Error|error|out of memory" "$dir.log" | tail -5
      done
     done
    done
  done
done
