"""The step-time breakdown adds up, and per-rank figures and stragglers are computed right."""

from __future__ import annotations

import pytest
import torch

import meshyard
from meshyard.metrics.ranks import find_stragglers
from meshyard.metrics.records import straggler_message
from meshyard.metrics.throughput import catalog_peak, training_flops_per_token
from meshyard.models.gpt import GPT, GPTShape


PHASES = ("data", "forward", "backward", "comm", "optimizer")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_phases_add_up_to_the_step_time(make_config, strategy):
    """DDP's exposed gradient wait comes from its comm hook, FSDP's forward all-gather
    waits from hooks around its pre-forward; both count as communication."""
    records = meshyard.run(make_config("--train.steps=8", "--train.grad_accum=2", "--metrics.gather_every=4",
                                       f"--parallel.strategy={strategy}", "--metrics.mfu=true"), nproc=2).metrics()
    for record in records[1:]:
        parts = sum(record[f"{p}_s"] for p in PHASES)
        # other_s is what the phases leave of the step, never below 0: a phase counted
        # twice or timed outside the step makes the parts exceed the step and breaks this.
        assert abs(parts + record["other_s"] - record["step_time_s"]) < 1e-6, record
        assert all(record[f"{p}_s"] > 0 for p in PHASES), record  # every phase timed
        assert 0 < record["mfu"] < 1.5 and record["rss_bytes"] > 0
        if strategy == "fsdp":
            # The loss all-reduce alone makes comm_s positive; this part exists only while
            # the wait tracker sits around FSDP's pre-forward hooks (every micro-step gathers).
            assert 0 < record["allgather_wait_s"] <= record["comm_s"], record
        else:
            assert "allgather_wait_s" not in record  # DDP gathers nothing in forward
    # Work left out of every phase would fall into other_s on every step; a loaded
    # machine's pauses land there only on some, so the best covered step is checked.
    covered = max(1 - record["other_s"] / record["step_time_s"] for record in records[1:])
    assert covered > 0.9, records
    gathered = [r for r in records if "ranks" in r]
    assert [r["step"] for r in gathered] == [4, 8]
    assert all(len(values) == 2 for values in gathered[0]["ranks"].values())


def test_breakdown_off_reports_no_phases(make_config):
    records = meshyard.run(make_config("--train.steps=2", "--metrics.breakdown=false", "--parallel.strategy=none"),
                           nproc=1).metrics()
    assert "forward_s" not in records[-1] and "loss" in records[-1]


def test_find_stragglers_uses_the_median():
    assert find_stragglers([0.10, 0.11, 0.10, 0.30], 1.25) == [3]
    assert find_stragglers([0.10, 0.12], 1.25) == []
    assert find_stragglers([0.1], 1.25) == []


def test_straggler_message_names_each_straggler_with_its_host():
    record = {"step": 12, "ranks": {"busy_s": [0.04, 0.08, 0.04, 0.09]}, "stragglers": [1, 3],
              "straggler_hosts": ["node (10.0.0.2)", "node (10.0.0.3)"]}
    assert straggler_message(record) == ("straggler at step 12: rank 1 on node (10.0.0.2), 80 ms busy; rank 3 on "
                                         "node (10.0.0.3), 90 ms busy; median of all ranks 60 ms")
    del record["straggler_hosts"]  # a record from a run whose hosts were not gathered
    assert straggler_message(record).startswith("straggler at step 12: rank 1, 80 ms busy; rank 3, 90 ms busy")


def test_flops_and_catalog_peaks():
    shape = GPTShape(vocab_size=256, context_length=64, n_layer=2, n_head=2, d_model=64)
    model = GPT(shape)
    matmul_weights = 2 * (3 * 64 * 64 + 64 * 64 + 2 * 4 * 64 * 64) + 256 * 64
    expected = 3 * (2 * matmul_weights + 4 * 2 * 64 * 64)
    assert training_flops_per_token(model, 64) == expected
    assert catalog_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert catalog_peak("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert catalog_peak("NVIDIA H200", torch.float32) > 0
    assert catalog_peak("Some Unknown Accelerator", torch.float32) is None
