#!/usr/bin/env bash
# Learning benchmark (GPU, vLLM): does each tuning strategy learn? Prints held-out accuracy at step 0 and at the end.
#
#   bash benchmarks/learning.sh                                  # arith: full, lora, qlora; GSM8K: lora, qlora
#   ARITH="lora qlora" SEEDS="0 1" GSM8K="" bash benchmarks/learning.sh
#   ARITH=qlora GSM8K="" TAG=nodrop EXTRA="--lora_dropout 0" bash benchmarks/learning.sh   # an ablation
#   TAG=dsstrict STRICT_FORMAT=1 EXTRA="--filter_zero_std_groups true" GSM8K="" bash benchmarks/learning.sh
#                                           # dynamic sampling + arith's format reward paid only when the answer ends
#                                           # at the box (a registry derived from configs/dataset_config.json);
#                                           # STRICT_FORMAT=2: and only when it holds one box;
#                                           # STRICT_FORMAT=any: a box anywhere, repeats paid too (the
#                                           # pattern arith shipped with before it paid one box only)
#   TAG=dapo1any EXTRA="--clip_epsilon_high 0.28 --filter_zero_std_groups true" GSM8K="" \
#     SEEDS="0 1" PARALLEL=6 bash benchmarks/learning.sh   # DAPO with arith's one-box format reward (README)
#   MODEL=outputs/smollm2-nf4-64 ARITH=lora TAG=on-nf4 GSM8K= bash benchmarks/learning.sh   # lora on qlora's
#                                              # rounded base (written by benchmarks/rounded_checkpoint.py)
#   ARITH="" GSM8K="" ARITH_CALC="lora" SEEDS="0 1" STEPS=60 bash benchmarks/learning.sh   # arith with the calculator
#                                              # tool (multi-turn episodes), after WARM_START (30) supervised steps
#                                              # on its demonstrations; the table adds the share of held-out
#                                              # episodes that called it, at step 0 (after the warm start) and at
#                                              # the end
#   ARITH="" GSM8K="" ARITH_PRODUCTS=lora SEEDS="0 1 2" PARALLEL=3 bash benchmarks/learning.sh   # two-digit
#                                              # products with the calculator (arith_products), after a short
#                                              # PRODUCTS_WARM_START (5 steps at PRODUCTS_WARM_LR) that leaves most
#                                              # episodes without a call; evaluated on arith_products_eval. The step-0
#                                              # eval (after the warm start, before any GRPO step) is the baseline:
#                                              # the same start without GRPO. Seed 2 is the unseen seed.
#   ARITH="" GSM8K="" ARITH_PRODUCTS=lora ARITH_PRODUCTS_AGENT=lora SEEDS="0 1" PARALLEL=4 bash benchmarks/learning.sh
#                                              # the same work with the calculator written as an OpenAI-API agent
#                                              # (arith_products_agent: examples/calculator_agent.py through the
#                                              # endpoint), the same warm start (arith_products' demonstrations, its
#                                              # episodes token for token: --warm_start_datasets), steps, seeds and
#                                              # held-out questions (arith_products_agent_eval, played by the agent);
#                                              # benchmarks/agent_table.py then compares the two paths (accuracy,
#                                              # tool share, seconds per model turn in and around the engine)
#   No GPU (nvidia-smi missing): every run on the HF engine with plain python, a CPU smoke test of the same runs, e.g.
#   ARITH="" GSM8K="" ARITH_PRODUCTS=lora ARITH_PRODUCTS_AGENT=lora PRODUCTS_STEPS=2 PRODUCTS_WARM_START=1 \
#     EXTRA="--per_device_train_batch_size 2 --k_samples 2 --eval_max_prompts 4 --eval_steps 2" bash benchmarks/learning.sh
#   GPU_ID=2 bash benchmarks/learning.sh   # every run on GPU 2 (DeepSpeed's launcher ignores CUDA_VISIBLE_DEVICES)
#   PARALLEL=4 GPU_MEMORY_GIB=10 bash benchmarks/learning.sh   # each run under --gpu_memory_gib 10: its memory plan
#                                              # sizes it for 10 GiB (without a cap each run plans for the GPU's
#                                              # free memory, 21-22 GiB each for the 135M model on an H200, which
#                                              # leaves nothing to a neighbour that starts later)
#   PARALLEL=4 bash benchmarks/learning.sh     # up to 4 runs at once on the one GPU (a 135M model leaves it idle);
#                                              # the table's wall / train seconds then include the sharing. Runs
#   that share a GPU keep vLLM awake with a VLLM_MEM share (default 0.08): vLLM sizes its KV cache by profiling the
#   GPU's memory, which another run's sleep / wake would disturb. With 8 at once, or 4 at a 0.15 share, some runs
#   failed to start or ran out of memory on an H100. A run whose vLLM start-up was disturbed that way (profiling
#   failed, a KV cache of no blocks, or no memory left for one) is started once more. Each run's launcher takes a
#   port the OS reports free (PORT=29600: fixed ports from there instead), so several drivers can share the GPU.
#
# arith: SmolLM2-135M-Instruct (embedded), 16 prompts x 8 samples, 64 new tokens, 40 steps, 100 held-out prompts
# evaluated greedily (boxed accuracy). GSM8K: train on train.jsonl, evaluate greedily on all 1,319 test.jsonl
# questions (gsm8k_accuracy), for GSM8K_STEPS steps; the files are read from GSM8K_DIR (default ../shared/data/gsm8k,
# else data/gsm8k). Never run by CI. Results: $OUT_DIR/<run>/ and the table in $OUT_DIR/table.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-outputs/bench/learning}
MODEL=${MODEL:-smollm2-135m-instruct}  # the embedded default, or a local folder (benchmarks/rounded_checkpoint.py)
ARITH=${ARITH-full lora qlora}
ARITH_CALC=${ARITH_CALC-}  # strategies to run on arith_calc (arith's questions, the calculator tool); none by default
WARM_START=${WARM_START:-30}  # arith_calc: supervised steps on its calculator demonstrations first (0: none)
ARITH_PRODUCTS=${ARITH_PRODUCTS-}  # strategies to run on arith_products (calculator needed); none by default
ARITH_PRODUCTS_AGENT=${ARITH_PRODUCTS_AGENT-}  # strategies to run on arith_products_agent (the calculator agent)
PRODUCTS_WARM_START=${PRODUCTS_WARM_START:-5}  # arith_products: supervised steps on its 32 demonstrations
PRODUCTS_STEPS=${PRODUCTS_STEPS:-60}
read -r -a PRODUCTS_ARGS <<< "${PRODUCTS_EXTRA:-}"  # e.g. "--reward_weights ..." for this mode only
GSM8K=${GSM8K-lora qlora}
SEEDS=${SEEDS:-0}
STEPS=${STEPS:-40}
GSM8K_STEPS=${GSM8K_STEPS:-60}
LR=${LR:-3e-4}
LR_FULL=${LR_FULL:-3e-5}
TAG=${TAG:+-$TAG}    # appended to run names
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"  # extra train_grpo.py flags for every run
PARALLEL=${PARALLEL:-1}
port=${PORT:-}  # unset: each start takes a port the OS reports free, so drivers side by side never collide
STRICT_FORMAT=${STRICT_FORMAT:-0}
GSM8K_DIR=${GSM8K_DIR:-../shared/data/gsm8k}
[ -f "$GSM8K_DIR/test.jsonl" ] || GSM8K_DIR=data/gsm8k
mkdir -p "$OUT_DIR"
python -c "from grpo.model.embedded import resolve_model_path as r; import sys; r(sys.argv[1])" "$MODEL"  # convert once, up front
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1
source scripts/launch.sh  # launcher, where (GPU_ID), free_port
if GPU=$(nvidia-smi -i "${GPU_ID:-0}" --query-gpu=name --format=csv,noheader 2>/dev/null) && [ -n "$GPU" ]; then
  ENGINE=(--rollout_engine vllm --vllm_enforce_eager true)
  [ "$PARALLEL" -gt 1 ] && EXTRA_ARGS+=(--vllm_sleep false --vllm_gpu_memory_utilization "${VLLM_MEM:-0.08}")
  [ -n "${GPU_MEMORY_GIB:-}" ] && EXTRA_ARGS+=(--gpu_memory_gib "$GPU_MEMORY_GIB")
