#!/usr/bin/env bash
# Checks setup.py's lower bounds: installs the oldest allowed version of the libraries whose APIs grpo leans on most
# into a throwaway virtual environment layered over the current one (torch and everything else come from here), then
# runs a few fast tests with it: model loading, LoRA and QLoRA adapters, DeepSpeed training steps and a resume.
# The versions are read from setup.py's install_requires (each named library needs one ">=" bound there).
#   FLOOR_LIBRARIES  the libraries installed at their floor (default below)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIBRARIES=${FLOOR_LIBRARIES:-"transformers peft accelerate bitsandbytes datasets deepspeed"}

floors=$($PY - $LIBRARIES <<'EOF'
import ast
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tree = ast.parse(open("setup.py").read())
requires = [ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "setup" for k in node.keywords if k.arg == "install_requires"]
if len(requires) != 1:
    sys.exit("setup.py: no single setup(install_requires=[...]) list")
by_name = {canonicalize_name(Requirement(r).name): Requirement(r) for r in requires[0]}
for name in sys.argv[1:]:
    req = by_name.get(canonicalize_name(name))
    lower = [s.version for s in req.specifier if s.operator == ">="] if req else []
    if len(lower) != 1:
        sys.exit(f"setup.py: install_requires has no single '>=' bound for {name} ({req})")
    print(f"{req.name}=={lower[0]}")
EOF
)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# no pip of its own: the current one installs into the new environment. The new one sees the current environment's
# packages after its own through a .pth file: --system-site-packages would show the system's instead, which are not
# the current ones when this runs inside a virtual environment.
$PY -m venv --without-pip "$tmp/venv"
FLOOR_PY="$tmp/venv/bin/python"
$PY -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
  > "$($FLOOR_PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/current_environment.pth"
# the installed torch stays (without its local build tag, +cpu / +cu130, the installed wheel satisfies the pin)
$PY -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$tmp/constraints.txt"
echo "install floors: $(echo $floors)"
$FLOOR_PY -m pip install -q --disable-pip-version-check -c "$tmp/constraints.txt" $floors
$FLOOR_PY - $LIBRARIES <<'EOF'
import sys
from importlib.metadata import version

print("testing with " + ", ".join(f"{name} {version(name)}" for name in ["torch"] + sys.argv[1:]))
EOF

export WANDB_MODE=${WANDB_MODE:-disabled}
# DeepSpeed's compiled op, kept apart from the one of the newest DeepSpeed (each would rebuild the other's)
export TORCH_EXTENSIONS_DIR=${FLOOR_TORCH_EXTENSIONS_DIR:-$HOME/.cache/grpo/torch_extensions_floor}
tests="strategies_train_the_right_parameters or saved_outputs_load_without_grpo or excluded_modules_get_no_lora"
tests+=" or lora_bias_modules_to_save or resume_is_exact or sync_sends_the_checkpoint_names or bad_images_are_one"
tests+=" or every_source_kind_loads or render_prompts"
exec "$FLOOR_PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -W ignore::FutureWarning \
  tests/test_models.py tests/test_sync.py tests/test_trainer.py tests/test_data.py tests/test_vision.py \
  -k "$tests" "$@"
