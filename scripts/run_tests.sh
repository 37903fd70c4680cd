#!/usr/bin/env bash
# Installs what the tests need, then runs the whole CPU test suite (GPU tests skip themselves without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/grpo/torch_extensions}
export WANDB_MODE=${WANDB_MODE:-disabled}
exec ${PYTHON:-python3} -m pytest tests -q -p no:cacheprovider "$@"
