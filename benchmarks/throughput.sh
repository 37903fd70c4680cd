#!/usr/bin/env bash
# Rollout throughput and step time benchmark (GPU only; never run by CI), on a random 0.68B Llama (the
# "llama-0.68b" shape of benchmarks/train_memory.py, SmolLM2's tokenizer), 16 prompts x 8 samples, 256 new tokens:
#   1. rollout tokens/s of one batch (16 random 128-token prompts x n=8, exactly 256 new tokens): bare vLLM
#      LLM.generate vs grpo's VLLMRolloutEngine, log-probs off and on (benchmarks/rollout_throughput.py); and the
#      rollout phase of a real train_grpo.py run (`arith`, LoRA, vLLM colocate, STEPS steps, the first left out)
#   2. seconds per optimizer step, that grpo run vs TRL's GRPOTrainer on the same work (benchmarks/trl_step.py)
#   3. with 2+ GPUs, each case of MULTI_CASES ("<prompts per step>:<new tokens>", default "16:256 64:256 16:1024")
#      with the same prompts per step in every mode (strong scaling): grpo colocate on 1 GPU and on 2 GPUs (half the
#      prompts per rank), server mode (1 training + 1 rollout GPU), server mode with --async_rollout; samples/s per
#      mode, 2-GPU colocate / 1-GPU colocate and server / colocate ratios. MULTI_MODES picks the modes
#      (default "colocate1 colocate2 server async"; stream2 and stream4 add streamed rollouts, --max_staleness 2 / 4
#      with pieces of STREAM_SEGMENT tokens: the cases of docs/server_mode.md#streaming-rollouts---max_staleness-k as
#      MULTI_CASES="16:1024 8:4096" MULTI_MODES="colocate2 async stream2 stream4")
# The table (benchmarks/throughput_table.py) goes to $OUT/table.md; logs and metrics to $OUT/ and $OUT/runs/
# (a previous run's results there are removed first; the model folder is kept and reused).
# Every run has a wall-clock limit; on one H100 sections 1-2 take about 8 minutes (more on the first run, which
# converts the embedded tokenizer and compiles vLLM's graphs).
#
#   OUT=outputs/throughput bash benchmarks/throughput.sh
#   STEPS=11 SKIP_TRL=1 bash benchmarks/throughput.sh          # 10 measured steps, no TRL
#   SKIP_ROLLOUT=1 SKIP_MULTI=1 bash benchmarks/throughput.sh  # only the grpo run and TRL
#   VLLM_SLEEP=false bash benchmarks/throughput.sh             # vLLM stays awake in grpo and TRL
#   SKIP_ROLLOUT=1 SKIP_TRL=1 MULTI_CASES="16:1024" MULTI_MODES="colocate2 server async" bash benchmarks/throughput.sh
#
# KV_CACHE_GIB (a number of GiB or share; auto is refused by server mode) sets grpo's --vllm_kv_cache_gib in every
# run and the engine of section 1;
# unset, the runs keep grpo's default (auto colocated, share in server mode) and section 1's grpo engine is sized
# as auto would size it; bare vLLM always keeps its default (what VLLM_MEM leaves after the weights)
#
# EXTRA_ARGS: more train_grpo.py flags for every grpo run (e.g. "--rollout_weights adapter").
# Knobs: OUT STEPS MULTI_STEPS MULTI_CASES MULTI_MODES MAX_NEW REPEATS VLLM_MEM SERVER_MEM VLLM_SLEEP KV_CACHE_GIB
# TRL_MICRO TRL_IS
# MODEL_DIR SKIP_ROLLOUT SKIP_TRL SKIP_MULTI RUN T_MODEL T_ROLLOUT T_RUN T_TRL T_MULTI PORT
# GPU_ID=<n> puts sections 1-2 and 1-GPU runs on GPU n, so two invocations (own OUT and PORT, same MODEL_DIR) can
# share a 2-GPU machine; sections 1-2's train_grpo.py run is left out when both SKIP_ROLLOUT and SKIP_TRL are 1,
# unless RUN=1 (e.g. KV_CACHE_GIB=share SKIP_ROLLOUT=1 SKIP_TRL=1 SKIP_MULTI=1 RUN=1: that run alone)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/bench/throughput}
STEPS=${STEPS:-6}                # optimizer steps per training run; the first is left out
MULTI_STEPS=${MULTI_STEPS:-$STEPS}
MAX_NEW=${MAX_NEW:-256}
MULTI_CASES=${MULTI_CASES:-16:256 64:256 16:1024}   # section 3: prompts per step:new tokens
MULTI_MODES=${MULTI_MODES:-colocate1 colocate2 server async}
STREAM_SEGMENT=${STREAM_SEGMENT:-256}  # stream2 / stream4 modes: --rollout_segment_tokens
PROMPT_LEN=128                   # the random prompts' length, and --max_prompt_length of the runs
REPEATS=${REPEATS:-10}            # timed calls per case: a busy host moves single calls by 30% and more
VLLM_MEM=${VLLM_MEM:-0.3}        # grpo's and TRL's default share for colocated vLLM
SERVER_MEM=${SERVER_MEM:-0.85}   # a rollout rank has its GPU to itself
VLLM_SLEEP=${VLLM_SLEEP:-true}   # grpo's default; TRL's vllm_enable_sleep_mode follows it
TRL_MICRO=${TRL_MICRO:-32}       # TRL completions per micro-batch (128 / TRL_MICRO accumulation steps)
TRL_IS=${TRL_IS:-0}              # 1: TRL's vLLM importance-sampling correction (its default) on
MODEL_DIR=${MODEL_DIR:-$OUT/llama-0.68b}
T_MODEL=${T_MODEL:-300} T_ROLLOUT=${T_ROLLOUT:-360} T_RUN=${T_RUN:-360} T_TRL=${T_TRL:-420} T_MULTI=${T_MULTI:-480}
port=${PORT:-29700}
rm -rf "$OUT/runs" "$OUT/trl" "$OUT/rollout.jsonl" "$OUT/trl.json"  # a previous run's results (the model stays)
mkdir -p "$OUT/runs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1
source scripts/launch.sh  # launcher, where (GPU_ID; a run of several GPUs sets its own)
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
bounded() { timeout -k 30 "$@"; }  # timeout <seconds> <command...>, its whole process group killed 30 s later

