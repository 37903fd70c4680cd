import logging
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


# a tiny random model and a 40-prompt registry, shared by the end-to-end trainer tests of a module
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from .tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    from .trainer_setup import write_prompt_registry

    return write_prompt_registry(str(tmp_path_factory.mktemp("data")))


@pytest.fixture
def grpo_log():
    """The lines the "grpo" logger writes (the trainer turns its propagation off)."""
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("grpo")
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not the attribute: it clears what isEnabledFor has cached
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)
