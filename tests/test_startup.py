"""A run's start: bad input fails before the heavy libraries load, data maps need no pickled closures, CPU threads
fit the cores a process may use and wait without spinning."""
import json
import logging
import os
import subprocess
import sys

import pytest

from .tiny_models import make_tiny_tokenizer
from .trainer_setup import ROOT, child_env, one_dataset_registry, write_prompt_registry

# runs train_grpo.main in a fresh interpreter, then reports its exit code and which heavy libraries it imported
# (the flags are parsed by transformers' HfArgumentParser, whose package loads its parts lazily: not counted)
PROBE = """
import json, sys
import train_grpo
code = train_grpo.main(sys.argv[1:])
heavy = [m for m in ("torch", "transformers.modeling_utils", "deepspeed", "datasets") if m in sys.modules]
print(json.dumps({"code": code, "imported": heavy}))
"""


def run_main(*args, env=None):
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(**(env or {})), timeout=300)
    assert proc.stdout.strip(), proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_unknown_dataset_fails_before_datasets_torch_or_deepspeed_load(tmp_path):
    result, stderr = run_main("--dataset_names", "no_such_set", "--output_dir", str(tmp_path / "o"))
    assert result == {"code": 1, "imported": []}
    assert "unknown dataset 'no_such_set'" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "o").exists()  # refused before the run's folder was made


def test_use_wandb_without_wandb_runs_without_it_and_says_so(tmp_path, monkeypatch):
    import importlib.util

    from grpo.config import GRPOConfig
    from grpo.train.setup import check_run_can_start

    find_spec = importlib.util.find_spec  # wandb missing, also where it is installed (CI installs the trackers)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    config = GRPOConfig(use_wandb=True, output_dir=str(tmp_path / "o"))
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("grpo").addHandler(handler)
    try:
        check_run_can_start(config)
    finally:
        logging.getLogger("grpo").removeHandler(handler)
    assert config.use_wandb is False
    assert any("wandb is not installed" in m and "pip install .[wandb]" in m for m in warned), warned


def test_unknown_reward_fails_before_any_data_file_is_read(tmp_path):
    registry = one_dataset_registry(tmp_path / "registry.json", "missing.jsonl", {"no_such_reward": 1.0})
    result, stderr = run_main("--dataset_config_path", registry, "--dataset_names", "mine",
                              "--output_dir", str(tmp_path / "o"))
    assert result == {"code": 1, "imported": []}
    assert "no_such_reward" in stderr and "missing.jsonl" not in stderr


def test_missing_data_file_fails_before_torch_or_deepspeed_load(tmp_path):
    registry = one_dataset_registry(tmp_path / "registry.json", "missing.jsonl", {"boxed_accuracy": 1.0})
    result, stderr = run_main("--dataset_config_path", registry, "--dataset_names", "mine",
                              "--output_dir", str(tmp_path / "o"))
    assert result["code"] == 1 and "missing.jsonl" in stderr
    assert result["imported"] == ["datasets"]  # the data files' reader, nothing heavier


def test_bad_deepspeed_config_fails_before_deepspeed_loads(tmp_path):
    registry = write_prompt_registry(str(tmp_path / "data"))
    result, stderr = run_main("--dataset_config_path", registry, "--dataset_names", "toy",
                              "--deepspeed", str(tmp_path / "nope.json"), "--output_dir", str(tmp_path / "o"))
    assert result["code"] == 1 and "--deepspeed: file not found" in stderr
    assert "deepspeed" not in result["imported"] and "transformers.modeling_utils" not in result["imported"]


def test_single_process_cpu_run_builds_no_communication_op(tmp_path):
    """DeepSpeed's shared-memory all-reduce op serves several CPU ranks; a world of one starts without compiling
    it (a minute or more on a fresh machine)."""
    code = ("from grpo.runtime import distributed as d; d.init_distributed(); "
            "import deepspeed.comm.comm as c, torch; print(c.cdb.shm_comm_op is None, torch.get_num_threads())")
    extensions = tmp_path / "extensions"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=child_env(TORCH_EXTENSIONS_DIR=str(extensions), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "1"]  # no op, and the user's OMP_NUM_THREADS kept
    assert not extensions.exists() or not any(extensions.iterdir())
    assert "Setting accelerator to CPU" not in proc.stderr  # told, not guessed


def test_several_cpu_ranks_say_once_that_the_communication_op_builds(tmp_path, monkeypatch, caplog):
    from grpo.runtime.distributed import _prepare_cpu_comm_op

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    # a one-process run earlier in this process marked the op unusable (it needs none): not so for several ranks
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, builder.NAME, True)
    logger = logging.getLogger("grpo")  # it may not propagate to the root logger, where caplog listens
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="grpo"):
            _prepare_cpu_comm_op(2)
    finally:
        logger.removeHandler(caplog.handler)
    # one record, whether it reached caplog's handler directly or also through the root logger
    lines = list({id(r): r.getMessage() for r in caplog.records if "communication op" in r.getMessage()}.values())
    assert lines == [f"building DeepSpeed's CPU communication op once (about a minute), cached in "
                     f"{tmp_path / 'deepspeed_shm_comm'}"]


def test_data_maps_are_fingerprinted_without_hashing_their_functions(tmp_path, monkeypatch):
    """`datasets` hashes a mapped function by pickling it unless the map is given its fingerprint; for some
    closures that fails and warns "couldn't be hashed properly" at every start."""
    import datasets.fingerprint

    from grpo.data import load_prompt_datasets, render_prompts

    hashed = []
    real = datasets.fingerprint.update_fingerprint

    def recording(fingerprint, transform, transform_args):
        if "function" in transform_args:
            hashed.append(transform_args["function"])
        return real(fingerprint, transform, transform_args)

    monkeypatch.setattr(datasets.fingerprint, "update_fingerprint", recording)
    registry = write_prompt_registry(str(tmp_path / "data"))
    train, _ = load_prompt_datasets(registry, ["toy"], 1.0, seed=0)
    rendered = render_prompts(train, make_tiny_tokenizer(), max_prompt_length=64)
    assert hashed == []
    assert len(rendered) == 40 and rendered[0]["prompt_ids"]
    again, _ = load_prompt_datasets(registry, ["toy"], 1.0, seed=0)
    assert again._fingerprint == train._fingerprint  # the same input and entry: the same fingerprint


def test_cgroup_cpu_quota(tmp_path):
    from grpo.runtime.cpu_threads import cgroup_cpu_quota

    assert cgroup_cpu_quota(str(tmp_path)) is None  # no cgroup files: no limit
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None


def test_threads_are_shared_among_the_ranks_of_a_host(monkeypatch):
    from grpo.runtime import cpu_threads

    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cpu_threads.threads_per_rank() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu_threads.threads_per_rank() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert cpu_threads.threads_per_rank() == 1


def test_available_cores_are_this_process_cpus():
    from grpo.runtime.cpu_threads import available_cores

    assert 1 <= available_cores() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_openmp_waits_passively_unless_told_otherwise(given):
    env = child_env()
    env.pop("OMP_WAIT_POLICY", None)
    if given:
        env["OMP_WAIT_POLICY"] = given
    proc = subprocess.run([sys.executable, "-c", "import os, grpo; print(os.environ['OMP_WAIT_POLICY'])"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.stdout.strip() == (given or "PASSIVE"), proc.stderr
