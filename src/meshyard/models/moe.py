"""A mixture-of-experts feed-forward: a token-choice top-k router and batched experts.

Each token's hidden state goes to the ``top_k`` experts whose router probability is
highest, weighted by those probabilities (renormalised to sum to 1 over the chosen
experts when there are several; a single one keeps its probability, through which the
router learns); optional shared experts take every token. The routed experts are stored as
batched weights, one parameter per projection with the experts along dimension 0
(``experts.w_in`` is [experts, d_model, hidden]): expert parallelism shards that
dimension over ranks (``meshyard.parallel.expert_parallel``) and checkpoint keys stay the
same in every layout.

The experts see the tokens grouped by expert (``GroupedExperts.forward(tokens, counts)``):
that call is the seam where expert parallelism sends each group to the rank that holds
its expert and brings the results back. Under it the weights are DTensors sharded over
the experts and each rank computes with its own share; this module stays free of
``torch.distributed`` (it only asks a weight for its local part).

Training signals, kept on the layer after each forward (``last_routing``): the
load-balancing loss of Switch Transformer (Fedus et al. 2021; experts x sum over experts
of their share of the token assignments times their mean router probability: 1 when the
load is even), the router z-loss of ST-MoE (Zoph et al. 2022; the mean squared
log-sum-exp of the router logits), tokens routed to each expert and tokens dropped by
the capacity limit. ``routing_losses`` gathers them for the training loss.

The capacity limit (``MoEShape.capacity_factor``) applies in training only, where it
bounds an expert's work per micro-batch: it keeps every token's first choice before any
second choice, each in token order, and drops the rest. In evaluation (``model.eval()``)
and decoding the layer is dropless, since a limit over the whole batch would make a
served row's output depend on which other requests share its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshyard.models.local_part import local_part


@dataclass(frozen=True)
class MoEShape:
    """The experts of a mixture-of-experts feed-forward and the weights of its router losses."""

    experts: int
    top_k: int = 2
    shared_experts: int = 0
    capacity_factor: float = 0.0
    """Tokens an expert takes per training forward, as a multiple of an even share; 0:
    dropless. Evaluation and inference are always dropless, so a row's output never
    depends on the other rows of its batch."""
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001


@dataclass(frozen=True)
class Routing:
    """What one forward of a MoE layer routed: its router losses (unweighted) and load."""

    balance_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    """Assignments each expert received (before the capacity limit), int64 [experts]."""
    dropped: torch.Tensor
    """Assignments the capacity limit turned away (int64 scalar; 0 when dropless)."""


class GroupedExperts(nn.Module):
    """``experts`` two-layer GELU MLPs (no biases) with their weights batched along dim 0."""

    def __init__(self, experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.w_out = nn.Parameter(torch.empty(experts, hidden, d_model))

    def reset_parameters(self, std: float, residual_std: float) -> None:
        nn.init.normal_(self.w_in, mean=0.0, std=std)
        nn.init.normal_(self.w_out, mean=0.0, std=residual_std)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``tokens`` [assignments, d_model] grouped by expert, ``counts[e]`` of them for
        expert e (of those this rank holds); returns each token's expert output."""
        # Under expert parallelism the weights are DTensors sharded over the experts, and
        # each rank computes with its own experts only.
        w_in, w_out = local_part(self.w_in), local_part(self.w_out)
        outputs = []
        for expert, group in enumerate(torch.split(tokens, counts.tolist())):
            hidden = F.gelu(group @ w_in[expert], approximate="tanh")
            outputs.append(hidden @ w_out[expert])
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, w_out.shape[-1])


class SharedExperts(nn.Module):
    """The always-active experts: one dense feed-forward ``shared`` times as wide."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Router(nn.Module):
    """Token-choice top-k gate: a linear map to one logit per expert."""

    def __init__(self, d_model: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, experts, bias=False)

    def forward(self, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens ``x`` [tokens, d_model]: each token's chosen experts and their weights
        ([tokens, top_k] each), the mean router probability of each expert ([experts], for
        the balance loss) and the z-loss. Logits in fp32: the softmax and the log-sum-exp
        decide the routing and must not round differently between layouts or precisions."""
        logits = self.gate(x).float()
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(top_k, dim=-1)
        if top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        return chosen, weights.to(x.dtype), probs.mean(dim=0), z_loss


