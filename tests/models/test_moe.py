"""The MoE feed-forward: routing, capacity, router losses, and its place in the GPT."""

from __future__ import annotations

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


def reference(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the weighted sum of its top-k experts' outputs (no capacity limit)."""
    flat = x.reshape(-1, D)
    probs = moe.router.gate(flat).float().softmax(-1)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        weights, chosen = probs[t].topk(moe.moe.top_k)
        if moe.moe.top_k > 1:  # top-1 keeps its probability: the router's only gradient
            weights = weights / weights.sum()
        for w, e in zip(weights, chosen):
            hidden = F.gelu(flat[t] @ moe.experts.w_in[e], approximate="tanh")
            out[t] += w * (hidden @ moe.experts.w_out[e])
    return out.reshape(x.shape)


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


def test_router_losses_are_one_and_log_experts_squared_for_a_uniform_router():
    """Switch's balance loss is 1 for an even load; the z-loss of all-zero logits is
    log(experts)^2; both reach the gate's gradient through the weighted sum."""
    moe = layer(experts=4, top_k=2, aux_loss_weight=0.5, z_loss_weight=0.25)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
    moe(torch.randn(3, 4, D))
    total, balance, z_loss = routing_losses([moe])
    assert balance.item() == pytest.approx(1.0)
    assert z_loss.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)
    assert total.item() == pytest.approx(0.5 * balance.item() + 0.25 * z_loss.item())
    total.backward()
    assert moe.router.gate.weight.grad is not None


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
