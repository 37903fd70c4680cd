#!/usr/bin/env bash
# GPU checks on a CUDA machine with vLLM (and DeepSpeed, bitsandbytes):
#   1. tests/gpu: weight sync into vLLM is exact for full / lora / qlora and ZeRO-3, sleep frees memory
#      (select cases with GPU_TESTS_K, a pytest -k expression, e.g. GPU_TESTS_K="qlora or full-3")
#   2. unless SKIP_E2E=1: a GRPO run on the embedded SmolLM2 with vLLM rollouts, and the same with the HF engine
#   3. unless SKIP_VL=1: GRPO on the bundled `shapes` images with a vision-language model (VL_MODEL, default the
#      random ~200M Qwen2.5-VL that tests/gpu/vl_sync_check.py builds): vLLM lora, vLLM qlora, HF lora, VL_STEPS each
# Results (logs, one JSON line per checked step) go to ${OUT:-outputs/gpu}. GPU_ID=<n> puts the runs of 2-3 on GPU n
# (DeepSpeed's launcher ignores CUDA_VISIBLE_DEVICES when given --num_gpus), so tests can run on another GPU meanwhile:
# tests/gpu runs on the GPUs CUDA_VISIBLE_DEVICES names (tests/trainer_setup.py's gpu_flags passes them on).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1
# the GPUs this job uses: tests/gpu takes those CUDA_VISIBLE_DEVICES names, the runs of 2-3 take GPU_ID's
gpus=${GPU_ID:-${CUDA_VISIBLE_DEVICES:-}}
nvidia-smi ${gpus:+-i "$gpus"} --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpu.txt"
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python -m pytest tests/gpu -q -s -p no:cacheprovider ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} 2>&1 |
    tee "$OUT/gpu_tests.log" | grep -E '^\{|passed|failed|Error|assert' | cut -c1-600
  status=${PIPESTATUS[0]}
fi
common=(--model_name_or_path smollm2-135m-instruct --dataset_names arith --tuning_strategy lora
        --per_device_train_batch_size 16 --k_samples 8 --rollout_max_new_tokens 64 --max_prompt_length 128
        --max_seq_length 192 --learning_rate 3e-4 --save_steps 0 --eval_max_prompts 64 --seed 0
        --vllm_enforce_eager true --logging_steps 1)
source scripts/launch.sh  # launcher, where (GPU_ID)
launcher+=("${where[@]}")
if [ "${SKIP_E2E:-0}" != 1 ]; then
  "${launcher[@]}" train_grpo.py "${common[@]}" --rollout_engine vllm --max_steps "${E2E_STEPS:-30}" \
    --output_dir "$OUT/vllm_run" --overwrite_output_dir > "$OUT/vllm_run.log" 2>&1
  echo "vllm run rc=$?"; grep -E "INFO step|eval at" "$OUT/vllm_run.log" | tail -25
  "${launcher[@]}" train_grpo.py "${common[@]}" --max_steps "${HF_STEPS:-3}" \
    --output_dir "$OUT/hf_run" --overwrite_output_dir > "$OUT/hf_run.log" 2>&1
  echo "hf run rc=$?"; grep -E "INFO step" "$OUT/hf_run.log" | tail -5
fi
if [ "${SKIP_VL:-0}" != 1 ]; then
  VL_MODEL=${VL_MODEL:-$(env ${GPU_ID:+CUDA_VISIBLE_DEVICES=$GPU_ID} python -c "import sys; sys.path.insert(0, 'tests/gpu'); import vl_sync_check as c; print(c.build_model(c.MODEL_DIR))" | tail -1)}
  vl=(--model_name_or_path "$VL_MODEL" --dataset_names shapes --per_device_train_batch_size 8 --k_samples 8
      --rollout_max_new_tokens 32 --max_prompt_length 192 --max_seq_length 224 --learning_rate 1e-4
      --save_steps 0 --eval_max_prompts 32 --seed 0 --vllm_enforce_eager true --max_steps "${VL_STEPS:-20}")
  for run in "vllm lora" "vllm qlora" "hf lora"; do
    set -- $run
    flag=(); [ "$1" = vllm ] && flag=(--rollout_engine vllm)
    "${launcher[@]}" train_grpo.py "${vl[@]}" --tuning_strategy "$2" "${flag[@]}" \
      --output_dir "$OUT/vl_$1_$2" --overwrite_output_dir > "$OUT/vl_$1_$2.log" 2>&1
    echo "vl $1 $2 rc=$?"; grep -E "INFO step" "$OUT/vl_$1_$2.log" | tail -3
    python - "$OUT/vl_$1_$2/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
keys = ["reward/mean", "rollout/logprob_diff_mean", "rollout/logprob_diff_max", "time/rollout", "time/sync"]
print({k: round(sum(r.get(k, 0) for r in rows) / max(len(rows), 1), 4) for k in keys}, len(rows), "steps")
PY
  done
fi
exit "$status"
