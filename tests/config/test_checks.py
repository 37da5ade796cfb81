"""Checks of a config on its own fields: every section's, listed together, none raising."""

from __future__ import annotations

import pytest

from meshyard.config.checks import field_problems
from meshyard.config.load import load_config
from meshyard.config.sections import Config


def test_defaults_have_no_problems():
    assert field_problems(Config()) == []


@pytest.mark.parametrize("override, fragment", [
    ("--model.dropout=1.0", "model.dropout = 1.0 must be in [0, 1)"),
    ("--data.seq_len=0", "data.seq_len = 0 must be at least 1"),
    ("--data.tokenizer=bpe:100", "data.tokenizer = 'bpe:100' must be 'bpe:N' with a whole N from 257"),
    ("--data.tokenizer=bpe:lots", "data.tokenizer = 'bpe:lots' must be 'bpe:N'"),
    ("--data.tokenizer= ", "data.tokenizer is empty"),
    ("--data.text_field=", "data.text_field is empty"),
    ("--data.shuffle_span_shards=-1", "data.shuffle_span_shards = -1 must be 0 (shuffle over the whole corpus) or more"),
    ("--data.shuffle_lanes=5", "data.shuffle_lanes = 5 does not divide train.global_batch = 32"),
    ("--model.pad_vocab_multiple=-64", "model.pad_vocab_multiple = -64 must not be negative"),
    ("--train.eval_batches=0", "train.eval_batches = 0 must be at least 1"),
    ("--optim.betas=[0.9, 1.5]", "optim.betas = [0.9, 1.5] must be two numbers in [0, 1)"),
    ("--parallel.dp_shard=-1", "parallel.dp_shard = -1 must not be negative (0 derives it)"),
    ("--parallel.pp_split=[2, 2]", "must list one positive block count per stage"),
    ("--comm.topk_ratio=0", "comm.topk_ratio = 0.0 must be in (0, 1]"),
    ("--precision.loss_scale_growth_interval=0", "precision.loss_scale_growth_interval = 0 must be at least 1"),
    ("--checkpoint.keep_last=0", "checkpoint.keep_last = 0 must be at least 1"),
    ("--fault.signals=['SIGKILL']", "fault.signals: 'SIGKILL' is not one of SIGTERM"),
    ("--guard.snapshot_every=-1", "guard.snapshot_every = -1 must not be negative"),
    ("--metrics.prometheus_port=70000", "metrics.prometheus_port = 70000 is not a port number"),
    ("--metrics.idle_span_steps=80", "metrics.idle_span_steps = 80 must be between 1 and metrics.waste_window (50)"),
    ("--metrics.idle_gpu_util=50", "metrics.idle_gpu_util = 50.0 must be in (0, 1]"),
    ("--metrics.data_stall_share=0", "metrics.data_stall_share = 0.0 must be in (0, 1)"),
    ("--run.nproc=-1", "run.nproc = -1 must not be negative"),
    ("--run.gpu_hour_price=-2.5", "run.gpu_hour_price = -2.5 must be a price of at least 0 US dollars"),
    ("--run.spot_hour_price=-0.5", "run.spot_hour_price = -0.5 must be a price of at least 0 US dollars"),
])
def test_each_section_is_checked(override, fragment):
    [problem] = field_problems(load_config(None, [override]))
    assert fragment in problem


def test_rolling_back_to_checkpoints_needs_checkpoints():
    overrides = ["--guard.enabled=true", "--guard.snapshot_every=0"]
    [problem] = field_problems(load_config(None, [*overrides, "--checkpoint.enabled=false"]))
    assert problem.startswith("guard.snapshot_every = 0 rolls back to the newest checkpoint of the run, but "
                              "checkpoint.enabled = false")
    assert not field_problems(load_config(None, [*overrides, "--checkpoint.enabled=true"]))


def test_a_tokenizer_applies_to_text_sources_only():
    [problem] = field_problems(load_config(None, ["--data.source=random", "--data.tokenizer=bpe:512"]))
    assert "data.tokenizer = 'bpe:512' tokenizes text, but data.source = 'random' reads none" in problem
    assert field_problems(load_config(None, ["--data.source=stdlib", "--data.tokenizer=bpe:512"])) == []


def test_problems_of_several_sections_are_listed_together():
    cfg = load_config(None, ["--train.steps=0", "--optim.lr=0", "--parallel.tp=2", "--parallel.strategy=zero1",
                             "--data.seq_len=33", "--model.context_length=16"])
    text = "\n".join(field_problems(cfg))
    for fragment in ("train.steps = 0", "optim.lr = 0.0", "'zero1' does not combine with parallel.tp > 1",
                     "data.seq_len = 33 is not divisible by parallel.tp = 2",
                     "model.context_length = 16 is shorter than data.seq_len = 33"):
        assert fragment in text


@pytest.mark.parametrize("overrides, fragment, fix", [
    (["--model.name=mlp"], "model.name = 'mlp' returns logits only", "set train.fused_linear_loss = false"),
    (["--parallel.tp=2"], "does not combine with parallel.tp = 2",
     "set train.fused_linear_loss = false or parallel.tp = 1"),
    (["--parallel.pp=2"], "does not combine with parallel.pp = 2",
     "set train.fused_linear_loss = false or parallel.pp = 1"),
])
def test_the_fused_head_loss_needs_a_gpt_and_a_whole_head(overrides, fragment, fix):
    [problem] = field_problems(load_config(None, ["--train.fused_linear_loss=true", *overrides]))
    assert problem.startswith("train.fused_linear_loss = true") and fragment in problem and problem.endswith(fix)
    assert field_problems(load_config(None, ["--train.fused_linear_loss=false", *overrides])) == []
