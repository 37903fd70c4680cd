#!/usr/bin/env bash
# Train with GRPO. With no arguments: the embedded SmolLM2-135M-Instruct on the bundled `arith` set
# (a short run on CPU, a longer one on GPU). Every setting below can be overridden from the environment,
# e.g.  STRATEGY=qlora DATASETS=gsm8k MODEL_PATH=Qwen/Qwen2.5-1.5B-Instruct bash run_grpo.sh
# and any extra arguments are passed through to train_grpo.py (they win over these defaults).
set -euo pipefail
cd "$(dirname "$0")"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
else
  GPUS=0
fi

MODEL_PATH=${MODEL_PATH:-smollm2-135m-instruct}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/grpo-$(date +%Y%m%d-%H%M%S)}
DATASETS=${DATASETS:-arith}
DATASET_CONFIG=${DATASET_CONFIG:-configs/dataset_config.json}
STRATEGY=${STRATEGY:-lora}
DEEPSPEED_CONFIG=${DEEPSPEED_CONFIG:-configs/zero2.json}
K_SAMPLES=${K_SAMPLES:-8}
TEMPERATURE=${TEMPERATURE:-1.0}
LORA_RANK=${LORA_RANK:-16}
LORA_ALPHA=${LORA_ALPHA:-32}
SEED=${SEED:-42}
LR_GIVEN=${LR:-}
PYTHON=${PYTHON:-python3}
if ! $PYTHON -c 'import grpo, deepspeed, peft' >/dev/null 2>&1; then
  echo "installing grpo and its dependencies (scripts/install.sh)..." >&2
  PYTHON=$PYTHON bash scripts/install.sh
fi
if [ "$GPUS" -gt 0 ]; then
  MAX_STEPS=${MAX_STEPS:-200}; BATCH=${BATCH:-8}; MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
  LR=${LR:-3e-4}; EVAL_STEPS=${EVAL_STEPS:-25}; SAVE_STEPS=${SAVE_STEPS:-50}
  USE_VLLM=${USE_VLLM:-$(${PYTHON:-python3} -c 'import vllm' >/dev/null 2>&1 && echo true || echo false)}
else
  # on a CPU shared with other work the run slows in proportion to its share: grpo lets idle OpenMP threads sleep
  # (OMP_WAIT_POLICY=PASSIVE) and sizes torch's threads to the cores it may use, unless you set OMP_* yourself.
  # sized to finish in about 10 minutes on a 2-core CPU: the values train_grpo.py takes on a CPU, from their one
  # source (grpo/config/cpu_sizing.py: cpu_MAX_STEPS=14, cpu_BATCH=4, ...)
  eval "$($PYTHON -m grpo.config.cpu_sizing)"
  MAX_STEPS=${MAX_STEPS:-$cpu_MAX_STEPS}; BATCH=${BATCH:-$cpu_BATCH}; MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-$cpu_MAX_NEW_TOKENS}
  LR=${LR:-$cpu_LR}; EVAL_STEPS=${EVAL_STEPS:-0}; SAVE_STEPS=${SAVE_STEPS:-$cpu_SAVE_STEPS}
  USE_VLLM=false
fi

[ "$STRATEGY" = full ] && [ -z "$LR_GIVEN" ] && LR=1e-6  # the defaults above are lora / qlora rates
ENGINE=hf; [ "$USE_VLLM" = true ] && ENGINE=vllm

args=(
  --model_name_or_path "$MODEL_PATH" --output_dir "$OUTPUT_DIR"
  --dataset_config_path "$DATASET_CONFIG" --dataset_names "$DATASETS"
  --tuning_strategy "$STRATEGY" --lora_rank "$LORA_RANK" --lora_alpha "$LORA_ALPHA"
  --deepspeed "$DEEPSPEED_CONFIG" --max_steps "$MAX_STEPS" --per_device_train_batch_size "$BATCH"
  --k_samples "$K_SAMPLES" --temperature "$TEMPERATURE" --rollout_max_new_tokens "$MAX_NEW_TOKENS"
  --max_prompt_length 200 --max_seq_length $((200 + MAX_NEW_TOKENS))
  --learning_rate "$LR" --eval_steps "$EVAL_STEPS" --save_steps "$SAVE_STEPS" --seed "$SEED"
  --eval_max_prompts 32 --rollout_engine "$ENGINE"
)

export TOKENIZERS_PARALLELISM=false
if [ "$GPUS" -gt 0 ]; then
  launcher=(deepspeed)
  command -v deepspeed >/dev/null 2>&1 || launcher=($PYTHON -m deepspeed.launcher.runner)
  exec "${launcher[@]}" --num_gpus "$GPUS" train_grpo.py "${args[@]}" "$@"
else
  exec $PYTHON train_grpo.py "${args[@]}" "$@"
fi
