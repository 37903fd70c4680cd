import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# one op is compiled on DeepSpeed's first start; keep it across runs
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "grpo", "torch_extensions"))

GSM8K_DIR = os.path.join(os.path.dirname(ROOT), "shared", "data", "gsm8k")


@pytest.fixture
def gsm8k_dir():
    if not os.path.isfile(os.path.join(GSM8K_DIR, "train.jsonl")):
        pytest.skip(f"GSM8K not found at {GSM8K_DIR}")
    return GSM8K_DIR
