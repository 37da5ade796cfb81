"""DDP and FSDP communication options on 2 gloo ranks: explicit FSDP prefetch changes
the schedule, never the numbers; DDP's static graph and copied gradients work with a hook."""

from __future__ import annotations

import pytest
import torch

from tests.ranks import run_on_ranks
from tests.comm.scenarios import layout_options

STEPS = 4


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(layout_options, STEPS)


def test_fsdp_prefetch_gives_identical_losses(runs):
    assert runs[0]["fsdp_prefetch"] == runs[0]["fsdp"]
    assert runs[0]["fsdp"][-1] < runs[0]["fsdp"][0]


def test_prefetch_lists_reach_the_requested_blocks(runs):
    # 3 blocks, forward 2 ahead, backward 1 behind.
    assert runs[0]["blocks_prefetch"] == [(2, 0), (1, 1), (0, 1)]


def test_ddp_options_with_a_hook_train_and_keep_ranks_identical(runs):
    assert torch.equal(runs[0]["ddp_options_params"], runs[1]["ddp_options_params"])
    assert runs[0]["ddp_options"][-1] < runs[0]["ddp_options"][0]
