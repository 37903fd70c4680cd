"""On a GPU with vLLM: in multi-turn episodes the engine's log-probs of the model's tokens match the trainer's after
every sync, for lora and qlora. train_grpo.py runs the embedded SmolLM2 on `arith` questions with an environment that
asks the model to check its answer after each of its turns (so every episode that is not cut has three model turns
with the environment's tokens between them), and logs the engine-vs-trainer gap at every step."""
import importlib.util
import json
import os
import subprocess

import pytest
import torch

from tests.trainer_setup import ROOT, deepspeed_launcher, gpu_flags, launcher_env, train_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs CUDA and vLLM")
# mean |log-prob difference| over the model's sampled tokens between vLLM and the trainer, both bf16: single-turn
# runs of SmolLM2 on `arith` at temperature 1 log 0.038-0.047 at step 1 on an H100 for lora and qlora alike, and
# tests/gpu/test_server_mode.py bounds that gap by 0.06; an engine that misses a sync, or scores a context other than
# the trainer's, is 1.9-8 away (tests/gpu/sync_check.py)
SYNCED_MAX = 0.06
MAX_TURNS = 3
ENVIRONMENT = "check_it_again"
# never done: an episode ends at MAX_TURNS model turns, or earlier when a model turn is cut by the token limits
CHECK_AGAIN = "Check that once more. Give only the final answer in \\boxed{}."
ENVIRONMENT_MODULE = f'''
from grpo.tools import EnvironmentStep, register_environment


@register_environment("{ENVIRONMENT}")
def check_it_again(messages, **fields):
    return EnvironmentStep([{{"role": "user", "content": {CHECK_AGAIN!r}}}])
'''


def write_episode_dataset(folder) -> tuple[str, str]:
    """The registry (one dataset, `arith_checked`: the shipped `arith` rows answered by the environment above) and
    the environment's module, written to `folder`; returns their paths."""
    os.makedirs(folder, exist_ok=True)
    module = os.path.join(str(folder), "check_it_again.py")
    with open(module, "w") as fh:
        fh.write(ENVIRONMENT_MODULE)
    with open(os.path.join(ROOT, "configs", "dataset_config.json")) as fh:
        entry = dict(json.load(fh)["arith"])
    entry.update(path=os.path.join(ROOT, "data", "arith", "train.jsonl"), environment=ENVIRONMENT)
    # a reward on the last message's length differs within almost every group, so every step moves the adapter
    entry["rewards"] = {**entry["rewards"], "length_penalty": 1.0}
    entry["reward_kwargs"] = {**entry.get("reward_kwargs", {}),
                              "length_penalty": {"target_chars": 16, "max_chars": 160}}
    registry = os.path.join(str(folder), "registry.json")
    with open(registry, "w") as fh:
        json.dump({"arith_checked": entry}, fh)
    return registry, module


def train_args(folder, out, strategy: str, steps: int = 3) -> list[str]:
    """train_grpo.py's arguments: `steps` steps of `strategy` on the colocated vLLM engine, its log-probs checked at
    every step."""
    registry, module = write_episode_dataset(folder)
    return ["--model_name_or_path", "smollm2-135m-instruct", "--dataset_config_path", registry,
            "--dataset_names", "arith_checked", "--tool_module", module, "--tuning_strategy", strategy,
            "--rollout_engine", "vllm", "--vllm_enforce_eager", "true", "--max_turns", str(MAX_TURNS),
            "--per_device_train_batch_size", "16", "--k_samples", "8", "--rollout_max_new_tokens", "128",
            "--max_prompt_length", "128", "--max_seq_length", "640", "--learning_rate", "3e-4",
            "--logprob_check_steps", "1", "--max_steps", str(steps), "--save_steps", "0", "--eval_on_start", "false",
            "--eval_max_prompts", "8", "--seed", "0", "--output_dir", str(out), "--overwrite_output_dir"]


@pytest.mark.parametrize("strategy, port", [("lora", 29581), ("qlora", 29583)], ids=["lora", "qlora"])
def test_engine_logprobs_of_multi_turn_episodes_match_the_trainer(strategy, port, tmp_path):
    out = tmp_path / "out"
    cmd = [*deepspeed_launcher(), *gpu_flags(1), "--master_port", str(port), "train_grpo.py",
           *train_args(tmp_path / "data", out, strategy)]
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    rows = train_rows(out)
    keys = ("step", "episodes/turns", "episodes/max_turns", "rollout/logprob_diff_mean", "rollout/logprob_diff_max",
            "grad_norm")
    print(json.dumps([{k: round(r[k], 4) for k in keys if k in r} for r in rows]))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        # the episodes were multi-turn, the environment's tokens between the turns (a turn that SmolLM2 does not end
        # within 128 tokens ends its episode: on the HF engine in fp32, 32 episodes of the untrained model had 2.44
        # turns on average and 0.59 of them reached MAX_TURNS)
        assert row["episodes/turns"] >= 1.8 and row["episodes/max_turns"] >= 0.25, row
        # every step's engine (steps 2 and 3: synced after an update) scores the sampled tokens like the trainer
        assert row["rollout/logprob_diff_mean"] < SYNCED_MAX, row
    assert all(r["grad_norm"] > 0 for r in rows), rows  # the adapter moved, so the later syncs carried a new policy
