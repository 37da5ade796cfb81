"""The pipeline step runner: fp16 loss scaling across stages, and how stage time is measured.

fp16 standard: after the Trainer's ``unscale_``, a 2-stage pipeline's gradients are
those of one process with the same fp16 autocast within 2e-3 relative (per parameter,
by norm; fp16 rounding differs with the micro-batch split), its global gradient norm
within 5e-4 and its loss within 1e-5. Without the loss scale in the schedule the
gradients come out 2^16 times too small.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import meshyard
from meshyard.train import pipeline_step
from meshyard.train.pipeline_step import StageClock
from tests.conftest import tiny_config
from tests.ranks import run_on_ranks
from tests.train import pipeline_scenarios

GRAD_REL_TOL = 2e-3
NORM_REL_TOL = 5e-4
LOSS_REL_TOL = 1e-5


@pytest.fixture(scope="module")
def single_fp16() -> dict:
    return pipeline_scenarios.single_fp16_grads()


def test_fp16_pipeline_gradients_match_one_process(single_fp16):
    stage0, stage1 = run_on_ranks(pipeline_scenarios.pipelined_fp16_grads, "1f1b", world_size=2)
    grads = {**stage0["grads"], **stage1["grads"]}
    assert grads.keys() == single_fp16["grads"].keys()
    for name, expected in single_fp16["grads"].items():
        rel = ((grads[name] - expected).norm() / expected.norm()).item()
        assert rel <= GRAD_REL_TOL, f"{name}: relative difference {rel:.2e}"
    for stage in (stage0, stage1):
        # The norm the Trainer clips by is that of the unscaled gradients, on every stage,
        # and no stage saw an overflow (the scale stayed where it started).
        assert stage["norm"] == pytest.approx(single_fp16["norm"], rel=NORM_REL_TOL)
        assert stage["scale"] == 2.0 ** 16
    assert stage1["loss"] == pytest.approx(single_fp16["loss"], rel=LOSS_REL_TOL)  # the last stage holds it


def test_overflow_on_one_stage_skips_the_step_on_every_stage():
    """An inf gradient on the first stage (which has no loss) must not let the last
    stage step alone: both keep their parameters and halve the scale."""
    for stage in run_on_ranks(pipeline_scenarios.pipelined_fp16_overflow, 0, world_size=2):
        assert not stage["moved"]
        assert stage["scale"] == 2.0 ** 15


def test_fp16_pipelined_run_matches_one_process(tmp_path):
    """Through the whole worker (pp stages replicated by FSDP, which casts to fp16):
    per-step loss, gradient norm and loss scale of pp = 2 against one process."""
    common = ("--precision.dtype=fp16", "--train.steps=3")
    single = meshyard.run(tiny_config(tmp_path / "one", *common, "--parallel.strategy=none"), nproc=1).metrics()
    piped = meshyard.run(tiny_config(tmp_path / "pp", *common, "--parallel.strategy=ddp", "--parallel.pp=2"),
                         nproc=2).metrics()
    assert len(piped) == len(single) == 3
    for got, want in zip(piped, single):
        assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_REL_TOL), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=NORM_REL_TOL), got["step"]
        assert got["loss_scale"] == want["loss_scale"] == 2.0 ** 16


class _Stage:
    """Stands in for a PipelineStage: each chunk advances a simulated GPU clock."""

    def __init__(self, gpu_time: list[float], chunk_s: float) -> None:
        self.gpu_time, self.chunk_s = gpu_time, chunk_s

    def forward_one_chunk(self) -> None:
        self.gpu_time[0] += self.chunk_s

    backward_one_chunk = backward_weight_one_chunk = forward_one_chunk


def _fake_cuda_event(gpu_time: list[float], synchronized: list[object]) -> type:
    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at: float | None = None

        def record(self) -> None:
            self.at = gpu_time[0]

        def synchronize(self) -> None:
            synchronized.append(self)

        def elapsed_time(self, end: "Event") -> float:
            assert end in synchronized, "elapsed_time read before the end event completed"
            return (end.at - self.at) * 1000.0  # milliseconds, like CUDA's

    return Event


def test_stage_clock_uses_cuda_events_on_gpu(monkeypatch):
    gpu_time, synchronized = [0.0], []
    monkeypatch.setattr(torch.cuda, "Event", _fake_cuda_event(gpu_time, synchronized))
    # Host time says nothing about GPU work: the clock must not read it.
    monkeypatch.setattr(pipeline_step, "time", SimpleNamespace(perf_counter=lambda: pytest.fail("perf_counter")))
    clock = StageClock.for_device(torch.device("cuda", 0))
    stage = _Stage(gpu_time, 0.25)
    clock.wrap(stage)
    start = clock.now()
    stage.forward_one_chunk()
    stage.backward_one_chunk()
    gpu_time[0] += 0.5  # waiting for a neighbour: wall time, not compute
    end = clock.now()
    seconds, pending = clock.take()
    assert seconds == 0.0 and len(pending) == 2 and not synchronized  # taken without waiting for the GPU
    assert sum(clock.elapsed(begin, finish) for begin, finish in pending) == pytest.approx(0.5)
    assert clock.elapsed(start, end) == pytest.approx(1.0)
    assert clock.take() == (0.0, [])


def test_stage_clock_uses_wall_time_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: pytest.fail("CUDA event on CPU"))
    clock = StageClock.for_device(torch.device("cpu"))
    stage = SimpleNamespace(forward_one_chunk=lambda: time.sleep(0.05), backward_one_chunk=lambda: None,
                            backward_weight_one_chunk=lambda: None)
    clock.wrap(stage)
    start = clock.now()
    stage.forward_one_chunk()
    seconds, pending = clock.take()
    assert 0.05 <= seconds < 1.0 and pending == []
    assert clock.elapsed(start, clock.now()) >= seconds