python - "$OUT/env.json" <<'PY'
import json, subprocess, sys
from importlib.metadata import PackageNotFoundError, version
query = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
names = [line.strip() for line in query.stdout.splitlines() if line.strip()]
env = {"GPU": f"{len(names)} x {names[0]}" if names else "none"}
for package in ("vllm", "trl", "torch", "transformers", "deepspeed", "peft"):
    try:
        env[package] = version(package)
    except PackageNotFoundError:
        env[package] = "absent"
json.dump(env, open(sys.argv[1], "w"))
print(env)
PY
echo "== model: $MODEL_DIR"
bounded "$T_MODEL" env ${GPU_ID:+CUDA_VISIBLE_DEVICES=$GPU_ID} python benchmarks/random_model.py --out "$MODEL_DIR" || { echo "model creation failed"; exit 1; }

# train <name> <mode label> <gpus> <training ranks> <prompts per rank> <max new> <steps> <timeout> <extra args...>
# (extra args come last, so they win over the shared ones, e.g. --vllm_gpu_memory_utilization in server mode)
train() {
  local name=$1 mode=$2 gpus=$3 ranks=$4 prompts=$5 new=$6 steps=$7 limit=$8; shift 8
  local dir="$OUT/runs/$name" start=$SECONDS
  echo "== grpo $name: $mode, $gpus GPU(s), $ranks x $prompts prompts, $new new tokens, $steps steps (limit ${limit}s)"
  local where=(--num_gpus "$gpus")
  [ "$gpus" = 1 ] && [ -n "${GPU_ID:-}" ] && where=(--include "localhost:$GPU_ID")
  bounded "$limit" env VLLM_ENABLE_V1_MULTIPROCESSING=0 "${launcher[@]}" "${where[@]}" --master_port "$port" \
    train_grpo.py --model_name_or_path "$MODEL_DIR" --tuning_strategy lora --lora_rank 16 --lora_alpha 32 \
    --lora_target_modules all-linear --learning_rate 1e-5 --dataset_names arith --train_split_ratio 1.0 \
    --per_device_train_batch_size "$prompts" --k_samples 8 --rollout_max_new_tokens "$new" \
    --max_prompt_length "$PROMPT_LEN" --max_seq_length $((PROMPT_LEN + new)) --max_steps "$steps" \
    --rollout_engine vllm --vllm_gpu_memory_utilization "$VLLM_MEM" --vllm_sleep "$VLLM_SLEEP" --save_steps 0 \
    --eval_on_start false --logging_steps 1 --output_dir "$dir" --overwrite_output_dir \
    ${KV_CACHE_GIB:+--vllm_kv_cache_gib "$KV_CACHE_GIB"} ${EXTRA_ARGS:-} "$@" > "$dir.log" 2>&1
  local rc=$?
  port=$((port + 1))
  printf '{"name": "%s", "mode": "%s", "gpus": %s, "train_ranks": %s, "max_new": %s, ' \
    "$name" "$mode" "$gpus" "$ranks" "$new" > "$dir.json"
  printf '"samples_per_step": %s, "rc": %s, "wall_s": %s}\n' $((ranks * prompts * 8)) "$rc" $((SECONDS - start)) \
    >> "$dir.json"
  echo "   rc=$rc, $((SECONDS - start)) s; $(grep -E 'step [0-9]+:' "$dir.log" | tail -1 | cut -c1-160)"
}

