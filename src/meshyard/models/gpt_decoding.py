"""The GPT's decoding step (one new token per row against a KV cache) on its parameters,
without its modules.

A decoding step does little matrix work, so on a CPU the Python around it weighs as much:
through the modules a step of a 4-layer GPT makes about 50 module calls, applies dropout
that does nothing in eval, and writes keys and values in two indexed writes per layer. This
forward computes the same functions in the same order on the same parameters (functional
layer norms, linears and attention; the logits agree with the modules' forward to float
rounding), with one write of a layer's keys and values together (``CacheStep.store``, they
lie side by side in the attention's projection) and everything that does not depend on the
layer made once per step (positions, index tensors) or once for the steps over the same rows
(masks) by ``KVCache.begin``.

It serves only the steps it computes exactly as the modules would: the model in eval mode
(no dropout) and built of the plain layers ``GPT`` makes. ``GPTDecoder.of`` returns None for
a model whose layers were replaced (int8 linears), wrapped (hooks on them, as tensor
parallelism and FSDP add) or sharded (DTensor parameters): it keeps the module path. Hooks on
the model itself run around the decoder's step as around the modules' (a benchmark's timing
hooks, say) and keep it. The decoder holds the parameters themselves, so what changes them in
place (training, ``load_state_dict``) reaches it; ``GPT.init_kv_cache`` makes a new one, so a
model changed otherwise (layers replaced, moved to another device) decodes as it now is with
the next cache it makes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshyard.models.kv_cache import CacheStep, KVCache

# The torch layers the decoder computes by hand; any other layer anywhere in the model (an
# int8 linear, a user's replacement) means it does not know that layer's function.
_PLAIN_LAYERS = (nn.Linear, nn.LayerNorm, nn.Embedding, nn.Dropout, nn.ModuleList)


@dataclass(frozen=True)
class _Norm:
    """A layer norm's parameters."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


@dataclass(frozen=True)
class _BlockWeights:
    """One transformer block's parameters, in the order its forward uses them."""

    ln_1: _Norm
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    attn_proj: tuple[torch.Tensor, torch.Tensor | None]
    ln_2: _Norm
    fc: tuple[torch.Tensor, torch.Tensor | None]
    mlp_proj: tuple[torch.Tensor, torch.Tensor | None]


def _norm(module: nn.LayerNorm) -> _Norm:
    return _Norm(module.weight, module.bias, module.eps)