else  # no GPU: the HF engine, one process of plain python per run (the launcher's port goes in MASTER_PORT)
  GPU=cpu ENGINE=(--rollout_engine hf) launcher=() where=()
fi
train_command() {  # train_command <master port>: sets `train` to the command that starts train_grpo.py
  if [ "$GPU" = cpu ]; then train=(env MASTER_PORT="$1" python train_grpo.py)
  else train=("${launcher[@]}" "${where[@]}" --master_port "$1" train_grpo.py); fi
}

run() {  # run <name> <dataset> <strategy> <seed> <accuracy reward> <extra train_grpo.py args...>
  local name=$1 dataset=$2 strategy=$3 seed=$4 accuracy=$5; shift 5
  local lr=$LR; [ "$strategy" = full ] && lr=$LR_FULL
  local dir="$OUT_DIR/$name$TAG" start=$(date +%s)
  mkdir -p "$dir"
  local rc try pid starved master_port train
  for try in 1 2; do
    : > "$dir.log"  # emptied before the watcher below reads it
    if [ -n "$port" ]; then master_port=$((port + 100 * (try - 1))); else master_port=$(free_port); fi
    train_command "$master_port"
    setsid "${train[@]}" --model_name_or_path "$MODEL" --tuning_strategy "$strategy" \
      --learning_rate "$lr" --seed "$seed" --per_device_train_batch_size 16 --k_samples 8 \
      "${ENGINE[@]}" --eval_on_start true --save_steps 0 --logging_steps 5 \
      --output_dir "$dir" --overwrite_output_dir "$@" "${EXTRA_ARGS[@]}" > "$dir.log" 2>&1 &
    pid=$! starved=0
    # runs sharing a GPU: vLLM sizes its KV cache by profiling the GPU's memory. A neighbour freeing or taking memory
    # meanwhile makes the profiling fail, leaves a cache of no blocks that generates one sequence at a time, or a
    # negative budget ("No available memory for the cache blocks"); in each case the run is started once more (its own
    # process group is stopped first).
    while kill -0 "$pid" 2>/dev/null; do
      if grep -qs "Available KV cache memory: 0.0 GiB" "$dir.log"; then starved=1; kill -- -"$pid" 2>/dev/null; break; fi
      sleep 5
    done
    wait "$pid"; rc=$?
    [ "$starved" = 1 ] && rc=1
    [ "$try" = 1 ] && [ "$rc" -ne 0 ] && { [ "$starved" = 1 ] || grep -qE "Error in memory profiling|No available memory for the cache blocks|EADDRINUSE" "$dir.log"; } || break
    echo "$name$TAG: disturbed by another run (vLLM's memory profiling, or its port taken); starting it again"
    sleep 15
  done
  printf '{"dataset": "%s", "strategy": "%s%s", "seed": %s, "lr": "%s", "accuracy": "%s", "wall_s": %s, "gpu": "%s", "rc": %s}\n' \
    "$dataset" "$strategy" "$TAG" "$seed" "$lr" "$accuracy" $(( $(date +%s) - start )) "$GPU" "$rc" > "$dir/bench.json"
  echo "$name$TAG: rc=$rc $(grep -E 'eval at step' "$dir.log" | sed 's/.*eval at/eval at/' | cut -c1-160 | tr '\n' ' ')"
}

