"""The process group's end: the command ends it on every rank together once training is done."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# its own process: DeepSpeed keeps the groups it saw, so a test process that ended its group could not start another
SCRIPT = """
import torch.distributed as dist
from grpo import distributed
distributed.init_distributed()
assert dist.is_initialized() and distributed.all_sum([1.5]) == [1.5]
distributed.shutdown()
assert not dist.is_initialized()
distributed.shutdown()  # nothing left to end: harmless
print("ended")
"""


def test_shutdown_ends_the_process_group():
    # a process group started earlier in this test session must not leak its port into the child
    launcher_vars = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**env, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ended"), proc.stderr[-3000:]
