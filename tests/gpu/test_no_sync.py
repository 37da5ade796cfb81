"""A steady training step on a GPU never makes the host wait for the device.

The steps after the first few run under ``torch.cuda.set_sync_debug_mode("error")``,
which turns any synchronising call (``.item()``, ``.tolist()`` of a CUDA tensor, a
blocking copy, a stream synchronisation) into an error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshyard.metrics.records import read_metrics
from meshyard.runtime.distributed import Runtime
from meshyard.train.build import build_trainer

pytestmark = pytest.mark.gpu

WARM_STEPS = 3  # the first steps start CUDA libraries and pick kernels


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_steady_steps_do_not_synchronise(make_config, tmp_path, dtype):
    cfg = make_config("--run.device=cuda", "--train.steps=10", "--train.compile=false", f"--precision.dtype={dtype}",
                      "--metrics.gather_every=0", "--metrics.log_every=1000")
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    trainer = build_trainer(cfg, Runtime(0, 1, 0, device, "nccl"), run_dir, "none").trainer
    assert trainer.read_ahead
    issue = trainer.issue_step

    def issue_strictly(step):
        torch.cuda.set_sync_debug_mode("error" if step > WARM_STEPS else "default")
        return issue(step)

    trainer.issue_step = issue_strictly
    try:
        trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer.close()
    records = read_metrics(run_dir)
    assert [record["step"] for record in records] == list(range(1, 11))
    assert all(torch.isfinite(torch.tensor(record["loss"])) for record in records)
