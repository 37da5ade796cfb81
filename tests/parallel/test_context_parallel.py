"""Context parallelism: the ring's attention and gradients against one process's SDPA,
the split loss against the whole sequence's, whole models' logits under ``apply_cp``
(positions included), and what is refused, with which paragraph."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from meshyard.cli import main
from meshyard.config.checks import field_problems
from meshyard.config.load import load_config
from meshyard.config.sections import ParallelConfig
from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.outputs import logits_of
from meshyard.parallel.context_parallel import (ContextParallelError, SequenceSplit, _hf_ring_attention,
                                                _map_positions, apply_cp, cp_problems)
from meshyard.parallel.layout import Layout
from meshyard.parallel.ring_attention import Ring, _pairs, chunk_order, ring_attention
from meshyard.runtime.parallel_dims import ParallelDims
from meshyard.train.loss import IGNORE_INDEX, next_token_loss, split_sequence_loss
from tests import shared_spawn
from tests.models import user_models
from tests.models.user_models import hf_llama, hf_mistral, nanogpt

MODELS = Path(user_models.__file__)
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


# --- on one process ---------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_ranks_hold_every_chunk_once_and_compute_as_many_blocks(size):
    held = sorted(chunk for rank in range(size) for chunk in chunk_order(rank, size))
    assert held == list(range(2 * size))
    # Load balance: every rank computes the same number of chunk pairs over the ring
    # (3 at the first step, 2 after), and never a pair wholly above the diagonal.
    counts = {sum(len(_pairs(Ring(None, rank, size), step)) for step in range(size)) for rank in range(size)}
    assert counts == {3 + 2 * (size - 1)}


def test_models_whose_attention_cannot_be_taken_over_are_refused_in_one_paragraph():
    with torch.device("meta"):
        problems = cp_problems(nanogpt(64, 16, n_layer=1), 2)
        dropout = cp_problems(GPT(GPTShape(64, 16, 1, 2, 16, dropout=0.1)), 2)
    assert len(problems) == 1 and "cannot take over the attention of NanoGPT" in problems[0]
    assert "Llama-style" in problems[0] and "parallel.cp = 1" in problems[0]
    assert len(dropout) == 1 and "model.dropout = 0" in dropout[0]
    with torch.device("meta"):
        assert cp_problems(GPT(GPTShape(64, 16, 1, 2, 16)), 2) == []


def test_a_user_model_with_cp_exits_2_before_starting(tmp_path, capsys):
    code = main(["run", "--model.name=" + f"{MODELS}:nanogpt", "--data.source=random", "--data.seq_len=16",
                 "--parallel.strategy=fsdp", "--parallel.cp=2", "--nproc", "2", f"--run.dir={tmp_path}"])
    assert code == 2
    assert "parallel.cp = 2: context parallelism cannot take over the attention" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, expected", [
    (["--parallel.strategy=zero1", "--parallel.cp=2"], "parallel.strategy = 'zero1' does not do; use 'fsdp'"),
    (["--parallel.strategy=fsdp", "--parallel.cp=2", "--data.seq_len=30"],
     "data.seq_len = 30 is not divisible by 2 x parallel.cp = 4"),
    (["--parallel.strategy=fsdp", "--parallel.cp=2", "--parallel.pp=2"], "does not combine with parallel.pp = 2"),
    (["--parallel.cp=0"], "parallel.cp = 0 must be at least 1"),
    # 12 tokens split over cp = 2 leave 6 per rank, which sequence parallelism cannot split over tp = 4.
    (["--parallel.strategy=fsdp", "--parallel.cp=2", "--parallel.tp=4", "--data.seq_len=12"],
     "data.seq_len / parallel.cp = 12 / 2 = 6 tokens per rank are not divisible by parallel.tp = 4"),
])
def test_config_checks_name_what_cp_needs(overrides, expected):
    problems = field_problems(load_config(None, overrides))
    assert any(expected in problem for problem in problems), problems


def test_sequence_parallel_under_cp_needs_only_each_ranks_tokens_divisible_by_tp():
    problems = field_problems(load_config(None, ["--parallel.strategy=fsdp", "--parallel.cp=2", "--parallel.tp=4",
                                                 "--data.seq_len=24"]))
    assert not [p for p in problems if "seq_len" in p], problems


@pytest.mark.parametrize("tp, cp, expected", [(2, 2, "fsdp"), (1, 2, "ddp"), (2, 1, "none")])
def test_ddp_replicates_a_tensor_parallel_model_over_its_cp_ranks_with_fsdp(tp, cp, expected):
    """DDP takes no DTensor parameters: under tp > 1 the cp ranks' replicas are FSDP2's."""
    layout = Layout(ParallelConfig(strategy="ddp", tp=tp, cp=cp), ParallelDims(1, 1, tp, 1, tp * cp, cp=cp))
    assert layout.data_parallel == expected
    assert layout.replicates_with_fsdp == (expected == "fsdp")


class _Rotary(nn.Module):
    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return position_ids


def test_positions_are_mapped_whether_passed_by_keyword_or_by_place():
    rotary = _Rotary()
    # Rank 0 of 2 holds chunks 0 and 3 of a 16-token sequence: positions 0-3 and 12-15.
    _map_positions(rotary, SequenceSplit(Ring(None, 0, 2)), index=1, name="position_ids")
    local, hidden = torch.arange(8).unsqueeze(0), torch.zeros(1, 8, 4)
    true = torch.tensor([[0, 1, 2, 3, 12, 13, 14, 15]])
    assert torch.equal(rotary(hidden, position_ids=local), true)
    assert torch.equal(rotary(hidden, local), true)
    with pytest.raises(ContextParallelError, match="called without positions"):
        rotary(hidden)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_a_sliding_window_shorter_than_the_sequence_is_refused():
    with torch.device("meta"):
        assert cp_problems(hf_mistral(64, 32, sliding_window=32), 2, seq_len=32) == []
        window = cp_problems(hf_mistral(64, 32, sliding_window=16), 2, seq_len=32)
    assert len(window) == 1 and "sliding window of 16 tokens" in window[0] and "data.seq_len <= 16" in window[0]


def test_the_ring_refuses_attention_features_it_does_not_compute_when_they_reach_it():
    """A window shorter than the whole sequence (8 local tokens x 2 ranks) or a softcap,
    from a model whose config did not announce them."""
    attention = nn.Module()
    attention.context_parallel_split = SequenceSplit(Ring(None, 0, 2))
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ContextParallelError, match="sliding window of 15 tokens"):
        _hf_ring_attention(attention, q, q, q, None, sliding_window=15)
    with pytest.raises(ContextParallelError, match="softcap"):
        _hf_ring_attention(attention, q, q, q, None, sliding_window=16, softcap=30.0)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_softcapped_logits_and_attention_sinks_are_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    with torch.device("meta"):
        softcapped = cp_problems(Gemma2ForCausalLM(Gemma2Config(**small, attn_logit_softcapping=50.0)), 2, 32)
        sinks = cp_problems(GptOssForCausalLM(GptOssConfig(**small, num_local_experts=2, num_experts_per_tok=1)),
                            2, 32)
    assert len(softcapped) == 1 and "config.attn_logit_softcapping" in softcapped[0]
    assert len(sinks) == 1 and "attention sinks" in sinks[0]


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_a_sliding_window_shorter_than_the_sequence_exits_2_before_starting(tmp_path, capsys):
    code = main(["run", f"--model.name={MODELS}:hf_mistral", "--model.options={sliding_window = 8}",
                 "--data.source=random", "--data.seq_len=16", "--parallel.strategy=fsdp", "--parallel.cp=2",
                 "--nproc", "2", f"--run.dir={tmp_path}"])
    assert code == 2
    assert "attends within a sliding window of 8 tokens" in capsys.readouterr().err


# --- on 2 and 4 ranks -------------------------------------------------------------------------
def _attention(rank: int, world_size: int) -> dict:
    """The ring's output and gradients for this rank's chunks, and the split loss of
    targets whose ignored tokens fall unevenly between the ranks."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8 * world_size, 4, requires_grad=True) for _ in range(3))
    ring = Ring(dist.group.WORLD, rank, world_size)
    index = _local_index(rank, world_size, q.shape[2])
    local = [t.detach()[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn(q.shape)
    ring_attention(*local, ring).mul(grad[:, :, index]).sum().backward()
    logits, targets = torch.randn(2, 8 * world_size, 11), torch.randint(0, 11, (2, 8 * world_size))
    targets[:, : 6 * world_size] = IGNORE_INDEX  # the first ranks' chunks are mostly ignored
    loss = split_sequence_loss(logits[:, index], targets[:, index], dist.group.WORLD, world_size)
    return {"out": ring_attention(*(t.detach() for t in local), ring), "grads": [t.grad for t in local],
            "index": index, "loss": loss.item()}


def _local_index(rank: int, size: int, seq: int) -> torch.Tensor:
    chunk = seq // (2 * size)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in chunk_order(rank, size)])


def _models(rank: int, world_size: int) -> dict:
    """Logits of meshyard's GPT (learned positions) and of a Llama (rotary positions) whose
    attention and positions ``apply_cp`` took over, on this rank's tokens."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    builders = {"gpt": lambda: GPT(GPTShape(64, 32, 2, 2, 16))}
    if HAS_TRANSFORMERS:
        builders["llama"] = lambda: hf_llama(64, 32, n_layer=2)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    outputs = {}
    for name, build in builders.items():
        torch.manual_seed(0)
        model = build()
        split = apply_cp(model, mesh["cp"])
        outputs[name] = logits_of(model(split.local(tokens))).detach()
    return {"logits": outputs, "index": split.positions(32)}


def _ring_and_models(rank: int, world_size: int) -> dict:
    return {"attention": _attention(rank, world_size), "models": _models(rank, world_size)}


shared_spawn.register(2, "context_parallel: ring and models", __name__,
                      lambda request, folder: (_ring_and_models, ()))
shared_spawn.register(4, "context_parallel: ring", __name__, lambda request, folder: (_attention, ()))


def _check_attention(per_rank: list[dict], world_size: int) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8 * world_size, 4, requires_grad=True) for _ in range(3))
    grad = torch.randn(q.shape)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.mul(grad).sum().backward()
    logits, targets = torch.randn(2, 8 * world_size, 11), torch.randint(0, 11, (2, 8 * world_size))
    targets[:, : 6 * world_size] = IGNORE_INDEX
    for result in per_rank:
        index = result["index"]
        torch.testing.assert_close(result["out"], out.detach()[:, :, index], rtol=1e-5, atol=1e-6)
        for local, whole in zip(result["grads"], (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(local, whole[:, :, index], rtol=1e-5, atol=1e-6)
    # Summed over the ranks: the mean over the counted tokens of the whole sequences.
    assert sum(r["loss"] for r in per_rank) / world_size == pytest.approx(
        next_token_loss(logits, targets).item(), rel=1e-6)


def test_the_ring_on_2_ranks_gives_the_attention_and_gradients_of_one_process(request):
    _, per_rank = shared_spawn.result(request, 2, "context_parallel: ring and models")
    _check_attention([r["attention"] for r in per_rank], 2)


def test_the_ring_on_4_ranks_gives_the_attention_and_gradients_of_one_process(request):
    _, per_rank = shared_spawn.result(request, 4, "context_parallel: ring")
    _check_attention(per_rank, 4)


def test_models_under_cp_give_the_logits_of_one_process_at_the_true_positions(request):
    _, per_rank = shared_spawn.result(request, 2, "context_parallel: ring and models")
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    builders = {"gpt": lambda: GPT(GPTShape(64, 32, 2, 2, 16)), "llama": lambda: hf_llama(64, 32, n_layer=2)}
    for name in per_rank[0]["models"]["logits"]:
        torch.manual_seed(0)
        whole = logits_of(builders[name]()(tokens)).detach()
        for result in per_rank:
            torch.testing.assert_close(result["models"]["logits"][name], whole[:, result["models"]["index"]],
                                       rtol=1e-4, atol=1e-5, msg=name)