def _linear(module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight, module.bias


def _is_plain(model: nn.Module, model_parts: tuple[type[nn.Module], ...]) -> bool:
    """Whether every module of ``model`` is one of ``model_parts`` (the GPT's own classes,
    exactly) or a plain torch layer, none below ``model`` with hooks, and every parameter a
    plain one (not a DTensor shard). Hooks on ``model`` itself do not count: the decoder runs
    inside its forward, so they run around each step as they would around the modules' one."""
    for module in model.modules():
        if type(module) not in model_parts and type(module) not in _PLAIN_LAYERS:
            return False
        if module is not model and (module._forward_hooks or module._forward_pre_hooks):
            return False
    return all(type(parameter) is nn.Parameter for parameter in model.parameters())


class GPTDecoder:
    """The decoding step of one GPT: logits [B, 1, vocab] of one new token per row."""

    def __init__(self, model: nn.Module) -> None:
        """``model``: a ``meshyard.models.gpt.GPT`` (which imports this module, hence no type)."""
        self.n_head = model.shape.n_head
        self.tok_emb, self.pos_emb = model.tok_emb.weight, model.pos_emb.weight
        self.blocks = [_BlockWeights(_norm(block.ln_1), _linear(block.attn.qkv), _linear(block.attn.proj),
                                     _norm(block.ln_2), _linear(block.mlp.fc), _linear(block.mlp.proj))
                       for block in model.blocks]
        self.ln_f = _norm(model.ln_f)
        self.lm_head = _linear(model.lm_head)

    @classmethod
    def of(cls, model: nn.Module, model_parts: tuple[type[nn.Module], ...]) -> GPTDecoder | None:
        """The decoder of ``model`` (whose own module classes are ``model_parts``), or None where
        it would not compute what the modules do (see the module's docstring)."""
        return cls(model) if _is_plain(model, model_parts) else None

    def __call__(self, tokens: torch.Tensor, step: CacheStep) -> torch.Tensor:
        """Logits [B, 1, vocab] of ``tokens`` [B, 1], one per row, after what the rows' slots
        hold (``step``: a begun decoding step, not a fresh one). The model must be in eval mode."""
        batch = tokens.shape[0]
        # Rows as [B, C] throughout: the linears see the same [B, C] matrices as through the modules.
        x = F.embedding(tokens.view(batch), self.tok_emb) + F.embedding(step.positions.view(batch), self.pos_emb)
        width = x.shape[1]
        head_dim = width // self.n_head
        for index, block in enumerate(self.blocks):
            qkv = F.linear(block.ln_1(x), *block.qkv)
            # The projection's columns are q, k, v, each heads x head_dim: k and v side by side
            # are one (B, 1, 2, heads, head_dim) entry of the cache.
            step.store(index, qkv[:, width:].view(batch, 1, 2, self.n_head, head_dim))
            attended = step.read(index, qkv[:, :width].view(batch, self.n_head, 1, head_dim))
            x = x + F.linear(attended.reshape(batch, width), *block.attn_proj)
            hidden = F.gelu(F.linear(block.ln_2(x), *block.fc), approximate="tanh")
            x = x + F.linear(hidden, *block.mlp_proj)
        return F.linear(self.ln_f(x), *self.lm_head).view(batch, 1, -1)

    def every_slot(self, tokens: torch.Tensor, positions: torch.Tensor, stepped: torch.Tensor,
                   cache: KVCache) -> torch.Tensor:
        """Logits [slots, vocab] of one new token in every slot of ``cache``: ``tokens`` [slots]
        at ``positions`` [slots], each attending to its slot up to its position; only the slots
        where ``stepped`` [slots] (bool) is true keep their new keys and values, the others are
        left as they were. All on the cache's device. Every shape is the cache's, whatever rows
        a step asks for, and nothing here reads a tensor back to the host: the step a CUDA graph
        captures (``models.decode_graph``)."""
        count, width = tokens.shape[0], self.tok_emb.shape[1]
        head_dim = width // self.n_head
        everyone = torch.arange(count, device=tokens.device)
        keep = stepped.view(count, 1, 1, 1)
        # [slots, 1, 1, max_length]: each slot sees its positions up to the new token's.
        visible = torch.arange(cache.max_length, device=tokens.device) <= positions[:, None]
        mask = torch.zeros(visible.shape, dtype=cache.dtype, device=tokens.device)
        mask = mask.masked_fill_(~visible, float("-inf"))[:, None, None]
        x = F.embedding(tokens, self.tok_emb) + F.embedding(positions, self.pos_emb)
        for index, block in enumerate(self.blocks):
            qkv = F.linear(block.ln_1(x), *block.qkv)
            kv = qkv[:, width:].view(count, 2, self.n_head, head_dim).to(cache.dtype)
            stored = cache.by_position[index]
            stored.index_put_((everyone, positions), torch.where(keep, kv, stored[everyone, positions]))
            q = qkv[:, :width].view(count, self.n_head, 1, head_dim)
            attended = F.scaled_dot_product_attention(q, cache.keys[index].to(q.dtype),
                                                      cache.values[index].to(q.dtype), attn_mask=mask.to(q.dtype))
            x = x + F.linear(attended.reshape(count, width), *block.attn_proj)
            hidden = F.gelu(F.linear(block.ln_2(x), *block.fc), approximate="tanh")
            x = x + F.linear(hidden, *block.mlp_proj)
        return F.linear(self.ln_f(x), *self.lm_head)
