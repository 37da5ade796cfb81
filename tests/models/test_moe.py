"""The MoE feed-forward: routing, capacity, router losses, and its place in the GPT."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshyard.models.flops import gpt_counts, gpt_training_flops_per_token
from meshyard.models.gpt import GPT, GPTShape
from meshyard.models.moe import MoEFeedForward, MoEShape, moe_layers, routing_losses
from meshyard.train.expert_load import ExpertLoad

D, HIDDEN = 8, 16


def layer(experts: int = 4, top_k: int = 2, **kwargs) -> MoEFeedForward:
    torch.manual_seed(0)
    moe = MoEFeedForward(MoEShape(experts, top_k, **kwargs), D, HIDDEN)
    moe.experts.reset_parameters(std=0.5, residual_std=0.5)
    return moe


def reference(moe: MoEFeedForward, x: torch.Tensor, dropped: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """Token by token: the weighted sum of its top-k experts' outputs, but for the (token,
    expert) assignments in ``dropped``."""
    flat = x.reshape(-1, D)
    probs = moe.router.gate(flat).float().softmax(-1)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        weights, chosen = probs[t].topk(moe.moe.top_k)
        if moe.moe.top_k > 1:  # top-1 keeps its probability: the router's only gradient
            weights = weights / weights.sum()
        for w, e in zip(weights, chosen):
            if (t, e.item()) not in dropped:
                hidden = F.gelu(flat[t] @ moe.experts.w_in[e], approximate="tanh")
                out[t] += w * (hidden @ moe.experts.w_out[e])
    return out.reshape(x.shape)


LOGITS = [  # router logits of four tokens over four experts; top-2 choices (first, second):
    [2.0, 3.0, 0.0, 0.0],  # expert 1, expert 0
    [3.0, 0.0, 2.0, 0.0],  # expert 0, expert 2
    [3.0, 0.0, 0.0, 2.0],  # expert 0, expert 3
    [0.0, 0.0, 3.0, 2.0],  # expert 2, expert 3
]
"""Expert 0 is the first choice of tokens 1 and 2 and the second of token 0; every other
expert takes two assignments at most."""


def designed_layer(**kwargs) -> tuple[MoEFeedForward, torch.Tensor]:
    """A layer with four experts whose router gives the tokens of the returned input the
    logits ``LOGITS`` (the gate reads their first four features)."""
    moe = layer(experts=4, **kwargs)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[:, :4] = torch.eye(4)
    x = torch.randn(1, 4, D)
    x[0, :, :4] = torch.tensor(LOGITS)
    return moe, x


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_dropless_routing_equals_token_by_token_experts(top_k):
    moe = layer(top_k=top_k)
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-6)
    routing = moe.last_routing
    assert routing.tokens_per_expert.sum().item() == 10 * top_k and routing.dropped.item() == 0


def test_shared_experts_take_every_token():
    moe = layer(shared_experts=2)
    x = torch.randn(1, 6, D)
    shared = moe.shared.proj(F.gelu(moe.shared.fc(x), approximate="tanh"))
    assert moe.shared.fc.out_features == 2 * HIDDEN
    torch.testing.assert_close(moe(x), reference(moe, x) + shared, rtol=1e-5, atol=1e-6)


def test_capacity_keeps_the_first_tokens_of_each_expert_and_counts_the_rest():
    """Every token prefers expert 0: with capacity factor 1 it takes an even share (tokens x
    top_k / experts) in token order and the rest are dropped (their output is zero)."""
    moe = layer(experts=4, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0] = 1.0
    x = torch.rand(1, 8, D) + 0.1  # positive: expert 0's logit is the largest for every token
    out = moe(x)
    assert moe.capacity(8) == 2
    assert moe.last_routing.tokens_per_expert.tolist() == [8, 0, 0, 0]
    assert moe.last_routing.dropped.item() == 6
    assert out[0, 2:].abs().max().item() == 0.0 and out[0, :2].abs().min().item() > 0
    torch.testing.assert_close(out[:, :2], reference(moe, x[:, :2]))


def test_top2_capacity_keeps_first_choices_before_second_choices():
    """Capacity 2 (factor 1: 4 tokens x top-2 / 4 experts) and three assignments to expert
    0: tokens 1 and 2 chose it first and keep it; token 0, for which it is the second
    choice, loses it although it comes first in token order, and keeps only expert 1."""
    moe, x = designed_layer(top_k=2, capacity_factor=1.0)
    out = moe(x)
    assert moe.capacity(4) == 2
    assert moe.last_routing.tokens_per_expert.tolist() == [3, 1, 2, 2]
    assert moe.last_routing.dropped.item() == 1
    torch.testing.assert_close(out, reference(moe, x, dropped=((0, 0),)), rtol=1e-5, atol=1e-6)


def test_evaluation_is_dropless_so_a_row_does_not_depend_on_its_batch():
    """In eval mode the capacity limit is off: every assignment reaches its expert, and a
    row's output is the same alone as in a batch with other rows."""
    moe, x = designed_layer(top_k=2, capacity_factor=1.0)
    moe.eval()
    with torch.no_grad():
        out = moe(x)
        assert moe.last_routing.dropped.item() == 0
        torch.testing.assert_close(out, reference(moe, x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(moe(x[:, :1]), out[:, :1], rtol=1e-5, atol=1e-6)


def test_router_losses_are_the_switch_and_st_moe_formulas():
    """Balance: experts x sum over experts of (share of the assignments) x (mean router
    probability); z-loss: the mean squared log-sum-exp of the logits. Written out here for
    the designed logits, whose top-2 choices give experts 0-3 3, 1, 2 and 2 of the 8
    assignments; both losses reach the gate's gradient through the weighted sum."""
    moe, x = designed_layer(top_k=2, aux_loss_weight=0.5, z_loss_weight=0.25)
    moe(x)
    total, balance, z_loss = routing_losses([moe])
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in LOGITS]
    mean_probs = [sum(row[e] for row in probs) / 4 for e in range(4)]
    share = [3 / 8, 1 / 8, 2 / 8, 2 / 8]
    assert balance.item() == pytest.approx(4 * sum(f * p for f, p in zip(share, mean_probs)), rel=1e-6)
    want_z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS) / 4
    assert z_loss.item() == pytest.approx(want_z, rel=1e-6)
    assert total.item() == pytest.approx(0.5 * balance.item() + 0.25 * z_loss.item())
    total.backward()
    assert moe.router.gate.weight.grad is not None and moe.router.gate.weight.grad.abs().sum() > 0


