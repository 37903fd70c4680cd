#!/usr/bin/env bash
# Does streaming cost learning? The embedded SmolLM2-135M-Instruct on `arith` (LoRA) in server mode (1 training +
# 1 rollout rank), the same steps and seed with --max_staleness 1 (= --async_rollout), 2 and 4; each run's held-out
# accuracy at the end (eval/rewards/boxed_accuracy over EVAL_PROMPTS eval prompts). It passes when every K is within
# TOLERANCE (0.1) of K = 1, and prints a table (also $OUT/table.md). With 2+ GPUs it uses vLLM when importable; on a
# CPU train_grpo.py sizes the runs for it (grpo/config/cpu_sizing.py) unless MAX_STEPS / BATCH / MAX_NEW are given.
#
#   bash benchmarks/stream_learning.sh
#   KS="1 2" MAX_STEPS=60 SEGMENT=64 OUT=outputs/stream_learning bash benchmarks/stream_learning.sh
#
# Knobs: OUT KS MAX_STEPS BATCH MAX_NEW SEGMENT (--rollout_segment_tokens, 0: whole completions) EVAL_PROMPTS
# TOLERANCE SEED PORT EXTRA_ARGS ENGINE (hf or vllm: the rollout engine, else chosen as above) TABLE_ONLY (1: only
# the table of the runs already in $OUT, e.g. after the K's ran at once, each its own invocation:
#   for k in 1 2 4; do KS=$k PORT=$((29620 + k)) bash benchmarks/stream_learning.sh & done; wait
#   TABLE_ONLY=1 bash benchmarks/stream_learning.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/bench/stream_learning}
KS=${KS:-1 2 4}
SEGMENT=${SEGMENT:-0}
EVAL_PROMPTS=${EVAL_PROMPTS:-32}
TOLERANCE=${TOLERANCE:-0.1}
SEED=${SEED:-42}
port=${PORT:-29620}
launcher=(deepspeed); command -v deepspeed >/dev/null 2>&1 || launcher=(python3 -m deepspeed.launcher.runner)
engine=(--rollout_engine hf)
if [ -n "${ENGINE:-}" ]; then
  engine=(--rollout_engine "$ENGINE"); [ "$ENGINE" = vllm ] && engine+=(--vllm_enforce_eager)
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python3 -c 'import vllm' >/dev/null 2>&1 && engine=(--rollout_engine vllm --vllm_enforce_eager)
fi
sizes=()
[ -n "${MAX_STEPS:-}" ] && sizes+=(--max_steps "$MAX_STEPS")
[ -n "${BATCH:-}" ] && sizes+=(--per_device_train_batch_size "$BATCH")
[ -n "${MAX_NEW:-}" ] && sizes+=(--rollout_max_new_tokens "$MAX_NEW")
mkdir -p "$OUT"

for k in $KS; do
  [ "${TABLE_ONLY:-0}" = 1 ] && break
  dir="$OUT/k$k"
  echo "== --max_staleness $k (segments: $SEGMENT tokens) -> $dir"
  segment=(); [ "$SEGMENT" != 0 ] && segment=(--rollout_segment_tokens "$SEGMENT")
  VLLM_ENABLE_V1_MULTIPROCESSING=0 "${launcher[@]}" --num_gpus 2 --master_port "$port" train_grpo.py \
    --model_name_or_path smollm2-135m-instruct --dataset_names arith --tuning_strategy lora \
    --rollout_mode server --rollout_gpus 1 --max_staleness "$k" "${segment[@]}" "${engine[@]}" "${sizes[@]}" \
    --eval_max_prompts "$EVAL_PROMPTS" --eval_steps 0 --eval_on_start false --save_steps 0 --seed "$SEED" \
    --output_dir "$dir" --overwrite_output_dir ${EXTRA_ARGS:-} > "$dir.log" 2>&1
  echo "   rc=$?; $(grep -E 'step [0-9]+:' "$dir.log" | tail -1 | cut -c1-160)"
  port=$((port + 1))
done

python3 - "$OUT" "$TOLERANCE" $KS <<'EOF' | tee "$OUT/table.md"
import json, os, sys

out, tolerance, ks = sys.argv[1], float(sys.argv[2]), sys.argv[3:]


def rows(k):
    path = os.path.join(out, f"k{k}", "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.isfile(path) else []


def held_out(k, key="eval/rewards/boxed_accuracy"):
    evals = [r for r in rows(k) if key in r]
    return evals[-1][key] if evals else None


def mean(k, key):
    values = [r[key] for r in rows(k) if key in r]
    return sum(values) / len(values) if values else float("nan")


print("| K | steps | held-out accuracy | held-out reward | staleness mean | partial share | rollout idle s / step | "
      "trainer wait s / step |")
print("|---|---|---|---|---|---|---|---|")
for k in ks:
    steps = max((r["step"] for r in rows(k) if "loss" in r), default=0)
    accuracy, reward = held_out(k), held_out(k, "eval/reward/mean")
    print(f"| {k} | {steps} | {'-' if accuracy is None else f'{accuracy:.3f}'} | "
          f"{'-' if reward is None else f'{reward:.3f}'} | "
          f"{mean(k, 'stream/staleness_mean'):.2f} | {mean(k, 'stream/partial_share'):.2f} | "
          f"{mean(k, 'stream/rollout_idle_s'):.2f} | {mean(k, 'stream/trainer_wait_s'):.2f} |")
base = held_out(ks[0])
gaps = {k: abs(held_out(k) - base) for k in ks[1:] if held_out(k) is not None and base is not None}
ok = base is not None and len(gaps) == len(ks) - 1 and all(g <= tolerance for g in gaps.values())
print(f"\nwithin {tolerance} of K = {ks[0]}: {'yes' if ok else 'NO'} ({gaps})")
sys.exit(0 if ok else 1)
EOF
