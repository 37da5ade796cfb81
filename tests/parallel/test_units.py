"""FSDP and activation-checkpointing units are chosen by module class, wherever a model
keeps its blocks; one real 2-rank FSDP run of a nanoGPT-style model checks the result."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import SplitPoint, pipeline

from meshyard.config.checks import field_problems
from meshyard.config.load import load_config
from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.activation_checkpoint import apply_ac, checkpointed_blocks
from meshyard.parallel.data_parallel import unwrap
from meshyard.parallel.pipeline import split_model
from meshyard.parallel.units import ac_problems, describe_units, find_blocks, repeated_block_class, unit_problems
from meshyard.train.build import build_trainer
from tests.conftest import tiny_config
from tests.inprocess import cpu_runtime
from tests.models import user_models
from tests.models.user_models import Block, hf_gpt2, hf_llama, nanogpt
from tests.ranks import run_on_ranks

USER_MODELS = Path(user_models.__file__).resolve()
# A vocabulary-sized head outweighs all blocks of these tiny models: leaf layers must never win.
VOCAB = 50257
HF = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (test extra)")


class Wrapper(nn.Module):
    """A user's wrapper around one block (as an activation-checkpoint wrapper would be)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Flat(nn.Module):
    """No repeated blocks: layers only."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.hidden, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(tokens))))


def _gpt() -> GPT:
    return GPT(GPTShape(vocab_size=VOCAB, context_length=8, n_layer=3, n_head=2, d_model=16))


@pytest.mark.parametrize("build, cls, blocks_of", [
    pytest.param(lambda: nanogpt(VOCAB, 8), "Block", lambda m: list(m.transformer.h), id="nanogpt"),
    pytest.param(lambda: hf_gpt2(VOCAB, 8), "GPT2Block", lambda m: list(m.transformer.h), id="hf_gpt2", marks=HF),
    pytest.param(lambda: hf_llama(VOCAB, 8), "LlamaDecoderLayer", lambda m: list(m.model.layers), id="hf_llama",
                 marks=HF),
    pytest.param(_gpt, "Block", lambda m: list(m.blocks), id="gpt"),
])
def test_the_repeated_block_class_is_found_in_forward_order(build, cls, blocks_of):
    model = build()
    assert repeated_block_class(model) == cls
    assert find_blocks(model) == blocks_of(model)


def test_blocks_are_found_in_a_sequential_and_behind_wrappers():
    blocks = [Block(8, 2, 0.0) for _ in range(3)]
    sequential = nn.Sequential(nn.Embedding(VOCAB, 8), *blocks, nn.LayerNorm(8), nn.Linear(8, VOCAB))
    assert find_blocks(sequential) == blocks
    wrapped = nn.Sequential(nn.Embedding(VOCAB, 8), *(Wrapper(block) for block in blocks))
    # Wrappers hold exactly their block's parameters: the tie goes to the outermost.
    assert [w.inner for w in find_blocks(wrapped)] == blocks
    assert find_blocks(wrapped, ["Block"]) == blocks
    whole = Wrapper(nanogpt(VOCAB, 8))
    assert find_blocks(whole) == list(whole.inner.transformer.h)


def test_a_model_without_repeated_blocks_is_one_unit_and_cannot_be_checkpointed():
    model = Flat()
    assert find_blocks(model) == []
    assert "the whole model is one FSDP unit" in describe_units(model, [])
    [problem] = ac_problems(model, "full")
    assert "parallel.ac = 'full'" in problem and "parallel.fsdp_units" in problem
    with pytest.raises(TypeError, match="Flat has none"):
        apply_ac(model, "full")
    assert ac_problems(model, "none") == [] and ac_problems(model, "full", ["Linear"]) == []


def test_named_classes_are_units_outermost_first():
    model = nanogpt(VOCAB, 8, n_layer=2)
    h = model.transformer.h
    assert find_blocks(model, ["CausalSelfAttention", "MLP"]) == [h[0].attn, h[0].mlp, h[1].attn, h[1].mlp]
    assert find_blocks(model, ["Block", "MLP"]) == list(h)  # a block's MLP is inside a unit already
    units = find_blocks(model, ["MLP", "CausalSelfAttention"])
    assert describe_units(model, units).startswith("FSDP units: 2 x CausalSelfAttention, 2 x MLP, then the root")
    assert unit_problems(model, ["Block", "MLP"]) == []


def test_unknown_unit_names_are_problems_naming_the_fix():
    model = nanogpt(VOCAB, 8)
    typo, container, root = unit_problems(model, ["Blok", "ModuleList", "NanoGPT"])
    assert "no module of NanoGPT has class 'Blok' (did you mean 'Block'?)" in typo
    assert "Classes with parameters in NanoGPT: Embedding, Block," in typo
    assert "'ModuleList' is a container without a forward" in container
    assert "'NanoGPT' is the model itself" in root
    assert ac_problems(model, "full", ["Blok"]) == []  # reported once, by unit_problems
    # Names that are not strings are the config checks' to report, not a crash here.
    assert unit_problems(model, [3]) == [] and ac_problems(model, "full", [[1]]) == []
    cfg = load_config(None, ['--parallel.fsdp_units=["Block", ""]'])
    assert any("parallel.fsdp_units" in p for p in field_problems(cfg))


def test_pipeline_stages_keep_their_blocks_under_the_whole_models_class():
    """A stage of one block has no repeated class of its own: the class is resolved on the
    whole model (``parallelize``) and found by name in meshyard's stages and in traced ones
    (torch.export's InterpreterModules record each module's original class)."""
    stage = split_model(_gpt(), 3, 1).stages[0][1]
    assert find_blocks(stage) == [] and len(find_blocks(stage, ["Block"])) == 1
    model = nanogpt(64, 8, n_layer=3)
    traced = pipeline(model, mb_args=(torch.zeros(2, 8, dtype=torch.long),),
                      split_spec={"transformer.h.1": SplitPoint.BEGINNING})
    first, second = traced.get_stage_module(0), traced.get_stage_module(1)
    assert [len(find_blocks(s, ["Block"])) for s in (first, second)] == [1, 2]
    assert repeated_block_class(second) == "Block"
    assert find_blocks(second) == [second.get_submodule(f"transformer.h.{i}") for i in (1, 2)]


def _train(rank: int, world_size: int, tmp: str, overrides: tuple[str, ...]) -> dict:
    cfg = tiny_config(Path(tmp), f"--model.name={USER_MODELS}:nanogpt", *overrides)
    trainer = build_trainer(cfg, cpu_runtime(rank, world_size), Path(tmp) / "run").trainer
    model = unwrap(trainer.model)
    blocks = list(model.transformer.h)
    try:
        trainer.fit()
    finally:
        trainer.close()
    log = (Path(tmp) / "run" / "logs" / f"rank{rank}.log").read_text()
    return {"losses": trainer.progress.losses, "fsdp_blocks": sum(isinstance(b, FSDPModule) for b in blocks),
            "blocks": len(blocks), "root_fsdp": isinstance(model, FSDPModule),
            "checkpointed": checkpointed_blocks(model), "units_line": "FSDP units: 4 x Block" in log}


def test_two_rank_fsdp_shards_and_checkpoints_each_nanogpt_block_and_matches_one_process(tmp_path):
    sharded = run_on_ranks(_train, str(tmp_path / "fsdp"), ("--parallel.strategy=fsdp", "--parallel.ac=full"))
    # The one-process baseline runs here: a spawn would cost more than its training.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    single = _train(0, 1, str(tmp_path / "one"), ("--parallel.strategy=none",))
    for rank in sharded:
        assert rank["blocks"] == rank["fsdp_blocks"] == rank["checkpointed"] == 4
        assert rank["root_fsdp"] and rank["units_line"]
    assert single["fsdp_blocks"] == 0 and single["checkpointed"] == 0
    assert len(single["losses"]) == 4 and sharded[0]["losses"] == sharded[1]["losses"]
    for got, want in zip(sharded[0]["losses"], single["losses"]):
        assert math.isclose(got, want, rel_tol=1e-5), (sharded[0]["losses"], single["losses"])
