"""Context parallelism: each sequence split over the ``cp`` ranks, attention run as a ring.

The ranks of a context-parallel group read the same samples (they share a data-parallel
index). ``SequenceSplit.local`` keeps this rank's two chunks of every sequence (of
``2 x cp``: ``r`` and ``2 x cp - 1 - r``, see ``ring_attention.chunk_order``), inputs
and targets alike; everything in the model but attention is position-wise and runs on
those tokens as it is. ``apply_cp`` takes over the rest:

- attention: meshyard's GPT computes it through each ``CausalSelfAttention.attend``,
  which becomes the ring; a Hugging Face model that dispatches attention through
  transformers' ``AttentionInterface`` (Llama, Mistral, Qwen ...) is switched to an
  implementation registered here that calls the ring;
- positions: the module that turns positions into embeddings (the GPT's ``pos_emb``, a
  Hugging Face model's ``rotary_emb``) receives the local indices ``0..L-1`` the model
  counts and gets the tokens' true positions instead (a forward pre-hook).

A model whose attention cannot be taken over so is refused before any worker starts
(``cp_problems``, asked by ``meshyard.validate``). The loss and the gradients stay
exact: see ``train.loss.split_sequence_loss``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshyard.models.gpt import CausalSelfAttention
from meshyard.parallel.ring_attention import Ring, chunk_order, ring_attention

HF_IMPLEMENTATION = "meshyard_ring"
"""Name of the ring in transformers' attention registry."""


class ContextParallelError(ValueError):
    """The model's attention or positions cannot be split over a ring."""


class SequenceSplit:
    """This rank's share of each sequence under context parallelism."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring

    @property
    def size(self) -> int:
        return self.ring.size

    def positions(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """The true positions of this rank's tokens in a sequence of ``seq_len``."""
        chunk = seq_len // (2 * self.ring.size)
        return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in self.ring.chunks])

    def local(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's tokens (B, T / cp) of whole sequences ``tokens`` (B, T)."""
        return tokens[:, self.positions(tokens.shape[1], tokens.device)]

    def true_positions(self, local_positions: torch.Tensor) -> torch.Tensor:
        """Positions the model counted on its local tokens (``0..L-1``, any shape) mapped to
        the tokens' places in the whole sequence."""
        table = self.positions(local_positions.shape[-1] * self.ring.size, local_positions.device)
        return table[local_positions]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
               scale: float | None = None) -> torch.Tensor:
        """Causal attention (B, H, L, D) of the local tokens over the whole sequence."""
        if dropout_p:
            raise ContextParallelError(_DROPOUT_PROBLEM)
        return ring_attention(q, k, v, self.ring, scale)


_DROPOUT_PROBLEM = ("the ring attention of parallel.cp > 1 applies no dropout to attention probabilities; set the "
                    "model's attention dropout to 0 (model.dropout = 0 for meshyard's GPT, attention_dropout in a "
                    "Hugging Face config)")


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> SequenceSplit:
    """Make ``model`` run on this rank's share of each sequence (the ``cp`` ranks of
    ``cp_mesh`` holding the rest): its attention becomes the ring, its positions the true
    ones. Returns the split, which the step runner applies to each batch. Parameters are
    untouched (their names and values stay what they were)."""
    problem = _attention_problem(model)
    if problem:
        raise ContextParallelError(problem)
    split = SequenceSplit(Ring(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()))
    if _gpt_attention(model):
        for module in _gpt_attention(model):
            module.attend = split.attend
        _map_positions(model.get_submodule("pos_emb"), split, argument=0)
    else:
        _take_over_hf(model, split)
    return split


def cp_problems(model: nn.Module, cp: int) -> list[str]:
    """Why ``model`` (built anywhere, the meta device too) cannot run with ``parallel.cp = cp``."""
    problem = _attention_problem(model)
    return [f"parallel.cp = {cp}: {problem}"] if problem else []


def _gpt_attention(model: nn.Module) -> list[CausalSelfAttention]:
    return [module for module in model.modules() if isinstance(module, CausalSelfAttention)]


def _attention_problem(model: nn.Module) -> str:
    """One paragraph on what keeps the ring from taking over ``model``'s attention, '' if nothing."""
    gpt = _gpt_attention(model)
    if gpt:
        if any(module.dropout for module in gpt):
            return _DROPOUT_PROBLEM
        if not isinstance(getattr(model, "pos_emb", None), nn.Embedding):
            return "meshyard's attention blocks sit in a model without a 'pos_emb' position embedding; " \
                   "context parallelism needs the GPT whole"
        return ""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation") or not _rotary(model):
        return (f"context parallelism cannot take over the attention of {type(model).__name__}: it runs meshyard's "
                "GPT (model.name = 'gpt' or a preset) and Hugging Face models whose attention goes through "
                "transformers' AttentionInterface with rotary positions (Llama-style: a 'rotary_emb' module); "
                "use one of those, or parallel.cp = 1 with another layout (fsdp, tp) for this model")
    if getattr(config, "attention_dropout", 0.0):
        return _DROPOUT_PROBLEM
    return ""


def _rotary(model: nn.Module) -> list[nn.Module]:
    return [module for name, module in model.named_modules() if name.split(".")[-1] == "rotary_emb"]


def _map_positions(module: nn.Module, split: SequenceSplit, argument: int | str) -> None:
    """A pre-hook giving ``module`` the true positions in place of the local ones, passed
    as positional ``argument`` (an index) or keyword ``argument`` (a name)."""
    def hook(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if isinstance(argument, str) and kwargs.get(argument) is not None:
            kwargs = {**kwargs, argument: split.true_positions(kwargs[argument])}
        elif isinstance(argument, int) and len(args) > argument:
            args = (*args[:argument], split.true_positions(args[argument]), *args[argument + 1:])
        return args, kwargs
    module.register_forward_pre_hook(hook, with_kwargs=True)


def _take_over_hf(model: nn.Module, split: SequenceSplit) -> None:
    """Route a transformers model's attention to the ring: each attention module holds the
    split (the registered function finds it there), and the model's implementation is set
    to the ring's name; rotary embeddings get the true positions."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_IMPLEMENTATION, _hf_ring_attention)
    model.set_attn_implementation(HF_IMPLEMENTATION)
    if getattr(model.config, "_attn_implementation", None) != HF_IMPLEMENTATION:
        raise ContextParallelError(f"{type(model).__name__} does not let its attention implementation be set "
                                   "(transformers' AttentionInterface); context parallelism cannot take it over")
    for module in model.modules():  # the attention modules among them (they share the model's config)
        if getattr(module, "config", None) is model.config:
            module.context_parallel_split = split
    for rotary in _rotary(model):
        _map_positions(rotary, split, argument="position_ids")


def _hf_ring_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, L, D) in, (B, L, H, D) out.
    Grouped key/value heads are repeated to the query heads first, as transformers' own
    SDPA path does. The mask is the causal one the ring applies (no padding in training)."""
    split: SequenceSplit = module.context_parallel_split
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = split.attend(query, key, value, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


__all__ = ["ContextParallelError", "SequenceSplit", "apply_cp", "chunk_order", "cp_problems"]
