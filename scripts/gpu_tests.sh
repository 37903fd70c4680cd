#!/usr/bin/env bash
# GPU checks on a CUDA machine with vLLM: weight-sync exactness tests, then a 20-step vLLM GRPO run on the
# embedded SmolLM2 and the same settings with the HF engine for comparison. Results go to ${OUT:-outputs/gpu}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
[ "${SKIP_TESTS:-0}" = 1 ] || python -m pytest tests/gpu -x -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E '^\{|passed|failed|Error' | tail -20
common=(--model_name_or_path smollm2-135m-instruct --dataset_names arith --tuning_strategy lora
        --per_device_train_batch_size 16 --k_samples 8 --rollout_max_new_tokens 64 --max_prompt_length 128
        --max_seq_length 192 --learning_rate_lora 3e-4 --save_steps 0 --eval_max_prompts 64 --seed 0
        --vllm_enforce_eager true --logging_steps 1)
launcher=(deepspeed)
command -v deepspeed >/dev/null 2>&1 || launcher=(python -m deepspeed.launcher.runner)
if [ "${SKIP_E2E:-0}" != 1 ]; then
  "${launcher[@]}" --num_gpus 1 train_grpo.py "${common[@]}" --use_vllm_rollout true --max_steps ${E2E_STEPS:-30} \
    --output_dir "$OUT/vllm_run" --overwrite_output_dir > "$OUT/vllm_run.log" 2>&1
  echo "vllm run rc=$?"; grep -E "INFO step|eval at" "$OUT/vllm_run.log" | tail -25
  "${launcher[@]}" --num_gpus 1 train_grpo.py "${common[@]}" --max_steps ${HF_STEPS:-3} \
    --output_dir "$OUT/hf_run" --overwrite_output_dir > "$OUT/hf_run.log" 2>&1
  echo "hf run rc=$?"; grep -E "INFO step" "$OUT/hf_run.log" | tail -5
fi
