#!/usr/bin/env bash
# Does streaming cost learning? The embedded SmolLM2-135M-Instruct on `arith` (LoRA) in server mode (1 training +
# 1 rollout rank), the same steps and seed with --max_staleness 1 (= --async_rollout), 2 and 4; each run's held-out
# accuracy at the end (eval/rewards/boxed_accuracy over EVAL_PROMPTS eval prompts). It passes when every K is within
# TOLERANCE (0.1) of K = 1 (with several SEEDS, their mean accuracy), and prints a table (also $OUT/table.md). With 2+ GPUs it uses vLLM when importable; on a
# CPU train_grpo.py sizes the runs for it (grpo/config/cpu_sizing.py) unless MAX_STEPS / BATCH / MAX_NEW are given.
#
#   bash benchmarks/stream_learning.sh
#   KS="1 2" MAX_STEPS=60 SEGMENT=64 OUT=outputs/stream_learning bash benchmarks/stream_learning.sh
#   SEEDS="0 1" bash benchmarks/stream_learning.sh      # each K with each seed, into $OUT/s<seed>/k<K>
#
# Knobs: OUT KS MAX_STEPS BATCH MAX_NEW SEGMENT (--rollout_segment_tokens, 0: whole completions) EVAL_PROMPTS
# TOLERANCE SEED (one run per K into $OUT/k<K>) or SEEDS (several: $OUT/s<seed>/k<K>) PORT EXTRA_ARGS ENGINE (hf or vllm: the rollout engine, else chosen as above) TABLE_ONLY (1: only
# the table of the runs already in $OUT, e.g. after the K's ran at once, each its own invocation:
#   for k in 1 2 4; do KS=$k PORT=$((29620 + 10 * k)) bash benchmarks/stream_learning.sh & done; wait
# (each invocation takes a port a run from PORT on: space them by its runs, K's x seeds)
#   TABLE_ONLY=1 bash benchmarks/stream_learning.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/bench/stream_learning}
KS=${KS:-1 2 4}
SEGMENT=${SEGMENT:-0}
EVAL_PROMPTS=${EVAL_PROMPTS:-32}
TOLERANCE=${TOLERANCE:-0.1}
SEED=${SEED:-42}
SEEDS=${SEEDS:-}  # empty: one seed (SEED), runs in $OUT/k<K>
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

for seed in ${SEEDS:-$SEED}; do
  for k in $KS; do
    [ "${TABLE_ONLY:-0}" = 1 ] && break 2
    dir="$OUT/k$k"; [ -n "$SEEDS" ] && dir="$OUT/s$seed/k$k"
    mkdir -p "$(dirname "$dir")"
    echo "== --max_staleness $k, seed $seed (segments: $SEGMENT tokens) -> $dir"
    segment=(); [ "$SEGMENT" != 0 ] && segment=(--rollout_segment_tokens "$SEGMENT")
    VLLM_ENABLE_V1_MULTIPROCESSING=0 "${launcher[@]}" --num_gpus 2 --master_port "$port" train_grpo.py \
      --model_name_or_path smollm2-135m-instruct --dataset_names arith --tuning_strategy lora \
      --rollout_mode server --rollout_gpus 1 --max_staleness "$k" "${segment[@]}" "${engine[@]}" "${sizes[@]}" \
      --eval_max_prompts "$EVAL_PROMPTS" --eval_steps 0 --eval_on_start false --save_steps 0 --seed "$seed" \
      --output_dir "$dir" --overwrite_output_dir ${EXTRA_ARGS:-} > "$dir.log" 2>&1
    echo "   rc=$?; $(grep -E 'step [0-9]+:' "$dir.log" | tail -1 | cut -c1-160)"
    port=$((port + 1))
  done
done

# the runs' folders: $OUT/k<K> (one seed) or $OUT/s<seed>/k<K> (SEEDS)
python3 - "$OUT" "$TOLERANCE" "$SEEDS" $KS <<'EOF' | tee "$OUT/table.md"
import json, os, sys

out, tolerance, seeds, ks = sys.argv[1], float(sys.argv[2]), sys.argv[3].split(), sys.argv[4:]
folders = [os.path.join(out, f"s{seed}") for seed in seeds] or [out]


def rows(folder, k):
    path = os.path.join(folder, f"k{k}", "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.isfile(path) else []


def held_out(folder, k, key="eval/rewards/boxed_accuracy"):
    evals = [r for r in rows(folder, k) if key in r]
    return evals[-1][key] if evals else None


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def step_mean(folder, k, key):
    return mean([r.get(key) for r in rows(folder, k)])


def older_gap(folder, k):
    """The engine-vs-trainer gap over tokens 1 or more versions behind, per step (mean of the steps' buckets)."""
    return mean([mean([v for key, v in r.items() if key.startswith("rollout/logprob_diff_behind_")
                       and not key.endswith("_0")]) for r in rows(folder, k)])


def shown(value, digits=3):
    return "-" if value is None else f"{value:.{digits}f}"


print("| K | seed | steps | held-out accuracy | held-out reward | staleness mean | partial share | rollout idle s / "
      "step | trainer wait s / step | engine gap, tokens 0 / 1+ versions behind |")
print("|---|---|---|---|---|---|---|---|---|---|")
for k in ks:
    for folder, seed in zip(folders, seeds or [os.environ.get("SEED", "42")]):
        steps = max((r["step"] for r in rows(folder, k) if "loss" in r), default=0)
        print(f"| {k} | {seed} | {steps} | {shown(held_out(folder, k))} | "
              f"{shown(held_out(folder, k, 'eval/reward/mean'))} | "
              f"{shown(step_mean(folder, k, 'stream/staleness_mean'), 2)} | "
              f"{shown(step_mean(folder, k, 'stream/partial_share'), 2)} | "
              f"{shown(step_mean(folder, k, 'stream/rollout_idle_s'), 2)} | "
              f"{shown(step_mean(folder, k, 'stream/trainer_wait_s'), 2)} | "
              f"{shown(step_mean(folder, k, 'rollout/logprob_diff_behind_0'))} / {shown(older_gap(folder, k))} |")
# each K's accuracy: over the seeds that finished (all of them, or the comparison is not made)
accuracy = {k: [held_out(folder, k) for folder in folders] for k in ks}
means = {k: mean(values) if None not in values else None for k, values in accuracy.items()}
if len(folders) > 1:
    print("\nmean held-out accuracy over seeds " + ", ".join(seeds) + ": " +
          ", ".join(f"K = {k} {shown(means[k])}" for k in ks))
base = means[ks[0]]
gaps = {k: abs(means[k] - base) for k in ks[1:] if means[k] is not None and base is not None}
ok = base is not None and len(gaps) == len(ks) - 1 and all(g <= tolerance for g in gaps.values())
print(f"\nwithin {tolerance} of K = {ks[0]}: {'yes' if ok else 'NO'} ({ {k: round(g, 3) for k, g in gaps.items()} })")
sys.exit(0 if ok else 1)
EOF
