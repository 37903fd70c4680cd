"""Two nodes emulated on this host, one CPU rank each (gloo), each node its own launcher (`--no_ssh --node_rank 0/1
--master_addr 127.0.0.1`) and its own temp and cache folders: the same run as one node of two ranks; an output folder
a node does not see refused at the start, naming the node; a rank killed on node 1 stops both nodes with one message
naming it, and the run resumes exactly from the last checkpoint."""
import json
import os
import shutil
import subprocess

import pytest

from grpo.runtime import distributed as dist_utils
from grpo.runtime.shared_output import shared_output_message

from .emulated_nodes import node_run_inputs, prompts_per_rank, run_nodes, side_by_side, step_figures
from .test_multiprocess import launch_command
from .trainer_setup import ROOT, child_env, deepspeed_launcher

needs_launcher = pytest.mark.skipif(shutil.which("deepspeed") is None, reason="the deepspeed launcher is not on PATH")
STEPS = ["--max_steps", "2", "--save_steps", "1", "--eval_on_start", "false", "--tuning_strategy", "lora",
         "--seed", "3", "--ddp_timeout_minutes", "5"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # runs compared number for number: the same CPU threads per rank in each


def test_node_rank_comes_from_the_launcher(monkeypatch):
    for name in ("CROSS_RANK", "GROUP_RANK", "NODE_RANK", "CROSS_SIZE", "NNODES", "LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert (dist_utils.node_rank(), dist_utils.node_count()) == (0, 1)
    monkeypatch.setenv("CROSS_RANK", "1")   # DeepSpeed's launcher
    monkeypatch.setenv("CROSS_SIZE", "2")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert (dist_utils.node_rank(), dist_utils.node_count(), dist_utils.local_world_size()) == (1, 2, 4)
    monkeypatch.delenv("CROSS_RANK")
    monkeypatch.setenv("GROUP_RANK", "3")   # torchrun
    assert dist_utils.node_rank() == 3
    assert dist_utils.node_label(1, "gpu-b") == "node 1, host gpu-b"
    from grpo.runtime import cpu_threads

    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 16)
    assert cpu_threads.threads_per_rank() == 4  # the cores of this node, shared by its ranks (DeepSpeed's LOCAL_SIZE)


def test_a_tensor_parallel_group_across_nodes_is_refused(monkeypatch):
    from types import SimpleNamespace

    from grpo.errors import ConfigError
    from grpo.runtime.roles import check_node_layout

    monkeypatch.setenv("CROSS_SIZE", "2")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    colocate = SimpleNamespace(uses_vllm=True, vllm_tp=2, rollout_mode="colocate", rollout_gpus=0)
    check_node_layout(colocate)  # ranks 0-1 and 2-3: one group per node
    with pytest.raises(ConfigError, match="--vllm_tp 4: with 2 rank\\(s\\) per node, a tensor-parallel group would "
                                          "span two nodes"):
        check_node_layout(SimpleNamespace(**{**vars(colocate), "vllm_tp": 4}))
    monkeypatch.setenv("LOCAL_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "8")  # server mode, 3 rollout ranks: they start at rank 5, mid-pair
    with pytest.raises(ConfigError, match="rollout ranks starting at job rank 5"):
        check_node_layout(SimpleNamespace(uses_vllm=True, vllm_tp=2, rollout_mode="server", rollout_gpus=3))
    check_node_layout(SimpleNamespace(uses_vllm=True, vllm_tp=2, rollout_mode="server", rollout_gpus=4))


def test_the_shared_folder_error_names_the_nodes_that_do_not_see_it():
    views = [(True, 0, 0, "gpu-a"), (True, 1, 0, "gpu-a"), (False, 2, 1, "gpu-b"), (False, 3, 1, "gpu-b")]
    message = shared_output_message("/scratch/run", views)
    assert message.startswith("--output_dir /scratch/run is not shared: node 1, host gpu-b (ranks 2, 3) does not "
                              "see the file rank 0 (node 0, host gpu-a) wrote there")
    assert "shared file system" in message


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return node_run_inputs(tmp_path_factory.mktemp("nodes"))


def script_args(setup, out) -> list[str]:
    """train_grpo.py's arguments of these runs (launch_command's, without its launcher part)."""
    folder, model, registry = setup
    cmd = launch_command(model, registry, out, 0, "--reward_module", str(folder / "rewards.py"), *STEPS)
    return cmd[cmd.index(os.path.join(ROOT, "train_grpo.py")) + 1:]


@pytest.fixture(scope="module")
def two_nodes(setup):
    """The run on 2 emulated nodes x 1 rank; its output folder."""
    out = setup[0] / "two_nodes"
    runs = run_nodes(str(setup[0] / "two_nodes_launch"), [[0], [0]], 29531, script_args(setup, out), **ONE_THREAD)
    for run in runs:
        assert run.returncode == 0, f"node {run.node}:\n{run.output[-4000:]}"
    assert "2 rank(s)" in runs[0].output
    return out


@needs_launcher
def test_two_nodes_train_as_one_node_of_two_ranks(setup, two_nodes):
    folder, _, _ = setup
    one = folder / "one_node"
    cmd = [*deepspeed_launcher(), "--num_gpus", "2", "--master_port", "29533", os.path.join(ROOT, "train_grpo.py"),
           *script_args(setup, one)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env(**ONE_THREAD), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one_node, two = step_figures(one), step_figures(two_nodes)
    print(side_by_side(one_node, two))
    assert [r["step"] for r in two] == [1, 2]
    assert prompts_per_rank(two_nodes, 2) == prompts_per_rank(one, 2)  # the same prompts on each global rank
    for a, b in zip(one_node, two):  # gloo on one host either way: the same numbers
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a, b)
    assert os.path.isfile(two_nodes / "checkpoint-2" / "rng_rank1.pt")  # node 1's rank wrote into the shared folder


@needs_launcher
def test_an_output_folder_a_node_does_not_see_is_refused(setup):
    folder, _, _ = setup
    out = folder / "node0_only"
    runs = run_nodes(str(folder / "unshared_launch"), [[0], [0]], 29535, script_args(setup, out),
                     per_node_args={1: ["--output_dir", str(folder / "node1_local")]}, timeout=300)
    for run in runs:
        assert run.returncode != 0
        assert "is not shared: node 1, host" in run.output, run.output[-3000:]
    assert not os.path.isdir(out / "checkpoint-1")


@needs_launcher
def test_a_rank_killed_on_node_1_stops_both_nodes_and_the_run_resumes_exactly(setup, two_nodes):
    folder, _, _ = setup
    out = folder / "killed"
    runs = run_nodes(str(folder / "killed_launch"), [[0], [0]], 29537, script_args(setup, out), timeout=300,
                     GRPO_TEST_KILL_RANK="1", **ONE_THREAD)
    assert all(run.returncode != 0 for run in runs)
    # node 0's rank saw its collective break and named node 1's rank: killed at step 2, in its rewards
    assert "rank 1 (node 1, host " in runs[0].output and "stopped without reporting an error at step 2 (rewards)" \
        in runs[0].output, runs[0].output[-4000:]
    assert abs(runs[0].ended - runs[1].ended) < 60
    record = json.loads((out / "failures" / "rank1.json").read_text())
    assert (record["rank"], record["node"], record["step"], record["phase"]) == (1, 1, 2, "rewards")
    assert os.path.isdir(out / "checkpoint-1") and not os.path.isdir(out / "checkpoint-2")

    resumed = run_nodes(str(folder / "resumed_launch"), [[0], [0]], 29539,
                        [*script_args(setup, out), "--resume_from_checkpoint", "latest"], timeout=300, **ONE_THREAD)
    for run in resumed:
        assert run.returncode == 0, f"node {run.node}:\n{run.output[-4000:]}"
    straight, again = step_figures(two_nodes), step_figures(out)
    assert again[-1]["step"] == 2  # the step the kill cut short, trained again from checkpoint-1
    for key in straight[1]:
        assert again[-1][key] == pytest.approx(straight[1][key], rel=1e-5, abs=1e-6), (key, straight[1], again[-1])
