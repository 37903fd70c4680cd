#!/usr/bin/env bash
# Weak and strong scaling on one host of 4 GPUs (GPU only; never run by CI): samples/s of a random 0.68B Llama
# (benchmarks/random_model.py, the throughput benchmark's model), LoRA, vLLM, 8 samples per prompt, 1024 new tokens.
#   strong: 16 prompts x 8 samples per step in all, split over the training ranks;
#   weak:   16 prompts x 8 samples per training rank.
# Modes: colocate on 1, 2 and 4 GPUs; server + --async_rollout on 2 GPUs (1 training + 1 rollout) and 4 GPUs
# (2 + 2); and the 4-GPU cases again as 2 emulated nodes x 2 GPUs (scripts/emulate_two_nodes.sh; in server mode the
# rollout ranks are node 1's). Samples/s = samples per step / mean seconds per step, the first STEPS_SKIP steps left
# out. One line per run in $OUT/scaling.jsonl, the table in $OUT/table.md.
#
#   OUT=outputs/scaling bash benchmarks/multinode_scaling.sh
#   KINDS="strong" CASES="colocate1 colocate4 async4" STEPS=4 bash benchmarks/multinode_scaling.sh
#   GPUS=2,3 KINDS=weak CASES=colocate2 bash benchmarks/multinode_scaling.sh    # on GPUs 2 and 3 only
# GPUS picks the GPUs of one-node cases (as many as the case takes; other jobs can use the rest meanwhile);
# unset, a case takes the first GPUs of the host.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/bench/scaling}
STEPS=${STEPS:-5}; STEPS_SKIP=${STEPS_SKIP:-1}; NEW=${NEW:-1024}; PROMPT_LEN=128
KINDS=${KINDS:-strong weak}
CASES=${CASES:-colocate1 colocate2 colocate4 async2 async4 colocate2x2 async2x2}
T_RUN=${T_RUN:-600}
MODEL_DIR=${MODEL_DIR:-$OUT/llama-0.68b}
port=${PORT:-29900}
mkdir -p "$OUT/runs"; : > "$OUT/scaling.jsonl"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled \
  VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
[ -f "$MODEL_DIR/config.json" ] || python benchmarks/random_model.py --out "$MODEL_DIR" || exit 1
launcher=(deepspeed); command -v deepspeed > /dev/null || launcher=(python -m deepspeed.launcher.runner)

