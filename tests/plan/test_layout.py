"""One translation from a config's ``[parallel]`` section to the planner's strategies."""

from __future__ import annotations

import pytest

from meshyard.config.sections import ParallelConfig
from meshyard.plan.layout import CONFIG_STRATEGIES, STRATEGIES, planner_strategy


@pytest.mark.parametrize("fields, dp_replicate, planned", [
    ({"strategy": "none"}, 0, "none"),
    ({"strategy": "ddp"}, 4, "ddp"),
    ({"strategy": "zero1"}, 0, "zero1"),
    ({"strategy": "fsdp"}, 0, "fsdp3"),
    ({"strategy": "fsdp"}, 1, "fsdp3"),
    ({"strategy": "fsdp", "reshard_after_forward": False}, 0, "fsdp2"),
    ({"strategy": "fsdp"}, 2, "hsdp"),  # the resolved degree
    ({"strategy": "fsdp", "dp_replicate": 2}, 0, "hsdp"),  # the section's own
])
def test_planner_strategy_of_a_parallel_section(fields, dp_replicate, planned):
    assert planner_strategy(ParallelConfig(**fields), dp_replicate) == planned


def test_every_config_strategy_has_a_planner_strategy():
    assert {planner_strategy(ParallelConfig(strategy=name)) for name in CONFIG_STRATEGIES} <= set(STRATEGIES)


@pytest.mark.parametrize("strategy, world_size, degrees, label", [
    ("fsdp3", 4, {}, "fsdp dp=4 tp=1 pp=1"),
    ("fsdp2", 4, {}, "fsdp (no reshard) dp=4 tp=1 pp=1"),
    ("hsdp", 4, {"shard": 2}, "fsdp dp=2x2 tp=1 pp=1"),
    ("ddp", 4, {"tp": 2}, "ddp dp=2 tp=2 pp=1"),
    ("zero1", 4, {}, "zero1 dp=4 tp=1 pp=1"),
    ("ddp", 4, {"pp": 2}, "ddp dp=2 tp=1 pp=2"),
])
def test_a_planned_layout_reads_and_runs_as_the_config_names_it(strategy, world_size, degrees, label, tmp_path):
    """The label speaks the config's terms, and the settings ``plan`` prints for a layout
    load and validate as a config of that world size that plans back to the same layout."""
    from meshyard.config.load import load_config
    from meshyard.plan.layout import make_layout
    from meshyard.validate import validate

    layout = make_layout(strategy, world_size, micro_batch=2, grad_accum=2, seq_len=32, ac="selective", **degrees)
    assert layout.describe() == label
    cfg = load_config(None, ["--model.name=gpt-tiny", "--data.source=random", f"--run.run_dir={tmp_path}",
                             *layout.config_overrides()])
    checked = validate(cfg, world_size)
    dims = checked.layout.dims
    assert planner_strategy(cfg.parallel, dims.dp_replicate) == strategy
    assert (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp) == (layout.dp, layout.tp, layout.pp)
    assert checked.batch.micro_batch == layout.micro_batch and checked.batch.grad_accum == layout.grad_accum


def test_a_fused_loss_layout_runs_with_it_and_its_config_plans_back_with_it(tmp_path):
    """``fused_loss`` is ``train.fused_linear_loss``: in the settings ``plan`` prints, and
    from a config back to the planner's layout (``meshyard place``)."""
    from meshyard.config.load import load_config
    from meshyard.plan.layout import make_layout
    from meshyard.plan.place_cost import plan_inputs
    from meshyard.validate import validate

    fused = make_layout("fsdp3", 2, micro_batch=2, seq_len=32, fused_loss=True)
    assert "--train.fused_linear_loss=true" in fused.config_overrides()
    planned = []
    for layout in (fused, fused.with_(fused_loss=False)):
        cfg = load_config(None, ["--model.name=gpt-tiny", "--data.source=random", f"--run.run_dir={tmp_path}",
                                 *layout.config_overrides()])
        assert cfg.train.fused_linear_loss == layout.fused_loss
        planned.append(plan_inputs(cfg, validate(cfg, 2))[1])
    assert [p.fused_loss for p in planned] == [True, False]
    assert (planned[0].strategy, planned[0].dp_shard, planned[0].micro_batch) == ("fsdp3", 2, 2)
