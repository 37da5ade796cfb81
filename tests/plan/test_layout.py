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