# run <kind> <case>: gpus, training ranks and nodes from the case's name
run() {
  local kind=$1 case=$2 gpus ranks mode extra=() nodes=1
  case $case in
    colocate1) gpus=1; ranks=1 ;; colocate2) gpus=2; ranks=2 ;; colocate4) gpus=4; ranks=4 ;;
    colocate2x2) gpus=4; ranks=4; nodes=2 ;;
    async2) gpus=2; ranks=1 ;; async4) gpus=4; ranks=2 ;; async2x2) gpus=4; ranks=2; nodes=2 ;;
    *) echo "unknown case $case"; return 1 ;;
  esac
  case $case in async*) mode="server, async"
    extra=(--rollout_mode server --rollout_gpus $((gpus - ranks)) --async_rollout true
           --vllm_gpu_memory_utilization 0.85) ;; *) mode=colocate ;; esac
  local prompts=16; [ "$kind" = strong ] && prompts=$((16 / ranks))
  if [ "$kind" = weak ] && [ "$ranks" = 1 ] && grep -q "\"strong-$case\"" "$OUT/scaling.jsonl"; then
    # one training rank: the weak case is the strong case's very work; its row is reused, not run again
    grep "\"strong-$case\"" "$OUT/scaling.jsonl" | sed 's/"strong-/"weak-/; s/"kind": "strong"/"kind": "weak"/' \
      >> "$OUT/scaling.jsonl"
    tail -n 1 "$OUT/scaling.jsonl"; return 0
  fi
  local name="$kind-$case" dir="$OUT/runs/$kind-$case" start=$SECONDS
  local args=(--model_name_or_path "$MODEL_DIR" --tuning_strategy lora --lora_rank 16 --lora_alpha 32
    --learning_rate 1e-5 --dataset_names arith --train_split_ratio 1.0 --per_device_train_batch_size "$prompts"
    --k_samples 8 --rollout_max_new_tokens "$NEW" --max_prompt_length "$PROMPT_LEN"
    --max_seq_length $((PROMPT_LEN + NEW)) --max_steps "$STEPS" --rollout_engine vllm --save_steps 0
    --eval_on_start false --logging_steps 1 --output_dir "$dir" --overwrite_output_dir
    "${extra[@]}")
  local where=(--num_gpus "$gpus")
  if [ -n "${GPUS:-}" ]; then
    local listed; listed=$(tr ',' '\n' <<< "$GPUS" | grep -c .)
    if [ "$listed" != "$gpus" ] || [ "$nodes" != 1 ]; then
      echo "$name takes $gpus GPU(s) on $nodes node(s); GPUS=$GPUS lists $listed: skipped"; return 1
    fi
    where=(--include "localhost:$GPUS")  # the launcher ignores CUDA_VISIBLE_DEVICES
  fi
  echo "== $name: $mode, $gpus GPU(s) on $nodes node(s), $ranks training rank(s) x $prompts prompts x 8"
  if [ "$nodes" = 2 ]; then
    NODES_DIR="$dir.nodes" PORT=$port GPUS_PER_NODE=2 timeout -k 30 "$T_RUN" \
      bash scripts/emulate_two_nodes.sh "${args[@]}" > "$dir.log" 2>&1
  else
    timeout -k 30 "$T_RUN" "${launcher[@]}" "${where[@]}" --master_port "$port" train_grpo.py "${args[@]}" \
      > "$dir.log" 2>&1
  fi
  local rc=$?; port=$((port + 1))
  python - "$dir" "$name" "$kind" "$mode" "$gpus" "$nodes" $((ranks * prompts * 8)) "$rc" $((SECONDS - start)) \
    "$STEPS_SKIP" >> "$OUT/scaling.jsonl" <<'PY'
import json, sys
from grpo.train.reporting import read_metrics
d, name, kind, mode, gpus, nodes, samples, rc, wall, skip = sys.argv[1:]
try:
    rows = [r for r in read_metrics(d + "/metrics.jsonl") if "loss" in r][int(skip):]
except OSError:
    rows = []
def mean(key):
    values = [r[key] for r in rows if key in r]
    return round(sum(values) / len(values), 3) if values else None
step_s = mean("time/step")
print(json.dumps({"name": name, "kind": kind, "mode": mode, "gpus": int(gpus), "nodes": int(nodes),
                  "samples_per_step": int(samples), "step_s": step_s,
                  "samples_per_s": int(samples) / step_s if step_s else None, "rc": int(rc), "wall_s": int(wall),
                  # where a step's time goes (rank 0's view; async rollouts overlap training)
                  "rollout_s": mean("time/rollout"), "train_s": mean("time/train"), "sync_s": mean("time/sync")}))
PY
  tail -n 1 "$OUT/scaling.jsonl"
}
for kind in $KINDS; do for case in $CASES; do run "$kind" "$case"; done; done
python - "$OUT/scaling.jsonl" <<'PY' | tee "$OUT/table.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| scaling | mode | GPUs | nodes | samples/step | s/step | samples/s | vs 1 GPU |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    base = next((b for b in rows if b["kind"] == r["kind"] and b["gpus"] == 1 and b["samples_per_s"]), None)
    ratio = f'{r["samples_per_s"] / base["samples_per_s"]:.2f}x' if base and r["samples_per_s"] else "-"
    fmt = lambda v, f: format(v, f) if v is not None else f'failed (rc {r["rc"]})'
    print(f'| {r["kind"]} | {r["mode"]} | {r["gpus"]} | {r["nodes"]} | {r["samples_per_step"]} | '
          f'{fmt(r["step_s"], ".2f")} | {fmt(r["samples_per_s"], ".1f")} | {ratio} |')
PY
