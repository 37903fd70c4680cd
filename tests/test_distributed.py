"""The process group's end: the command ends it on every rank together once training is done."""
import subprocess
import sys

from .trainer_setup import ROOT, child_env


# its own process: DeepSpeed keeps the groups it saw, so a test process that ended its group could not start another
SCRIPT = """
import torch.distributed as dist
from grpo.runtime import distributed
distributed.init_distributed()
assert dist.is_initialized() and distributed.all_sum([1.5]) == [1.5]
distributed.shutdown()
assert not dist.is_initialized()
distributed.shutdown()  # nothing left to end: harmless
print("ended")
"""


def test_shutdown_ends_the_process_group():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=child_env())
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ended"), proc.stderr[-3000:]
