#!/usr/bin/env bash
# Installs what the tests need, then runs the whole CPU test suite (GPU tests skip themselves without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/grpo/torch_extensions}
export WANDB_MODE=${WANDB_MODE:-disabled}
# arguments go to pytest: files or folders select what runs (e.g. tests/test_cli.py -k help); without any, tests/
paths=tests
for arg in "$@"; do [ -e "${arg%%::*}" ] && paths=; done
# -rs: each skipped test with its reason (no sandbox here, no GPU, ...)
exec ${PYTHON:-python3} -m pytest -q -rs -p no:cacheprovider $paths "$@"
