# Sourced by the GPU scripts (benchmarks/learning.sh, memory_scale.sh, throughput.sh, train_memory.sh;
# scripts/gpu_tests.sh): how they start train_grpo.py.
#   launcher   DeepSpeed's launcher: `deepspeed`, or its module where the entry point is not on PATH
#   where      one GPU: GPU_ID's when set (DeepSpeed's launcher ignores CUDA_VISIBLE_DEVICES when given --num_gpus)
#   free_port  a port the OS reports free, for --master_port, so that runs on other GPUs do not collide
launcher=(deepspeed)
command -v deepspeed >/dev/null 2>&1 || launcher=(python -m deepspeed.launcher.runner)
where=(--num_gpus 1); [ -n "${GPU_ID:-}" ] && where=(--include "localhost:$GPU_ID")
free_port() { python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
