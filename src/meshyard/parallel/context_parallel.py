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

A model whose attention cannot be taken over so, or whose attention the ring would
compute differently (a sliding window shorter than the sequence, softcapped logits,
attention sinks), is refused before any worker starts (``cp_problems``, asked by
``meshyard.validate``), and again by the ring when such an argument reaches it. The loss and the gradients stay
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

_UNSUPPORTED_FEATURES = ("softcap", "s_aux", "sinks")
"""Keyword arguments of transformers' attention functions that change what attention
computes (logit softcapping, attention sinks) and that the ring does not compute."""


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
        _map_positions(model.get_submodule("pos_emb"), split, index=0, name="input")
    else:
        _take_over_hf(model, split)
    return split


def cp_problems(model: nn.Module, cp: int, seq_len: int | None = None) -> list[str]:
    """Why ``model`` (built anywhere, the meta device too) cannot run with ``parallel.cp = cp``
    on sequences of ``seq_len`` tokens (None: whatever their length)."""
    problem = _attention_problem(model, seq_len)
    return [f"parallel.cp = {cp}: {problem}"] if problem else []


def _gpt_attention(model: nn.Module) -> list[CausalSelfAttention]:
    return [module for module in model.modules() if isinstance(module, CausalSelfAttention)]


def _attention_problem(model: nn.Module, seq_len: int | None = None) -> str:
    """One paragraph on what keeps the ring from taking over ``model``'s attention, '' if
    nothing; a sliding window is judged against ``seq_len`` (not at all when None: the ring
    then refuses a window shorter than the sequence when it is called)."""
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
    return _hf_feature_problem(model, seq_len)


def _hf_feature_problem(model: nn.Module, seq_len: int | None) -> str:
    """What in a Hugging Face model's attention the ring does not compute: a sliding window
    shorter than the sequence, softcapped attention logits, attention sinks."""
    config, name = model.config, type(model).__name__
    window = _sliding_window(config)
    if window is not None and seq_len is not None and window < seq_len:
        return (f"{name} attends within a sliding window of {window} tokens (config.sliding_window), shorter than "
                f"data.seq_len = {seq_len}, and the ring attention of parallel.cp > 1 attends to every earlier token; "
                f"use data.seq_len <= {window}, or parallel.cp = 1 for this model")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return (f"{name} softcaps its attention logits (config.attn_logit_softcapping), which the ring attention of "
                "parallel.cp > 1 does not; use parallel.cp = 1 for this model")
    sinks = [param for param, _ in model.named_parameters() if "sink" in param]
    if sinks:
        return (f"{name} has attention sinks ({sinks[0]}), which the ring attention of parallel.cp > 1 does not "
                "compute; use parallel.cp = 1 for this model")
    return ""


def _sliding_window(config: Any) -> int | None:
    """The sliding window of a transformers config's attention, None where no layer uses
    one (a config may keep a window size that its layer types or a switch leave unused)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    return window if layer_types is None or "sliding_attention" in layer_types else None


def _rotary(model: nn.Module) -> list[nn.Module]:
    return [module for name, module in model.named_modules() if name.split(".")[-1] == "rotary_emb"]


def _map_positions(module: nn.Module, split: SequenceSplit, index: int, name: str) -> None:
    """A pre-hook giving ``module`` the true positions in place of the local ones, which
    its caller passes as keyword ``name`` or as positional argument ``index``. A call
    without them would let the module count local positions itself: refused."""
    def hook(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if kwargs.get(name) is not None:
            return args, {**kwargs, name: split.true_positions(kwargs[name])}
        if len(args) > index and args[index] is not None:
            return (*args[:index], split.true_positions(args[index]), *args[index + 1:]), kwargs
        raise ContextParallelError(
            f"{type(module).__name__} was called without positions ('{name}' or positional argument {index}); "
            "under parallel.cp > 1 it would count them from 0 on this rank's part of the sequence and give "
            "wrong embeddings. Its caller must pass them (transformers' Llama-style models pass position_ids); "
            "use parallel.cp = 1 for this model")
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
        _map_positions(rotary, split, index=1, name="position_ids")


def _hf_ring_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       sliding_window: int | None = None, **features: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, L, D) in, (B, L, H, D) out.
    Grouped key/value heads are repeated to the query heads first, as transformers' own
    SDPA path does. The mask is the causal one the ring applies (no padding in training).
    Features the ring does not compute are refused here too, for a model whose config did
    not announce them to the check before the run."""
    split: SequenceSplit = module.context_parallel_split
    whole = query.shape[2] * split.size
    if sliding_window is not None and sliding_window < whole:
        raise ContextParallelError(
            f"{type(module).__name__} attends within a sliding window of {sliding_window} tokens, shorter than the "
            f"sequence of {whole}; the ring attention of parallel.cp > 1 attends to every earlier token: use "
            f"data.seq_len <= {sliding_window}, or parallel.cp = 1 for this model")
    unsupported = [name for name in _UNSUPPORTED_FEATURES if features.get(name) is not None]
    if unsupported:
        raise ContextParallelError(
            f"{type(module).__name__} asks its attention for {', '.join(unsupported)} (logit softcapping or "
            "attention sinks), which the ring attention of parallel.cp > 1 does not compute; use parallel.cp = 1 "
            "for this model")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = split.attend(query, key, value, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


__all__ = ["ContextParallelError", "SequenceSplit", "apply_cp", "chunk_order", "cp_problems"]
