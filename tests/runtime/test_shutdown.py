"""A process that trains with a Python comm hook more than once survives each shutdown.

PowerSGD's callbacks hold their process group and run on the group's gloo threads; a
group freed there joins its own thread and the process aborts ("Resource deadlock
avoided"). Before ``shutdown_distributed`` held the groups, this loop aborted within a
few dozen cycles.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CYCLES = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from meshyard.comm import build_compression
from meshyard.config.sections import CommConfig
from meshyard.runtime.distributed import shutdown_distributed
from tests.comm.scenarios import loss_of, tiny_gpt

torch.set_num_threads(1)
for cycle in range(int(sys.argv[1])):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = DistributedDataParallel(tiny_gpt())
    compression = build_compression(CommConfig(compression="powersgd", warmup_steps=2, powersgd_rank=1))
    compression.register(model)
    for step in range(3):
        loss_of(model, step, 0).backward()
    del model, compression
    shutdown_distributed()
    sum(p.numel() for p in tiny_gpt().parameters())  # the main thread goes on working
print("cycles done")
"""


def test_repeated_powersgd_jobs_in_one_process_shut_down_cleanly():
    done = subprocess.run([sys.executable, "-c", CYCLES, "30"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "cycles done" in done.stdout, done.stderr[-2000:]
