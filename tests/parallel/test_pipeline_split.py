"""Pipeline stages: balanced splits, full-model parameter names, tied weights, the theoretical bubble."""

from __future__ import annotations

import pytest
import torch

from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.pipeline import PipelineSplitError, StageTies, split_model, stage_sizes, stage_ties
from meshyard.train.pipeline_step import theoretical_bubble

SHAPE = GPTShape(vocab_size=32, context_length=8, n_layer=5, n_head=2, d_model=16)


def test_stage_sizes_balance_and_explicit_split():
    assert stage_sizes(5, 2) == [3, 2]
    assert stage_sizes(8, 4) == [2, 2, 2, 2]
    assert stage_sizes(5, 2, [1, 4]) == [1, 4]
    with pytest.raises(PipelineSplitError, match="summing to the model's 5 blocks"):
        stage_sizes(5, 2, [1, 1])
    with pytest.raises(PipelineSplitError, match="fewer than the 4 pipeline stages"):
        stage_sizes(3, 4)


@pytest.mark.parametrize("pp, virtual", [(2, 1), (2, 2)])
def test_stages_keep_the_full_models_names_and_values(pp, virtual):
    torch.manual_seed(0)
    full = {k: v.clone() for k, v in GPT(SHAPE).state_dict().items()}
    names: set[str] = set()
    for rank in range(pp):
        torch.manual_seed(0)
        part = split_model(GPT(SHAPE), pp, rank, virtual, [1, 1, 1, 2] if virtual == 2 else None)
        assert len(part.stages) == virtual
        for name, value in part.state_dict().items():
            torch.testing.assert_close(value, full[name], msg=name)
            names.add(name)
    assert names == set(full)


def test_stages_compose_to_the_full_forward():
    torch.manual_seed(0)
    model = GPT(SHAPE)
    tokens = torch.randint(0, SHAPE.vocab_size, (2, 8))
    expected = model(tokens)
    first = split_model(model, 2, 0).stages[0][1]
    torch.manual_seed(0)
    last = split_model(GPT(SHAPE), 2, 1).stages[0][1]
    torch.testing.assert_close(last(first(tokens)), expected)


def test_theoretical_bubble():
    assert theoretical_bubble(4, 4) == pytest.approx(3 / 7)
    assert theoretical_bubble(2, 8) == pytest.approx(1 / 9)
    assert theoretical_bubble(2, 4, virtual_stages=2) == pytest.approx(1 / 9)


def test_a_weight_shared_by_the_first_and_last_stage_is_counted_once():
    groups = [{"wte.weight", "head.weight"}]
    held = [{"wte.weight", "a"}, {"b"}, {"c"}, {"head.weight"}]
    assert stage_ties(groups, held, [0, 2]) == StageTies(("wte.weight",), (), True)
    assert stage_ties(groups, held, [1, 3]) == StageTies(("head.weight",), ("head.weight",), True)
    assert stage_ties(groups, [{"wte.weight", "head.weight"}, {"b"}], [0]) == StageTies()


def test_a_tied_gpt_keeps_a_copy_of_its_embedding_on_the_last_stage():
    torch.manual_seed(0)
    first = split_model(GPT(SHAPE), 2, 0)
    torch.manual_seed(0)
    last = split_model(GPT(SHAPE), 2, 1)
    assert first.tied and last.tied
    assert first.tied_parameters() == [first.tok_emb.weight] and first.norm_duplicates() == []
    assert last.tied_parameters() == last.norm_duplicates() == [last.lm_head.weight]
    torch.testing.assert_close(first.tok_emb.weight, last.lm_head.weight)
