"""On a 4-GPU host, two nodes emulated by two DeepSpeed launchers (`--no_ssh --node_rank 0/1 --master_addr
127.0.0.1`, node 0 on GPUs 0-1, node 1 on GPUs 2-3, each node its own temp and cache folders):

  - colocate: 2 nodes x 2 GPUs trains as 1 node x 4 GPUs (same seed: the same prompts per rank, the same rewards and
    losses per step, NCCL across the "nodes");
  - server mode: the rollout ranks on node 1 reach training rank 0's store at MASTER_ADDR; again as 1 x 4;
  - a rank killed on node 1 mid-step stops both nodes within seconds with one message naming its node, rank and
    phase; the last checkpoint is intact and the resumed run repeats the uninterrupted one.

Tiny random model and the HF engine: a few minutes in all. The per-step figures are printed side by side (-s).
With GRPO_MULTINODE_VLLM=1 also server mode with vLLM rollout ranks on the embedded SmolLM2 (a few minutes more).
"""
import json
import os
import subprocess
import time

import pytest
import torch

from tests.emulated_nodes import node_run_inputs, prompts_per_rank, run_nodes, side_by_side, step_figures
from tests.trainer_setup import ROOT, deepspeed_launcher, gpu_flags, launcher_env

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4,
                                reason="needs 4 GPUs")
# node 0 on the first two GPUs this job may use, node 1 on the next two (the launcher sets each node's
# CUDA_VISIBLE_DEVICES from them; gpu_flags(4) gives the 1-node runs the same four)
_VISIBLE = [int(d) for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip().isdigit()] or [0, 1, 2, 3]
NODES = [_VISIBLE[:2], _VISIBLE[2:4]]
# bf16 on the same 4 GPUs either way, NCCL within one host either way: the same numbers up to the order NCCL sums in
# (a last-bit difference in the weights may flip a rare sampled token of the next step: a reward a 1/16 apart)
REL, ABS = 1e-2, 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return node_run_inputs(tmp_path_factory.mktemp("gpu_nodes"))


def script_args(setup, out, *flags) -> list[str]:
    folder, model, registry = setup
    return ["--model_name_or_path", model, "--dataset_config_path", registry, "--dataset_names", "toy",
            "--reward_module", str(folder / "rewards.py"), "--output_dir", str(out), "--tuning_strategy", "lora",
            "--rollout_engine", "hf", "--per_device_train_batch_size", "2", "--k_samples", "4",
            "--rollout_max_new_tokens", "16", "--max_prompt_length", "32", "--max_seq_length", "48",
            "--learning_rate", "1e-2", "--max_steps", "3", "--save_steps", "1", "--eval_on_start", "false",
            "--eval_max_prompts", "4", "--seed", "0", "--ddp_timeout_minutes", "5", *flags]


def one_node(out, port, args) -> None:
    cmd = [*deepspeed_launcher(), *gpu_flags(4), "--master_port", str(port), os.path.join(ROOT, "train_grpo.py"),
           *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), capture_output=True,
                          text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]


def two_nodes(folder, port, args, **env) -> list:
    return run_nodes(str(folder), NODES, port, args, timeout=420, VLLM_ENABLE_V1_MULTIPROCESSING="0", **env)


def assert_same_run(one, two, training_ranks: int, label: str) -> None:
    a, b = step_figures(one), step_figures(two)
    print(f"\n{label}: per-step figures, 1 node x 4 GPUs vs 2 nodes x 2 GPUs\n" +
          side_by_side(a, b, names=("1x4", "2x2")))
    assert [r["step"] for r in b] == [r["step"] for r in a] and len(a) >= 2
    assert prompts_per_rank(two, training_ranks) == prompts_per_rank(one, training_ranks)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=REL, abs=ABS), (label, key, ra, rb)


@pytest.fixture(scope="module")
def colocate_two_nodes(setup):
    out = setup[0] / "colocate_2x2"
    runs = two_nodes(setup[0] / "colocate_2x2_launch", 29641, script_args(setup, out))
    for run in runs:
        assert run.returncode == 0, f"node {run.node}:\n{run.output[-6000:]}"
    return out


