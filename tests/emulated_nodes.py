"""Two (or more) nodes emulated on one host: one DeepSpeed launcher per node, started as Slurm would start them
(`--no_ssh --node_rank N --master_addr 127.0.0.1` and a hostfile naming every node), each with its own temp, model
cache and Hugging Face folders. Used by tests/test_multinode.py (CPU ranks, gloo), tests/gpu/test_multinode.py and
scripts/emulate_two_nodes.sh (GPUs, NCCL)."""
import json
import os
import subprocess
import time
from dataclasses import dataclass

from .trainer_setup import ROOT, deepspeed_launcher, launcher_env, read_metrics

# the runs' reward: the share of even token ids differs between samples, so a random model gets advantages and its
# weights move; GRPO_TEST_KILL_RANK=<R> kills rank R in its second reward call (step 2), as the OOM killer would
REWARD_MODULE = '''
import os
from grpo import register_reward

calls = 0

@register_reward("even_tokens")
def even_tokens(completions, answers, completion_ids=None, **row):
    """The share of even token ids: it differs between samples, so a random model gets advantages and moves."""
    global calls
    calls += 1
    if os.environ.get("GRPO_TEST_KILL_RANK") == os.environ["RANK"] and calls == 2:
        os.kill(os.getpid(), 9)  # as the OOM killer would, in step 2's rewards
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


@dataclass
class NodeRun:
    """What one launcher (one node) did."""
    node: int
    returncode: int
    output: str        # its stdout and stderr (the launcher's and its ranks')
    ended: float       # time.time() when it ended


def node_run_inputs(folder) -> tuple:
    """(folder, tiny model folder, prompt registry) for the node tests, with the even_tokens reward module beside."""
    from .tiny_models import make_tiny_model_dir
    from .trainer_setup import write_prompt_registry

    model = make_tiny_model_dir(str(folder / "model"))
    registry = write_prompt_registry(str(folder / "data"), reward="even_tokens")
    (folder / "rewards.py").write_text(REWARD_MODULE)
    return folder, model, registry


def write_hostfile(folder: str, nodes: int, slots: int) -> str:
    path = os.path.join(folder, "hostfile")
    with open(path, "w") as fh:
        fh.writelines(f"node{n} slots={slots}\n" for n in range(nodes))
    return path


def node_env(folder: str, node: int, **extra) -> dict:
    """The environment of one node's launcher: its own TMPDIR, model cache and HF cache, as separate machines have
    (the CPU communication op's build cache stays shared: building it again costs a minute and proves nothing)."""
    own = {name: os.path.join(folder, f"node{node}", sub) for name, sub in
           (("TMPDIR", "tmp"), ("GRPO_CACHE_DIR", "grpo_cache"), ("HF_HOME", "hf"), ("TRITON_CACHE_DIR", "triton"))}
    for path in own.values():
        os.makedirs(path, exist_ok=True)
    return launcher_env(**own, **extra)


def node_launcher(hostfile: str, node: int, devices_per_node: list[list[int]], port: int) -> list[str]:
    """`deepspeed --hostfile H --no_ssh --node_rank N --master_addr 127.0.0.1 ...` for `node`, whose ranks use
    `devices_per_node[node]` (the launcher sets each node's CUDA_VISIBLE_DEVICES from them)."""
    if all(d == list(range(len(devices_per_node[0]))) for d in devices_per_node):  # the plain recipe
        where = ["--num_nodes", str(len(devices_per_node)), "--num_gpus", str(len(devices_per_node[0]))]
    else:  # other GPUs per node: the emulation gives each node its own devices
        where = ["--include", "@".join(f"node{n}:{','.join(map(str, d))}" for n, d in enumerate(devices_per_node))]
    return [*deepspeed_launcher(), "--hostfile", hostfile, *where, "--no_ssh", "--node_rank", str(node),
            "--master_addr", "127.0.0.1", "--master_port", str(port)]


def run_nodes(folder: str, devices_per_node: list[list[int]], port: int, script_args: list[str],
              per_node_args: dict | None = None, timeout: float = 600, **env) -> list[NodeRun]:
    """Start every node's launcher of `train_grpo.py script_args` at once and wait for all of them. `per_node_args`:
    {node: extra arguments} (a node told another --output_dir, say)."""
    os.makedirs(folder, exist_ok=True)
    hostfile = write_hostfile(folder, len(devices_per_node), max(max(d) + 1 for d in devices_per_node))
    procs, logs = [], []
    for node in range(len(devices_per_node)):
        cmd = [*node_launcher(hostfile, node, devices_per_node, port), os.path.join(ROOT, "train_grpo.py"),
               *script_args, *(per_node_args or {}).get(node, [])]
        log = open(os.path.join(folder, f"node{node}.log"), "w+")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=node_env(folder, node, **env), stdout=log,
                                      stderr=subprocess.STDOUT, text=True))
        logs.append(log)
    runs: list = [None] * len(procs)
    deadline = time.time() + timeout
    while any(r is None for r in runs):
        for node, proc in enumerate(procs):
            if runs[node] is None and proc.poll() is not None:
                logs[node].seek(0)
                runs[node] = NodeRun(node, proc.returncode, logs[node].read(), time.time())
        if time.time() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            raise TimeoutError(f"the emulated nodes did not end within {timeout} s; logs in {folder}")
        time.sleep(0.5)
    for log in logs:
        log.close()
    return runs


def step_figures(output_dir: str) -> list[dict]:
    """Per training step: its reward and loss figures (what two equal runs must share)."""
    rows = [r for r in read_metrics(os.path.join(str(output_dir), "metrics.jsonl")) if "loss" in r]
    return [{k: v for k, v in r.items() if k == "step" or k.startswith(("reward", "loss", "kl", "entropy",
                                                                         "completion_length"))} for r in rows]


def prompts_per_rank(output_dir: str, ranks: int) -> dict:
    """{rank: the dataset indices of the prompts it trained on, step by step} (completions/rank<R>.jsonl)."""
    out = {}
    for rank in range(ranks):
        with open(os.path.join(str(output_dir), "completions", f"rank{rank}.jsonl")) as fh:
            out[rank] = [(row["step"], row["index"]) for row in map(json.loads, fh)]
    return out


def side_by_side(a: list[dict], b: list[dict], names=("1 node", "2 nodes")) -> str:
    """The per-step figures of two runs, one line per step and figure."""
    lines = []
    for ra, rb in zip(a, b):
        for key in sorted(set(ra) - {"step"}):
            lines.append(f"step {ra['step']} {key:<28} {names[0]} {ra[key]:.6g}  {names[1]} {rb.get(key, float('nan')):.6g}")
    return "\n".join(lines)
