"""Whole-run checks: all problems at once in the launching process, the layout alone in a worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshyard.config.load import ConfigError, load_config
from meshyard.validate import derive_layout, load_and_validate, validate, validate_local_launch, with_local_nproc


def problems_of(world_size: int, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, list(overrides)), world_size)
    return info.value.problems


def test_valid_default_layouts():
    layout = validate(load_config(None, ["--train.global_batch=32", "--train.micro_batch=4"]), 2)
    assert (layout.dims.dp_replicate, layout.dims.dp_shard, layout.dims.dp) == (2, 1, 2)
    assert (layout.batch.micro_batch, layout.batch.grad_accum) == (4, 4)
    hsdp = validate(load_config(None, ["--parallel.strategy=fsdp", "--parallel.dp_replicate=2"]), 4)
    assert (hsdp.dims.dp_replicate, hsdp.dims.dp_shard) == (2, 2)


def test_degrees_that_do_not_multiply_to_world_size():
    [problem] = problems_of(4, "--parallel.strategy=fsdp", "--parallel.dp_replicate=2", "--parallel.dp_shard=3")
    assert "do not multiply to the world size 4" in problem and "--nproc" in problem


def test_global_batch_not_divisible():
    [problem] = problems_of(2, "--train.global_batch=30", "--train.micro_batch=4")
    assert "not divisible by train.micro_batch = 4 x data-parallel size 2" in problem
    [problem] = problems_of(4, "--train.global_batch=6")
    assert "not divisible by the data-parallel size 4" in problem


def test_micro_batch_and_accumulation_disagree():
    [problem] = problems_of(2, "--train.global_batch=32", "--train.micro_batch=4", "--train.grad_accum=2")
    assert "differs from train.global_batch = 32" in problem


def test_impossible_combinations_collected_together():
    problems = problems_of(
        2, "--parallel.strategy=none", "--model.name=gtp-mini", "--model.d_model=100", "--model.n_head=3",
        "--data.source=text", "--data.seq_len=256", "--model.context_length=128", "--optim.betas=[0.9]",
    )
    text = "\n".join(problems)
    assert "did you mean 'gpt-mini'" in text
    assert "d_model = 100 is not divisible by model.n_head = 3" in text
    assert "data.source = 'text' needs data.paths" in text
    assert "context_length = 128 is shorter than data.seq_len = 256" in text
    assert "optim.betas" in text
    assert "'none' runs one process but the world size is 2" in text
    assert len(problems) == 6


def test_shard_degree_needs_fsdp():
    [problem] = problems_of(2, "--parallel.strategy=ddp", "--parallel.dp_shard=2")
    assert "needs parallel.strategy = 'fsdp'" in problem


def test_worker_derives_the_layout_it_was_validated_for():
    cfg = load_config(None, ["--parallel.strategy=fsdp", "--parallel.dp_replicate=2", "--train.global_batch=32",
                             "--train.micro_batch=4"])
    assert derive_layout(cfg, 4) == validate(cfg, 4)


def test_worker_refuses_a_world_size_that_does_not_fit_with_the_launchers_message():
    cfg = load_config(None, ["--parallel.strategy=fsdp", "--parallel.dp_replicate=2", "--train.global_batch=8"])
    validate(cfg, 4)
    with pytest.raises(ConfigError) as launcher:
        validate(cfg, 3)  # e.g. torchrun --nproc-per-node 3 on a config checked for 4
    with pytest.raises(ConfigError) as worker:
        derive_layout(cfg, 3)
    assert worker.value.problems == launcher.value.problems
    assert "does not divide the world size 3" in worker.value.problems[0]
    with pytest.raises(ConfigError, match="not divisible by the data-parallel size 16"):
        derive_layout(cfg, 16)


def test_worker_reports_degrees_of_a_config_never_validated():
    with pytest.raises(ConfigError, match="parallel.tp = 0 must be at least 1"):
        derive_layout(load_config(None, ["--parallel.tp=0"]), 2)


def test_derive_layout_runs_none_of_the_other_checks():
    cfg = load_config(None, ["--train.steps=0", "--model.name=no-such-model"])
    assert derive_layout(cfg, 2).dims.dp == 2
    assert len(problems_of(2, "--train.steps=0", "--model.name=no-such-model")) == 2


def test_nproc_zero_is_this_machines_default(monkeypatch):
    monkeypatch.setattr("meshyard.validate.visible_gpu_count", lambda: 4)
    assert load_config().run.nproc == 0  # loading does not look at the machine
    assert with_local_nproc(load_config()).run.nproc == 4
    assert with_local_nproc(load_config(None, ["--run.device=cpu"])).run.nproc == 2
    assert with_local_nproc(load_config(None, ["--run.nproc=3"])).run.nproc == 3
    assert with_local_nproc(load_config(None, ["--run.nproc=3"]), nproc=1).run.nproc == 1
    monkeypatch.setattr("meshyard.validate.visible_gpu_count", lambda: 0)
    assert with_local_nproc(load_config()).run.nproc == 2


def test_local_launch_counts_workers_and_refuses_more_than_gpus(monkeypatch):
    monkeypatch.setattr("meshyard.validate.visible_gpu_count", lambda: 1)
    cfg, layout = validate_local_launch(load_config(None, ["--run.device=cpu"]))
    assert cfg.run.nproc == 2 and layout.dims.world_size == 2
    with pytest.raises(ConfigError) as info:
        validate_local_launch(load_config(None, ["--train.steps=0"]), nproc=2)
    assert len(info.value.problems) == 2 and "ranks would share a GPU" in "\n".join(info.value.problems)


def test_load_and_validate_reports_type_and_combination_problems_together():
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, ["--parallel.strategy=zero9", "--train.steps=-1"], world_size=2)
    assert len(info.value.problems) == 2
    cfg, layout = load_and_validate(None, ["--run.nproc=1"])
    assert cfg.run.nproc == 1 and layout.dims.world_size == 1


def test_a_layout_the_model_cannot_take_is_refused_before_any_worker_starts(tmp_path):
    """Through the real command: tp = 2 on a GRU (no tensor-parallel plan) exits 2 with one
    message naming the fixes; no run directory is made and no worker starts."""
    repo = Path(__file__).resolve().parents[1]
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "meshyard.cli", "run", "examples/custom_model.toml", "--nproc=2",
                           "--parallel.tp=2", f"--run.dir={runs}"], cwd=repo, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("meshyard: invalid configuration (1 problem):")
    assert "no tensor-parallel plan for CharRNN" in proc.stderr and "tensor_parallel_plan(tp_mesh)" in proc.stderr
    assert "Traceback" not in proc.stderr and "run directory" not in proc.stdout + proc.stderr
    assert not runs.exists()


def test_a_custom_model_without_the_fused_head_loss_is_refused_before_any_worker_starts():
    """train.fused_linear_loss asks the model to compute its loss: a builder's model that
    returns logits is found out on the meta device, named with the fix."""
    models = Path(__file__).parent / "models" / "user_models.py"
    [problem] = problems_of(1, f"--model.name={models}:nanogpt", "--data.source=random", "--data.seq_len=16",
                            "--train.fused_linear_loss=true")
    assert problem == ("train.fused_linear_loss = true needs a model whose forward computes the loss from its "
                       "hidden states (meshyard's GPT); NanoGPT returns logits only: set train.fused_linear_loss = "
                       "false")
    validate(load_config(None, [f"--model.name={models}:nanogpt", "--data.source=random", "--data.seq_len=16"]), 1)


def test_cuda_graphs_need_a_compiled_whole_step_of_one_micro_batch_on_cuda():
    """train.cuda_graphs: each problem named with its fix; one rank, one micro-batch per step passes."""
    validate(load_config(None, ["--train.cuda_graphs=true", "--train.global_batch=8"]), 1)
    compile_off, on_cpu = problems_of(1, "--train.cuda_graphs=true", "--train.compile=false", "--run.device=cpu")
    assert "train.compile = false" in compile_off and "set train.compile = 'auto'" in compile_off
    assert "run.device = 'cpu'" in on_cpu and "train.cuda_graphs = false" in on_cpu
    [wrapped] = problems_of(2, "--train.cuda_graphs=true", "--parallel.strategy=ddp", "--train.global_batch=8")
    assert "strategy 'ddp'" in wrapped and "parallel.strategy = 'none'" in wrapped
    [accumulated] = problems_of(1, "--train.cuda_graphs=true", "--train.global_batch=8", "--train.micro_batch=4")
    assert "accumulates 2" in accumulated and "set train.micro_batch = 8" in accumulated
    [ring] = problems_of(2, "--train.cuda_graphs=true", "--parallel.strategy=ddp", "--parallel.cp=2",
                         "--train.global_batch=8")
    assert "cp 2" in ring  # the context-parallel ranks are what rule it out here
    [experts] = problems_of(1, "--train.cuda_graphs=true", "--model.moe_experts=4", "--train.global_batch=8")
    assert "model.moe_experts = 4" in experts and "train.cuda_graphs = false" in experts