def balance_loss(counts: torch.Tensor, mean_probs: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss from the assignments each expert received
    (``counts``) and its mean router probability: experts x sum over experts of their share
    of the assignments times that probability; 1 when both are even. Its gradient reaches
    the router through the probabilities only (the counts come from a top-k)."""
    share = counts.float() / counts.sum().clamp(min=1)
    return counts.numel() * (share * mean_probs).sum()


class MoEFeedForward(nn.Module):
    """Routed experts (+ shared ones) in place of a block's dense feed-forward."""

    def __init__(self, moe: MoEShape, d_model: int, hidden: int) -> None:
        super().__init__()
        if not 1 <= moe.top_k <= moe.experts:
            raise ValueError(f"moe top_k = {moe.top_k} must be between 1 and the {moe.experts} experts")
        self.moe = moe
        self.router = Router(d_model, moe.experts)
        self.experts = GroupedExperts(moe.experts, d_model, hidden)
        self.shared = SharedExperts(d_model, moe.shared_experts * hidden) if moe.shared_experts else None
        self.last_routing: Routing | None = None

    def capacity(self, tokens: int) -> int:
        """Assignments one expert takes from ``tokens`` tokens (at least one)."""
        moe = self.moe
        return max(1, math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        tokens, top_k = flat.shape[0], self.moe.top_k
        chosen, weights, mean_probs, z_loss = self.router(flat, top_k)
        # Assignment i = token * top_k + choice. Grouped by expert (a stable sort), and
        # within an expert first choices first, each choice in token order: the order in
        # which the capacity limit keeps them, so that a token's second choice never takes
        # a place a later token's first choice needs (GShard's and Switch's priority).
        choice_major = torch.arange(tokens * top_k, device=x.device).view(tokens, top_k).t().reshape(-1)
        flat_chosen = chosen.reshape(-1)
        order = choice_major[torch.argsort(flat_chosen[choice_major], stable=True)]
        counts = torch.bincount(flat_chosen, minlength=self.moe.experts)
        kept_counts, dropped = counts, counts.new_zeros(())
        if self.moe.capacity_factor > 0 and self.training:
            limit = self.capacity(tokens)
            starts = torch.cumsum(counts, 0) - counts
            place = torch.arange(order.numel(), device=x.device) - starts[flat_chosen[order]]
            order = order[place < limit]
            kept_counts = counts.clamp(max=limit)
            dropped = counts.sum() - kept_counts.sum()
        token_of = order // top_k
        expert_out = self.experts(flat[token_of], kept_counts)
        expert_out = expert_out * weights.reshape(-1)[order].unsqueeze(-1)
        # Made in x's shape and filled through a flat view: the module returns the tensor
        # itself, not a view of one (FSDP2, which wraps this module under expert parallelism,
        # warns of every forward that returns a view).
        combined = torch.zeros_like(x)
        combined.view(-1, x.shape[-1]).index_add_(0, token_of, expert_out)
        if self.shared is not None:
            combined = combined + self.shared(x)
        balance = balance_loss(counts, mean_probs)
        self.last_routing = Routing(balance, z_loss, counts.detach(), dropped.detach())
        return combined


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The MoE feed-forwards of ``model``, in order ([] for a dense model)."""
    return [module for module in model.modules() if isinstance(module, MoEFeedForward)]


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """The batched routed experts of every MoE layer of ``model``, in order (what expert
    parallelism splits and FSDP shards over the ranks holding the same experts)."""
    return [layer.experts for layer in moe_layers(model)]


def routing_losses(layers: list[MoEFeedForward]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted sum to add to the training loss, balance loss, z-loss) of the last forward
    of ``layers``, the two losses as means over the layers and unweighted."""
    routed = [layer.last_routing for layer in layers if layer.last_routing is not None]
    if not routed:
        raise ValueError("no MoE layer has routed anything yet: run a forward first")
    moe = layers[0].moe
    balance = torch.stack([r.balance_loss for r in routed]).mean()
    z_loss = torch.stack([r.z_loss for r in routed]).mean()
    return moe.aux_loss_weight * balance + moe.z_loss_weight * z_loss, balance, z_loss