def test_balance_loss_rises_with_imbalance():
    moe = layer(experts=4, top_k=1)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0] = 5.0
    moe(torch.rand(2, 4, D) + 0.1)
    _, balance, _ = routing_losses([moe])
    assert balance.item() > 2.0


def tiny_shape(moe: MoEShape | None, **kwargs) -> GPTShape:
    return GPTShape(vocab_size=64, context_length=16, n_layer=2, n_head=2, d_model=32, moe=moe, **kwargs)


@pytest.mark.parametrize("moe", [MoEShape(4, 2), MoEShape(8, 1, shared_experts=1)])
@pytest.mark.parametrize("tied", [True, False])
def test_counts_are_exact_and_flops_count_active_weights(moe, tied):
    shape = tiny_shape(moe, tie_embeddings=tied)
    with torch.device("meta"):
        model = GPT(shape)
    counts = gpt_counts(shape)
    assert counts.n_params == sum(p.numel() for p in model.parameters())
    assert counts.largest_param == max(p.numel() for p in model.parameters())
    expert = 2 * 32 * 128  # one expert's two projections
    assert counts.expert_params_per_layer == moe.experts * expert
    assert counts.active_params == counts.n_params - 2 * (moe.experts - moe.top_k) * expert
    # FLOPs: a dense model with top_k + shared experts' worth of feed-forward, plus the router.
    dense = gpt_counts(tiny_shape(None, bias=False, tie_embeddings=tied))
    extra = (moe.top_k + moe.shared_experts - 1) * expert + 32 * moe.experts
    assert counts.matmul_params_per_layer == dense.matmul_params_per_layer + extra
    assert gpt_training_flops_per_token(shape, 16) == pytest.approx(
        gpt_training_flops_per_token(tiny_shape(None, bias=False, tie_embeddings=tied), 16) + 3 * 2 * 2 * extra)


def test_gpt_with_experts_trains_on_router_losses_and_reports_its_load():
    torch.manual_seed(0)
    model = GPT(tiny_shape(MoEShape(4, 2, capacity_factor=1.0)))
    load = ExpertLoad(model)
    assert load.active and len(load.layers) == 2 and moe_layers(GPT(tiny_shape(None))) == []
    tokens = torch.randint(0, 64, (2, 16))
    for _ in range(2):  # two micro-batches of one step
        loss = F.cross_entropy(model(tokens).reshape(-1, 64), tokens.reshape(-1))
        training = load.training_loss(loss)
        assert training.item() > loss.item()
        training.backward()
    figures = load.take_step().figures()
    assert set(figures) == {"moe_aux_loss", "moe_z_loss", "moe_tokens_per_expert", "moe_dropped_tokens",
                            "moe_imbalance"}
    per_layer = figures["moe_tokens_per_expert"]
    assert len(per_layer) == 2 and all(sum(counts) == 2 * 2 * 32 for counts in per_layer)
    assert figures["moe_imbalance"] == pytest.approx(max(max(c) / (sum(c) / 4) for c in per_layer))
    assert load.take_step().figures() == {}  # taken: the next step starts empty
    assert all(p.grad is not None for p in model.parameters())