# 1. rollout throughput, one batch
if [ "${SKIP_ROLLOUT:-0}" != 1 ]; then
  for engine in bare grpo; do
    kv=()
    [ "$engine" = grpo ] && kv=(--kv_cache_gib "${KV_CACHE_GIB:-auto}")
    echo "== rollout: $engine (limit ${T_ROLLOUT}s)"
    bounded "$T_ROLLOUT" env ${GPU_ID:+CUDA_VISIBLE_DEVICES=$GPU_ID} \
      python benchmarks/rollout_throughput.py --engine "$engine" --model "$MODEL_DIR" \
      --prompts 16 --k 8 --prompt_len "$PROMPT_LEN" --max_new "$MAX_NEW" --repeats "$REPEATS" \
      --vllm_mem "$VLLM_MEM" ${kv[@]+"${kv[@]}"} --json "$OUT/rollout.jsonl" > "$OUT/rollout_$engine.log" 2>&1
    echo "   rc=$?"; grep -E 'tok/s' "$OUT/rollout_$engine.log"
  done
fi

# 1c + 2. a real run: its rollout phase (section 1) and its seconds per step (section 2, against TRL)
if [ "${SKIP_ROLLOUT:-0}" != 1 ] || [ "${SKIP_TRL:-0}" != 1 ] || [ "${RUN:-0}" = 1 ]; then
  train colocate-1gpu-short "colocate" 1 1 16 "$MAX_NEW" "$STEPS" "$T_RUN"
fi

if [ "${SKIP_TRL:-0}" != 1 ]; then
  echo "== TRL GRPOTrainer (limit ${T_TRL}s)"
  trl_flags=()
  [ "$VLLM_SLEEP" = true ] && trl_flags+=(--vllm_sleep)
  [ "$TRL_IS" = 1 ] && trl_flags+=(--is_correction)
  bounded "$T_TRL" env VLLM_ENABLE_V1_MULTIPROCESSING=0 ${GPU_ID:+CUDA_VISIBLE_DEVICES=$GPU_ID} \
    python -m torch.distributed.run --standalone \
    --nproc_per_node 1 benchmarks/trl_step.py --model "$MODEL_DIR" --output_dir "$OUT/trl" --json "$OUT/trl.json" \
    --steps "$STEPS" --prompts 16 --k 8 --max_new "$MAX_NEW" --max_model_len $((PROMPT_LEN + MAX_NEW)) \
    --micro "$TRL_MICRO" --vllm_mem "$VLLM_MEM" "${trl_flags[@]}" > "$OUT/trl.log" 2>&1
  echo "   rc=$?"; grep -E '"framework"' "$OUT/trl.log" | cut -c1-300
fi

# 3. modes on two GPUs, the same prompts per step in each: "<prompts>:<new tokens>" cases
if [ "${SKIP_MULTI:-0}" != 1 ] && [ "$GPUS" -ge 2 ]; then
  for case in $MULTI_CASES; do
    p=${case%%:*} new=${case##*:}
    [ $((p % 2)) = 0 ] || { echo "MULTI_CASES: $case has an odd prompt count; 2-GPU colocate halves it"; exit 1; }
    server=(--rollout_mode server --rollout_gpus 1 --vllm_gpu_memory_utilization "$SERVER_MEM")
    for m in $MULTI_MODES; do
      case $m in
        colocate1) train "p$p-n$new-colocate1" "colocate" 1 1 "$p" "$new" "$MULTI_STEPS" "$T_MULTI" ;;
        colocate2) train "p$p-n$new-colocate2" "colocate" 2 2 $((p / 2)) "$new" "$MULTI_STEPS" "$T_MULTI" ;;
        server) train "p$p-n$new-server" "server" 2 1 "$p" "$new" "$MULTI_STEPS" "$T_MULTI" "${server[@]}" ;;
        async) train "p$p-n$new-async" "server, async" 2 1 "$p" "$new" "$MULTI_STEPS" "$T_MULTI" "${server[@]}" \
                 --async_rollout true ;;
        stream2|stream4) train "p$p-n$new-$m" "server, async stream K=${m#stream}" 2 1 "$p" "$new" "$MULTI_STEPS" \
                 "$T_MULTI" "${server[@]}" --max_staleness "${m#stream}" --rollout_segment_tokens "$STREAM_SEGMENT" ;;
        *) echo "MULTI_MODES: unknown mode $m (colocate1 colocate2 server async stream2 stream4)"; exit 1 ;;
      esac
    done
  done
elif [ "${SKIP_MULTI:-0}" != 1 ]; then
  echo "== section 3 skipped: $GPUS GPU(s) visible, it needs 2"
fi

python benchmarks/throughput_table.py "$OUT" | tee "$OUT/table.md"