launch() {  # launch <run args>: runs in the background, at most PARALLEL at once, each on its own port
  while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 2; done
  run "$@" &
  [ -n "$port" ] && port=$((port + 1))
  [ "$PARALLEL" -gt 1 ] && sleep 30  # one vLLM start at a time
}

arith_registry=()
if [ "$STRICT_FORMAT" != 0 ]; then
  python - "$OUT_DIR/arith_strict_registry.json" "$STRICT_FORMAT" <<'PY'
import json, os, sys
arith = json.load(open("configs/dataset_config.json"))["arith"]
arith["path"] = os.path.abspath(os.path.join("configs", arith["path"]))
ends_at_box = r".*\\boxed\{\s*-?\d+\s*\}[\s.$\\)\]]*"  # nothing after the box
# 2: also only one box (a repeated box earns nothing: see benchmarks/completion_shapes.py)
no_second_box = r"(?!.*\\boxed.*\\boxed)"
patterns = {"1": ends_at_box, "2": no_second_box + ends_at_box, "any": r".*\\boxed\{\s*-?\d+\s*\}.*"}
arith["reward_kwargs"]["format"]["pattern"] = patterns[sys.argv[2]]
# written whole, then renamed: runs started side by side (PARALLEL, or several drivers) share the file
partial = f"{sys.argv[1]}.{os.getpid()}"
with open(partial, "w") as registry:
    json.dump({"arith": arith}, registry, indent=1)
os.replace(partial, sys.argv[1])
PY
  arith_registry=(--dataset_config_path "$OUT_DIR/arith_strict_registry.json")