def test_colocate_two_nodes_train_as_one_node(setup, colocate_two_nodes):
    one = setup[0] / "colocate_1x4"
    one_node(one, 29643, script_args(setup, one))
    assert_same_run(one, colocate_two_nodes, 4, "colocate")


def test_server_mode_with_rollout_ranks_on_node_1(setup):
    flags = ("--rollout_mode", "server", "--rollout_gpus", "2")
    one, two = setup[0] / "server_1x4", setup[0] / "server_2x2"
    one_node(one, 29645, script_args(setup, one, *flags))
    runs = two_nodes(setup[0] / "server_2x2_launch", 29647, script_args(setup, two, *flags))
    for run in runs:
        assert run.returncode == 0, f"node {run.node}:\n{run.output[-6000:]}"
    assert_same_run(one, two, 2, "server (rollout ranks on node 1)")


def test_a_rank_killed_on_node_1_stops_every_node_and_resume_is_exact(setup, colocate_two_nodes):
    out = setup[0] / "killed_2x2"
    started = time.time()
    runs = two_nodes(setup[0] / "killed_launch", 29649, script_args(setup, out), GRPO_TEST_KILL_RANK="3")
    assert all(run.returncode != 0 for run in runs), [r.returncode for r in runs]
    record = json.loads((out / "failures" / "rank3.json").read_text())
    print({"killed": record["message"], "node_exits_after_kill_s": [round(r.ended - record["time"], 1) for r in runs],
           "run_s": round(time.time() - started, 1)})
    assert (record["rank"], record["node"], record["step"], record["phase"]) == (3, 1, 2, "rewards")
    # node 0's ranks were waiting in NCCL for node 1's: their watch stopped them, naming the rank, node and phase
    expected = "rank 3 (node 1, host "
    assert expected in runs[0].output and "died without reporting an error at step 2 (rewards)" in runs[0].output, \
        runs[0].output[-6000:]
    assert all(r.ended - record["time"] < 60 for r in runs)  # not the 5 minutes of --ddp_timeout_minutes
    assert os.path.isdir(out / "checkpoint-1") and not os.path.isdir(out / "checkpoint-2")

    resumed = two_nodes(setup[0] / "resumed_launch", 29651,
                        script_args(setup, out, "--resume_from_checkpoint", "latest"))
    for run in resumed:
        assert run.returncode == 0, f"node {run.node}:\n{run.output[-6000:]}"
    straight, again = step_figures(colocate_two_nodes), step_figures(out)
    again = {r["step"]: r for r in again}  # the resume's rows of steps 2 and 3 come last
    print("\nresumed vs uninterrupted\n" + side_by_side(straight[1:], [again[2], again[3]],
                                                         names=("straight", "resumed")))
    for row in straight[1:]:
        for key in row:
            assert again[row["step"]][key] == pytest.approx(row[key], rel=REL, abs=ABS), (key, row, again)


@pytest.mark.skipif(os.environ.get("GRPO_MULTINODE_VLLM") != "1", reason="GRPO_MULTINODE_VLLM=1 runs it")
def test_server_mode_with_vllm_rollout_ranks_on_node_1(tmp_path):
    args = ["--model_name_or_path", "smollm2-135m-instruct", "--dataset_names", "arith", "--tuning_strategy", "lora",
            "--rollout_engine", "vllm", "--rollout_mode", "server", "--rollout_gpus", "2",
            "--per_device_train_batch_size", "8", "--k_samples", "4", "--rollout_max_new_tokens", "32",
            "--max_prompt_length", "128", "--max_seq_length", "192", "--max_steps", "2", "--save_steps", "0",
            "--eval_on_start", "false", "--eval_max_prompts", "8", "--seed", "0", "--vllm_enforce_eager", "true",
            "--vllm_gpu_memory_utilization", "0.3"]
    one, two = tmp_path / "vllm_1x4", tmp_path / "vllm_2x2"
    one_node(one, 29653, [*args, "--output_dir", str(one)])
    runs = two_nodes(tmp_path / "vllm_launch", 29655, [*args, "--output_dir", str(two)])
    for run in runs:
        assert run.returncode == 0, f"node {run.node}:\n{run.output[-6000:]}"
    assert_same_run(one, two, 2, "server, vLLM rollout ranks on node 1")
