"""Reading a step's figures one step late (what the Trainer does on a GPU) reports the same
figures, saves and evaluates the same weights, and stops a non-finite step before its update.

On CPU the Trainer settles each step before issuing the next; ``read_ahead = True`` makes
it run as on a GPU, so these tests prove the GPU path's bookkeeping where no GPU is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshyard.metrics.records import read_metrics
from meshyard.train.build import build_trainer
from meshyard.train.trainer import NonFiniteError, Trainer
from tests.conftest import tiny_config
from tests.inprocess import cpu_runtime

PLUGIN = "tests/fault/faulty_plugins.py"
# What a step computes; timings, memory and clocks differ between any two runs.
COMPUTED = ("step", "loss", "lr", "grad_norm", "tokens_seen", "eval_loss")


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trainer(tmp_path: Path, name: str, read_ahead: bool, *overrides: str) -> Trainer:
    cfg = tiny_config(tmp_path / name, *overrides)
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True)
    trainer = build_trainer(cfg, cpu_runtime(), run_dir, "none").trainer
    trainer.read_ahead = read_ahead
    trainer.run_dir = run_dir  # where its records are, for the test
    return trainer


def _order_of_calls(trainer: Trainer) -> list[str]:
    """Wraps the trainer's issue and settle so that their order is recorded."""
    calls: list[str] = []
    issue, settle = trainer.issue_step, trainer.settle_step

    def issued(step):
        calls.append(f"issue {step}")
        return issue(step)

    def settled(in_flight):
        calls.append(f"settle {in_flight.step}")
        return settle(in_flight)

    trainer.issue_step, trainer.settle_step = issued, settled
    return calls


def test_figures_saves_and_evaluations_match_settling_each_step(tmp_path, one_rank_group, one_torch_thread):
    overrides = ("--train.steps=7", "--train.eval_every=3", "--data.val_fraction=0.1", "--train.eval_batches=2",
                 "--train.micro_batch=4", "--checkpoint.enabled=true", "--checkpoint.interval=2",
                 "--checkpoint.async_save=false", "--checkpoint.keep_last=10")
    results = {}
    for read_ahead in (False, True):
        trainer = _trainer(tmp_path, f"ahead{read_ahead}", read_ahead, *overrides)
        calls = _order_of_calls(trainer)
        try:
            trainer.fit()
        finally:
            trainer.close()
        records = read_metrics(trainer.run_dir)
        weights = {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}
        saved = [outcome.step for outcome in trainer.checkpoints.outcomes]
        results[read_ahead] = records, weights, saved, calls

    (settled_records, settled_weights, settled_saves, settled_calls), (ahead_records, ahead_weights, ahead_saves,
                                                                       ahead_calls) = results.values()
    assert settled_calls == [f"{what} {step}" for step in range(1, 8) for what in ("issue", "settle")]
    # Step 2 (a save), 3 (an evaluation), 4 and 6 (saves) and 7 (the last) settle before the next
    # step is issued; steps 1 and 5 are read while the step after them has been issued.
    assert ahead_calls == ["issue 1", "issue 2", "settle 1", "settle 2", "issue 3", "settle 3", "issue 4",
                           "settle 4", "issue 5", "issue 6", "settle 5", "settle 6", "issue 7", "settle 7"]
    computed = [[record.get(key) for key in COMPUTED] for record in settled_records]
    assert [[record.get(key) for key in COMPUTED] for record in ahead_records] == computed
    assert [record["eval_loss"] is not None for record in settled_records if "eval_loss" in record] == [True] * 3
    assert ahead_saves == settled_saves == [2, 4, 6, 7]
    for name, value in settled_weights.items():
        assert torch.equal(ahead_weights[name], value), name
    assert all(record["step_time_s"] > 0 for record in ahead_records)


def test_a_nonfinite_step_stops_before_its_update_under_stop(tmp_path, one_rank_group, one_torch_thread):
    nan_model = (f"--model.name={PLUGIN}:build_model", "--model.options={ rank = 0, nan_at = 3 }", "--train.steps=5")
    reference = _trainer(tmp_path, "reference", True, *nan_model[:2], "--train.steps=2")
    try:
        reference.fit()
    finally:
        reference.close()

    stopping = _trainer(tmp_path, "stop", True, *nan_model, "--fault.on_nonfinite=stop")
    try:
        with pytest.raises(NonFiniteError, match="non-finite values at step 3: loss nan on rank 0; .*stopping before its update"):
            stopping.fit()
    finally:
        stopping.close()
    # Step 2 (in flight when step 3 stopped) was recorded; step 3's update was never applied.
    assert [record["step"] for record in read_metrics(stopping.run_dir)] == [1, 2]
    expected = reference.model.state_dict()
    for name, value in stopping.model.state_dict().items():
        assert torch.equal(value, expected[name]), name

    warning = _trainer(tmp_path, "warn", True, *nan_model)
    try:
        warning.fit()
    finally:
        warning.close()
    records = read_metrics(warning.run_dir)
    # 'warn' keeps the update, so the steps after it are not finite either.
    assert [record["step"] for record in records if "nonfinite" in record] == [3, 4, 5]
    assert records[2]["nonfinite"] == [{"rank": 0, "what": "loss", "value": "nan"},
                                       {"rank": "all", "what": "gradient norm", "value": "nan"}]


def test_a_profile_window_ends_with_its_last_step(tmp_path, one_rank_group, one_torch_thread):
    trainer = _trainer(tmp_path, "profiled", True, "--train.steps=5", "--metrics.profile_steps=[2, 3]")
    calls = _order_of_calls(trainer)
    try:
        trainer.fit()
    finally:
        trainer.close()
    # Step 2 is issued only once step 1 is recorded, and step 4 once step 3, the window's last,
    # is: the trace holds steps 2 and 3 alone.
    assert calls == ["issue 1", "settle 1", "issue 2", "issue 3", "settle 2", "settle 3", "issue 4", "issue 5",
                     "settle 4", "settle 5"]
    assert [record.get("profiled", False) for record in read_metrics(trainer.run_dir)] == [
        False, True, True, False, False]
    assert (trainer.run_dir / "profile" / "rank-0.trace.json").exists()