fi
for seed in $SEEDS; do
  for strategy in $ARITH; do
    launch "arith-$strategy-s$seed" arith "$strategy" "$seed" boxed_accuracy --dataset_names arith --max_steps "$STEPS" \
      --rollout_max_new_tokens 64 --max_prompt_length 128 --max_seq_length 192 --eval_max_prompts 100 \
      "${arith_registry[@]}"
  done
done
for seed in $SEEDS; do
  for strategy in $ARITH_CALC; do  # episodes of up to 3 turns; the tool instructions make the prompt ~260 tokens
    launch "arith_calc-$strategy-s$seed" arith_calc "$strategy" "$seed" boxed_accuracy --dataset_names arith_calc \
      --max_steps "$STEPS" --rollout_max_new_tokens 64 --max_turns 3 --max_episode_tokens 256 \
      --max_prompt_length 320 --max_seq_length 576 --eval_max_prompts 100 --warm_start_steps "$WARM_START"
  done
done
for seed in $SEEDS; do
  for strategy in $ARITH_PRODUCTS; do  # as arith_calc, on questions the model cannot do in its head
    launch "arith_products-$strategy-s$seed" arith_products_eval "$strategy" "$seed" boxed_accuracy \
      --dataset_names arith_products --eval_dataset_names arith_products_eval --max_steps "$PRODUCTS_STEPS" \
      --rollout_max_new_tokens 64 --max_turns 3 --max_episode_tokens 256 --max_prompt_length 320 \
      --max_seq_length 576 --eval_max_prompts 100 --eval_steps 20 --warm_start_steps "$PRODUCTS_WARM_START" \
      "${PRODUCTS_ARGS[@]}"
  done
done
for seed in $SEEDS; do
  for strategy in $ARITH_PRODUCTS_AGENT; do  # arith_products with the calculator as an OpenAI-API agent: the same
    # warm start (arith_products' demonstrations are the agent's episodes token for token), steps and held-out questions
    launch "arith_products_agent-$strategy-s$seed" arith_products_agent_eval "$strategy" "$seed" boxed_accuracy \
      --dataset_names arith_products_agent --eval_dataset_names arith_products_agent_eval \
      --agent_module examples/calculator_agent.py --warm_start_datasets arith_products --max_steps "$PRODUCTS_STEPS" \
      --rollout_max_new_tokens 64 --max_turns 3 --max_episode_tokens 256 --max_prompt_length 320 \
      --max_seq_length 576 --eval_max_prompts 100 --eval_steps 20 --warm_start_steps "$PRODUCTS_WARM_START" \
      "${PRODUCTS_ARGS[@]}"
  done
done
if [ -n "$GSM8K" ] && [ -f "$GSM8K_DIR/test.jsonl" ]; then
  registry="$OUT_DIR/gsm8k_registry.json"
  python - "$GSM8K_DIR" "$registry" <<'PY'
import json, os, sys
src, out = os.path.abspath(sys.argv[1]), sys.argv[2]
entries = json.load(open("configs/dataset_config.json"))
entries["gsm8k"]["path"] = os.path.join(src, "train.jsonl")
entries["gsm8k_test"] = dict(entries["gsm8k"], path=os.path.join(src, "test.jsonl"))
json.dump(entries, open(out, "w"), indent=1)
PY
  for strategy in $GSM8K; do
    launch "gsm8k-$strategy-s0" gsm8k "$strategy" 0 gsm8k_accuracy --dataset_config_path "$registry" \
      --dataset_names gsm8k --eval_dataset_names gsm8k_test --eval_max_prompts -1 --max_steps "$GSM8K_STEPS" \
      --rollout_max_new_tokens 256 --max_prompt_length 256 --max_seq_length 512 --filter_overlong_prompts \
      --per_device_train_batch_size 4 --gradient_accumulation_steps 4  # 16 prompts a step, 32 x 512 tokens a micro-batch
  done
elif [ -n "$GSM8K" ]; then
  echo "GSM8K skipped: no test.jsonl in $GSM8K_DIR"
fi
wait
python benchmarks/learning_table.py "$OUT_DIR"/*/ | tee "$OUT_DIR/table.md"
if [ -n "$ARITH_PRODUCTS_AGENT" ]; then  # the agent against the native tool path, seed by seed
  python benchmarks/agent_table.py "$OUT_DIR"/*/ | tee "$OUT_DIR/agent_table.md"
fi
