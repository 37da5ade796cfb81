"""The spike and NaN guard in training: a poisoned window of samples is dropped, rolled
back over (to a host snapshot, or with guard.snapshot_every = 0 to the newest checkpoint)
and skipped exactly, on one rank and on two (DDP, FSDP, TP and PP); replayed steps are marked; a
NaN step is dropped under read-ahead, and a dropped last step leaves the summary the last
kept loss; past guard.max_rollbacks, or without a checkpoint to return to, the run stops
with one paragraph; a run resumed from any checkpoint (before the poison, what a kill
during the recovery leaves, or saved again after the rollback) skips the same samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshyard.checkpoint.manager import checkpoint_name, read_trainer_state
from meshyard.checkpoint.storage import CheckpointStore
from meshyard.fault.guard import GuardStop
from meshyard.metrics.records import read_metrics
from meshyard.run_dir import RunDir
from meshyard.train.build import build_trainer
from tests.conftest import tiny_config
from tests.fault.poisoned_dataset import poisoned_indices
from tests.inprocess import cpu_runtime, fit_here, fit_in_order, fit_on_ranks

DATA = "tests/fault/poisoned_dataset.py"
RUN = ("--data.seq_len=16", "--train.steps=36", "--train.global_batch=8", "--optim.warmup_steps=2",
       "--optim.lr=3e-3")
GUARD = ("--guard.enabled=true", "--guard.window=8", "--guard.warmup_steps=5", "--guard.snapshot_every=5",
         "--guard.spike_mads=4", "--guard.bad_in_a_row=2")
# The guarded run trains its last 10 steps on samples 2 steps further down the stream
# than the clean run, so the two end close, not equal: mean of the last 3 losses 1.356
# against 1.335 when written (a gap of 0.02; the tolerance is 3 times that).
FINAL_LOSS_TOLERANCE = 0.06
CHECKPOINTS = ("--checkpoint.enabled=true", "--checkpoint.keep_last=30", "--checkpoint.async_save=false")
TO_CHECKPOINTS = (*CHECKPOINTS, "--checkpoint.interval=10", "--guard.snapshot_every=0")


def _guard_records(cfg) -> list[dict]:
    return [json.loads(line) for line in RunDir(cfg.run.run_dir).guard.read_text().splitlines()]


def _final_loss(records: list[dict]) -> float:
    return sum(record["loss"] for record in records[-3:]) / 3


def _check_poisoned_window_skipped(cfg, records) -> None:
    events = _guard_records(cfg)
    assert [(e["event"], e["step"]) for e in events] == [("not kept", 25), ("not kept", 26), ("rollback", 26)]
    assert {e["reason"] for e in events[:2]} == {"loss spike"}
    rollback = events[2]
    assert (rollback["to_step"], rollback["skipped_stream_steps"]) == (20, [24, 25])
    assert rollback["to"] == ("checkpoint" if cfg.guard.snapshot_every == 0 else "snapshot")
    assert rollback["skipped_samples"] == poisoned_indices()
    assert [record.get("guard") for record in records if "guard" in record] == ["loss spike"] * 2
    assert records[-1]["step"] == 36
    # Recorded again after the rollback, and marked: steps 21-26 (25 and 26 on new samples).
    assert [record["step"] for record in records if record.get("replay")] == list(range(21, 27))
    assert len(records) == 36 + 6


def test_a_poisoned_window_is_rolled_back_and_skipped_on_one_rank(tmp_path, one_torch_thread):
    clean = fit_here(tiny_config(tmp_path / "clean", f"--data.source={DATA}:clean", *RUN))
    cfg = tiny_config(tmp_path / "guarded", f"--data.source={DATA}:poisoned", *RUN, *GUARD)
    guarded = fit_here(cfg)
    _check_poisoned_window_skipped(cfg, guarded)
    # The steps replayed after the rollback (21-24) repeat the first pass exactly.
    losses = [record["loss"] for record in guarded]
    assert losses[26:30] == losses[20:24]
    assert abs(_final_loss(guarded) - _final_loss(clean)) < FINAL_LOSS_TOLERANCE
    # With guard.snapshot_every = 0 the rollback loads step 20's checkpoint instead: the same run.
    to_checkpoint = tiny_config(tmp_path / "to_checkpoint", f"--data.source={DATA}:poisoned", *RUN, *GUARD,
                                *TO_CHECKPOINTS)
    loaded = fit_here(to_checkpoint)
    _check_poisoned_window_skipped(to_checkpoint, loaded)
    assert [record["loss"] for record in loaded] == losses


def test_without_a_checkpoint_to_return_to_the_run_stops_with_one_paragraph(tmp_path, one_torch_thread):
    cfg = tiny_config(tmp_path, f"--data.source={DATA}:poisoned", *RUN, *GUARD, *TO_CHECKPOINTS,
                      "--checkpoint.interval=30")
    with pytest.raises(GuardStop) as stop:
        fit_here(cfg)
    message = str(stop.value)
    assert "\n" not in message and "bad steps from step 25 on called for a rollback" in message
    assert "none of step 24 or earlier was committed" in message and "set guard.snapshot_every" in message


LAYOUTS = {"ddp": ("--parallel.strategy=ddp",), "fsdp": ("--parallel.strategy=fsdp",),
           "tp2": ("--parallel.strategy=none", "--parallel.tp=2"),
           "pp2": ("--parallel.strategy=none", "--parallel.pp=2")}


def test_all_ranks_decide_together_under_every_layout(tmp_path):
    configs = [tiny_config(tmp_path / name, f"--data.source={DATA}:poisoned", *RUN, *GUARD, *layout,
                           "--train.micro_batch=4")
               for name, layout in LAYOUTS.items()]
    configs.append(tiny_config(tmp_path / "ddp_to_checkpoint", f"--data.source={DATA}:poisoned", *RUN, *GUARD,
                               *TO_CHECKPOINTS, "--parallel.strategy=ddp", "--train.micro_batch=4"))
    single = fit_here(tiny_config(tmp_path / "single", f"--data.source={DATA}:poisoned", *RUN, *GUARD))
    for cfg, records in zip(configs, fit_on_ranks(configs, world_size=2)):
        _check_poisoned_window_skipped(cfg, records)
        assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in single], rel=1e-4)


def _skipped_stream_steps(checkpoints: Path, step: int) -> list[list[int]]:
    return read_trainer_state(CheckpointStore(str(checkpoints)), checkpoint_name(step))["data"]["skipped_steps"]


def test_resumes_from_any_checkpoint_skip_the_same_samples(tmp_path):
    # Saves every 2 steps: 22 and 24 are saved before the poison and again after the
    # rollback to step 20's snapshot; 26's falls on a bad step and waits for the replay.
    checkpoints = (*CHECKPOINTS, "--checkpoint.interval=2")
    whole = tiny_config(tmp_path / "whole", f"--data.source={DATA}:poisoned", *RUN, *GUARD, *checkpoints)
    resumed = {step: tiny_config(tmp_path / f"from{step}", f"--data.source={DATA}:poisoned", *RUN, *GUARD,
                                 *checkpoints) for step in (20, 24, 26)}
    saved = Path(whole.run.run_dir) / "checkpoints"
    records = fit_in_order([(whole, "none"), *((cfg, str(saved / checkpoint_name(step)))
                                               for step, cfg in resumed.items())], world_size=1)
    whole_losses = {r["step"]: r["loss"] for r in records[0]}  # the last record of each step
    _check_poisoned_window_skipped(whole, records[0])
    assert _skipped_stream_steps(saved, 20) == []  # saved before the poison, never again
    for step in (22, 24, 26, 36):
        assert _skipped_stream_steps(saved, step) == [[24, 26]]
    for (step, cfg), steps_records in zip(resumed.items(), records[1:]):
        assert {r["step"]: r["loss"] for r in steps_records} == {s: l for s, l in whole_losses.items() if s > step}
    # Step 20's checkpoint (what a kill during the recovery leaves) meets the poison again.
    events = _guard_records(resumed[20])
    assert events[-1]["skipped_samples"] == poisoned_indices() and events[-1]["to_step"] == 20
    assert not RunDir(resumed[24].run.run_dir).guard.exists() and not RunDir(resumed[26].run.run_dir).guard.exists()


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _nan_trainer(tmp_path: Path, *overrides: str, nan_at: int = 3):
    cfg = tiny_config(tmp_path, "--model.name=tests/fault/faulty_plugins.py:build_model",
                      f"--model.options={{ rank = 0, nan_at = {nan_at} }}", "--train.steps=6", "--train.micro_batch=8",
                      "--guard.enabled=true", "--guard.snapshot_every=2", *overrides)
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True)
    trainer = build_trainer(cfg, cpu_runtime(), run_dir, "none").trainer
    trainer.read_ahead = True  # as on a GPU: the next step is issued before this one is read
    return trainer, cfg


def test_a_nan_step_is_dropped_under_read_ahead(tmp_path, one_rank_group, one_torch_thread):
    trainer, cfg = _nan_trainer(tmp_path)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    (event,) = _guard_records(cfg)
    assert (event["event"], event["step"], event["reason"]) == ("not kept", 3, "non-finite loss")
    assert summary["steps"] == 6 and torch.isfinite(torch.tensor(summary["final_loss"]))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_dropped_last_step_leaves_the_last_kept_loss_in_the_summary(tmp_path, one_rank_group, one_torch_thread):
    trainer, cfg = _nan_trainer(tmp_path, nan_at=6)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    records = read_metrics(cfg.run.run_dir)
    assert records[-1]["guard"] == "non-finite loss"
    assert summary["final_loss"] == records[-2]["loss"] and summary["steps"] == 6


def test_past_max_rollbacks_the_run_stops_with_one_paragraph(tmp_path, one_rank_group, one_torch_thread):
    trainer, cfg = _nan_trainer(tmp_path, "--guard.bad_in_a_row=1", "--guard.max_rollbacks=0")
    try:
        with pytest.raises(GuardStop) as stop:
            trainer.fit()
    finally:
        trainer.close()
    message = str(stop.value)
    assert "\n" not in message and message.startswith("the spike and NaN guard stopped the run at step 3: 1 bad")
    assert "guard.max_rollbacks = 0 (the newest snapshot is of step 2" in message
