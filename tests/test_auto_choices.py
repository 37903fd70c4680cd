"""Every automatic memory choice is made in one place, the memory plan (grpo/memory/): --rollout_weights auto (also
for server mode's rollout ranks), --vllm_sleep_level's default, --vllm_kv_cache_gib auto, --max_tokens_per_micro_batch
auto and --gradient_checkpointing auto. The rest of grpo/ reads the plan's values: a scan of the source says so, and
the engine's builders take the plan's choice as a value (rollout code never imports the planner)."""
import ast
import os

import pytest

from grpo.config.options import GRPOConfig

from .trainer_setup import ROOT

GRPO = os.path.join(ROOT, "grpo")
# the options whose "auto" (or None: auto) the plan resolves
AUTO_FLAGS = {"rollout_weights", "vllm_sleep_level", "vllm_kv_cache", "vllm_kv_cache_gib",
              "max_tokens_per_micro_batch", "gradient_checkpointing"}
# where such a flag may still be compared with auto outside grpo/memory and grpo/config (parsing, validation), and why
READS_AUTO = {
    # auto or explicit: an explicit choice the loaded policy cannot take is an error, the plan's choice falls back
    ("grpo/rollout/engines.py", "rollout_weights"),
    ("grpo/rollout/engines.py", "vllm_sleep_level"),  # an explicit level is taken as given
    # auto: the options take the plan's log-prob chunk (as its budget's)
    ("grpo/train/trainer.py", "max_tokens_per_micro_batch"),
}
# the auto rules and their tunables: read by the plan alone (and the one shared rule by the loader it serves)
RULES = {"preferred_weights": {"grpo/memory"}, "default_sleep_level": {"grpo/memory"},
         "auto_checkpointing": {"grpo/memory"}, "auto_kv_cache_bytes": {"grpo/memory"},
         "ADAPTER_FROM_SHARE": {"grpo/memory"}, "IN_PLACE_FROM_BYTES": {"grpo/memory"},
         "KEEP_WEIGHTS_UP_TO_SHARE": {"grpo/memory"}, "UNPLANNED_SLEEP_LEVEL": {"grpo/memory"},
         "checkpointing_by_size": {"grpo/memory", "grpo/model/loading.py"},
         "CHECKPOINTING_FROM_PARAMETERS": {"grpo/memory", "grpo/model/loading.py"},
         "CHECKPOINTING_ON_CPU": {"grpo/memory", "grpo/model/loading.py"}}


def auto_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, flag) of every comparison of an option of AUTO_FLAGS (an attribute: config.rollout_weights) with "auto"
    or None."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        flags = [side.attr for side in sides if isinstance(side, ast.Attribute) and side.attr in AUTO_FLAGS]
        auto = any(isinstance(side, ast.Constant) and (side.value == "auto" or side.value is None) for side in sides)
        if flags and auto:
            found += [(node.lineno, flag) for flag in flags]
    return sorted(found)


def grpo_files():
    for folder, _, files in os.walk(GRPO):
        for file in sorted(files):
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                yield os.path.relpath(path, ROOT).replace(os.sep, "/"), open(path).read()


def test_the_scan_finds_comparisons_with_auto():
    source = '''
if config.rollout_weights == "auto": pass
if cfg.max_tokens_per_micro_batch != "auto": pass
x = 1 if config.gradient_checkpointing is None else 2
if "auto" == self.config.vllm_kv_cache: pass
if config.rollout_weights == "in_place": pass
if value == "auto": pass
if config.learning_rate is None: pass
'''
    assert auto_comparisons(source) == [(2, "rollout_weights"), (3, "max_tokens_per_micro_batch"),
                                        (4, "gradient_checkpointing"), (5, "vllm_kv_cache")]


def test_no_auto_is_resolved_outside_the_memory_plan():
    hits = []
    for path, source in grpo_files():
        if path.startswith(("grpo/memory/", "grpo/config/")):
            continue
        hits += [f"{path}:{line} {flag}" for line, flag in auto_comparisons(source)
                 if (path, flag) not in READS_AUTO]
    assert hits == [], f"auto is the memory plan's to resolve (grpo/memory/plan.py); read the plan's value: {hits}"


def test_the_auto_rules_are_read_by_the_plan_alone():
    hits = []
    for path, source in grpo_files():
        names = {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)} | \
                {alias.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
                 for alias in node.names} | \
                {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)}
        for name in names & RULES.keys():
            if not any(path == place or path.startswith(place + "/") for place in RULES[name]):
                hits.append(f"{path}: {name}")
    assert hits == [], hits


def test_the_options_decide_no_engine_weights_of_their_own():
    # (the property that decided --rollout_weights auto from the options alone, a second rule beside the plan's)
    assert not hasattr(GRPOConfig, "engine_weights")


def test_a_colocated_vllm_engine_is_built_from_the_plan_only():
    import torch

    from grpo.rollout import engines

    config = GRPOConfig(tuning_strategy="qlora", rollout_engine="vllm")
    with pytest.raises(ValueError, match="colocated vLLM engine takes the memory plan's choices"):
        engines.build_rollout_engine(config, "some/model", None, None, None, 0, torch.float32)


def test_the_rollout_ranks_take_the_trainers_planned_weights(monkeypatch):
    """Server mode: the rollout ranks build their vLLM engine with the weights training rank 0's plan chose (and the
    loaded policy took), sent in the engine's spec; nothing there decides them again."""
    from grpo.entry.serve import vllm_options

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = GRPOConfig(tuning_strategy="qlora", rollout_engine="vllm", rollout_mode="server", rollout_gpus=1)
    spec = dict(stop_token_ids=[2], max_images_per_prompt=0, image_token_id=None, lora_rank=16, quantized=True,
                rollout_weights="adapter")
    options = vllm_options(config, spec, 0)
    assert options["lora_rank"] == 16 and options["quantized"] and not options["enable_sleep"]
    assert options["kv_cache_bytes"] is None  # server mode's default: what the share leaves (auto is refused there)
    merged = vllm_options(config, {**spec, "lora_rank": None, "quantized": False, "rollout_weights": "merged"}, 0)
    assert merged["lora_rank"] is None and not merged["quantized"]
    with pytest.raises(RuntimeError, match="spec says weights 'merged' with LoRA rank 16"):
        vllm_options(config, {**spec, "rollout_weights": "merged"}, 0)
