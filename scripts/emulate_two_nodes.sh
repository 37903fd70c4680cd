#!/usr/bin/env bash
# Two nodes emulated on one host, started as Slurm starts real ones: one DeepSpeed launcher per "node"
# (--no_ssh --node_rank 0/1 --master_addr 127.0.0.1, one hostfile naming both), node 0 on the first half of the
# GPUs, node 1 on the second half (the launcher sets each node's CUDA_VISIBLE_DEVICES from --include), each node its
# own TMPDIR, GRPO_CACHE_DIR, HF_HOME and TRITON_CACHE_DIR under $NODES_DIR/node<N>. The output folder is shared, as
# it must be. Exits with the first non-zero exit code of the two; each node's output in $NODES_DIR/node<N>.log.
#
#   bash scripts/emulate_two_nodes.sh --model_name_or_path smollm2-135m-instruct --dataset_names arith \
#        --output_dir outputs/two_nodes --max_steps 4
#   GPUS_PER_NODE=1 bash scripts/emulate_two_nodes.sh ...              # 2 nodes x 1 GPU on a 2-GPU host
#   bash scripts/emulate_two_nodes.sh ... --rollout_mode server --rollout_gpus 2   # the rollout ranks on node 1
#
# Knobs: GPUS_PER_NODE (default: half of the host's GPUs), NODES_DIR (default outputs/emulated_nodes), PORT.
set -uo pipefail
cd "$(dirname "$0")/.."
total=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
per=${GPUS_PER_NODE:-$((total / 2))}
[ "$per" -ge 1 ] || { echo "emulate_two_nodes.sh: needs 2 GPUs or more (found $total)"; exit 1; }
NODES_DIR=${NODES_DIR:-outputs/emulated_nodes}
PORT=${PORT:-29800}
mkdir -p "$NODES_DIR"
printf 'node0 slots=%s\nnode1 slots=%s\n' $((2 * per)) $((2 * per)) > "$NODES_DIR/hostfile"
node0=$(seq -s, 0 $((per - 1)))
node1=$(seq -s, "$per" $((2 * per - 1)))
launcher=(deepspeed)
command -v deepspeed > /dev/null || launcher=(python -m deepspeed.launcher.runner)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
unset CUDA_VISIBLE_DEVICES  # the launcher sets it per node
pids=()
for node in 0 1; do
  own="$NODES_DIR/node$node"
  mkdir -p "$own/tmp" "$own/grpo_cache" "$own/hf" "$own/triton"
  env TMPDIR="$own/tmp" GRPO_CACHE_DIR="$own/grpo_cache" HF_HOME="$own/hf" TRITON_CACHE_DIR="$own/triton" \
    "${launcher[@]}" --hostfile "$NODES_DIR/hostfile" --include "node0:$node0@node1:$node1" \
    --no_ssh --node_rank "$node" --master_addr 127.0.0.1 --master_port "$PORT" \
    train_grpo.py "$@" > "$NODES_DIR/node$node.log" 2>&1 &
  pids+=($!)
done
status=0
for node in 0 1; do
  wait "${pids[$node]}"; rc=$?
  echo "node $node: exit $rc ($NODES_DIR/node$node.log)"
  [ "$status" = 0 ] && status=$rc
done
tail -n 3 "$NODES_DIR/node0.log"
exit "$status"
