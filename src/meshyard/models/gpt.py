"""A GPT-2 style decoder-only transformer, written as a plain ``nn.Module``.

The module never imports ``torch.distributed``: parallelism is applied to it from the
outside (``meshyard.parallel``). Parameter names are stable (``blocks.<i>.attn.qkv``,
``blocks.<i>.mlp.fc`` ...) so checkpoints move between layouts, and every block is a
separate child in ``blocks`` so sharding can wrap them one by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshyard.models.decode_graph import DecodeGraph
from meshyard.models.gpt_decoding import GPTDecoder
from meshyard.models.kv_cache import CacheStep, KVCache, SlotIndex, planless_attention
from meshyard.models.linear_cross_entropy import linear_cross_entropy
from meshyard.models.moe import GroupedExperts, MoEFeedForward, MoEShape


@dataclass(frozen=True)
class GPTShape:
    """Architecture of a GPT: everything needed to build it and to count its cost."""

    vocab_size: int
    context_length: int
    n_layer: int
    n_head: int
    d_model: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    bias: bool = True
    moe: MoEShape | None = None
    """Mixture of experts in place of every block's dense feed-forward (None: dense)."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


# Presets from a test-sized toy up to GPT-2 small (124M parameters with the GPT-2
# vocabulary of 50257 and tied embeddings). Vocabulary and context come from the data.
GPT_PRESETS: dict[str, dict[str, int]] = {
    "gpt-tiny": {"n_layer": 2, "n_head": 2, "d_model": 64},
    "gpt-mini": {"n_layer": 4, "n_head": 4, "d_model": 128},
    "gpt-small": {"n_layer": 6, "n_head": 6, "d_model": 384},
    "gpt-medium": {"n_layer": 8, "n_head": 8, "d_model": 512},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "d_model": 768},
}


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal scaled dot-product attention of (B, heads, T, head_dim) queries, keys and values."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        if shape.d_model % shape.n_head != 0:
            raise ValueError(f"d_model={shape.d_model} is not divisible by n_head={shape.n_head}")
        self.n_head = shape.n_head
        self.dropout = shape.dropout
        self.qkv = nn.Linear(shape.d_model, 3 * shape.d_model, bias=shape.bias)
        self.proj = nn.Linear(shape.d_model, shape.d_model, bias=shape.bias)
        self.resid_dropout = nn.Dropout(shape.dropout)
        # How the attention of whole sequences is computed; context parallelism replaces it
        # with a ring over the ranks that hold the rest of each sequence.
        self.attend = causal_attention

    def forward(self, x: torch.Tensor, cache: tuple[CacheStep, int] | None = None) -> torch.Tensor:
        """Causal attention over ``x``; with ``cache`` = (step, layer index), over what the
        cache's slots hold before ``x`` too (incremental decoding, see ``models.kv_cache``)."""
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # (B, T, C) -> (B, heads, T, head_dim); -1 keeps this valid when heads are split
        # across tensor-parallel ranks and each rank holds only some of them.
        q, k, v = (t.view(batch, seq, -1, x.shape[-1] // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is None:
            y = self.attend(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        else:
            y = cache[0].attend(cache[1], q, k, v)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.proj(y))


class FeedForward(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        hidden = shape.mlp_ratio * shape.d_model
        self.fc = nn.Linear(shape.d_model, hidden, bias=shape.bias)
        self.proj = nn.Linear(hidden, shape.d_model, bias=shape.bias)
        self.dropout = nn.Dropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.d_model, bias=shape.bias)
        self.attn = CausalSelfAttention(shape)
        self.ln_2 = nn.LayerNorm(shape.d_model, bias=shape.bias)
        self.mlp: nn.Module = (FeedForward(shape) if shape.moe is None
                               else MoEFeedForward(shape.moe, shape.d_model, shape.mlp_ratio * shape.d_model))

    def forward(self, x: torch.Tensor, cache: tuple[CacheStep, int] | None = None) -> torch.Tensor:
        # Without a cache the attention gets its one positional input, as tensor-parallel
        # input hooks (PrepareModuleInput) expect.
        attended = self.attn(self.ln_1(x)) if cache is None else self.attn(self.ln_1(x), cache=cache)
        x = x + attended
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer returning next-token logits of shape (B, T, vocab).

    Implements the KV-cache protocol of ``meshyard.models.kv_cache``: ``init_kv_cache`` and
    ``forward(tokens, cache=..., slots=..., positions=...)`` for incremental decoding."""

    fuses_head_loss = True
    """``forward(tokens, targets=...)`` returns the mean next-token loss, computed from the
    final hidden states with the head's weight by ``linear_cross_entropy``, without logits."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.d_model)
        self.pos_emb = nn.Embedding(shape.context_length, shape.d_model)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.d_model, bias=shape.bias)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()
        # The decoding step on the parameters, made with each KV cache (see models.gpt_decoding).
        self._decoder: GPTDecoder | None = None

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        residual_std = 0.02 / math.sqrt(2 * self.shape.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(std=0.02, residual_std=residual_std)

    def init_kv_cache(self, batch_slots: int, max_length: int | None = None, dtype: torch.dtype | None = None,
                      device: torch.device | str | None = None) -> KVCache:
        """An empty cache of ``batch_slots`` sequences of up to ``max_length`` tokens (default:
        the context length), in the dtype and on the device of the weights unless given."""
        max_length = self.shape.context_length if max_length is None else max_length
        if max_length > self.shape.context_length:
            raise ValueError(f"a KV cache of max_length={max_length} is longer than the model's context_length="
                             f"{self.shape.context_length}: positions beyond it have no embedding; use at most "
                             f"{self.shape.context_length}")
        weight = self.tok_emb.weight
        # Made with the cache, not once for all: a model whose layers changed since (int8,
        # parallelism) decodes as it now is with its next cache.
        self._decoder = GPTDecoder.of(self, (GPT, Block, CausalSelfAttention, FeedForward))
        return KVCache(self.shape.n_layer, batch_slots, self.shape.n_head, max_length, self.shape.head_dim,
                       dtype=dtype or weight.dtype, device=device or weight.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, slots: SlotIndex | None = None,
                positions: SlotIndex | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) of ``tokens`` (B, T). Without ``cache``: the whole sequences from
        position 0 (training); given their ``targets`` (B, T), the mean next-token loss instead
        of the logits (``fuses_head_loss``). With ``cache``: the new tokens of each row, appended
        to its slot (or written at ``positions``), attending to what the slot holds (see
        ``models.kv_cache``)."""
        if targets is not None and (cache is not None or targets.shape != tokens.shape):
            raise ValueError(f"targets of shape {tuple(targets.shape)} for tokens of shape {tuple(tokens.shape)}"
                             f"{' with a KV cache' if cache is not None else ''}: the loss is computed for whole "
                             "sequences from position 0 (training), one target per token")
        if cache is not None:
            with planless_attention(cache.device):
                return self._forward_cached(tokens, cache, slots, positions)
        seq = tokens.shape[1]
        if seq > self.shape.context_length:
            raise ValueError(f"sequence of {seq} tokens exceeds context_length={self.shape.context_length}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None:
            return linear_cross_entropy(x.reshape(-1, x.shape[-1]), self.lm_head.weight, targets.reshape(-1))
        return self.lm_head(x)

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache, slots: SlotIndex | None,
                        positions: SlotIndex | None) -> torch.Tensor:
        """The forward of new tokens against a KV cache (one step of incremental decoding)."""
        if (cache.every_slot_steps and self._decoder is not None and tokens.shape[1] == 1 and positions is None
                and not self.training):
            return self._decode_every_slot(tokens, cache, slots)
        step = cache.begin(slots, positions, tokens.shape[1])
        if self._decoder is not None and tokens.shape[1] == 1 and not step.fresh and not self.training:
            return self._decoder(tokens, step)  # the same step without module calls
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(step.positions))
        for index, block in enumerate(self.blocks):
            x = block(x, (step, index))
        return self.lm_head(self.ln_f(x))

    def _decode_every_slot(self, tokens: torch.Tensor, cache: KVCache, slots: SlotIndex | None) -> torch.Tensor:
        """A decoding step computed over every slot of ``cache`` in fixed shapes, replayed from a
        CUDA graph on a GPU (see ``KVCache.every_slot_steps``); logits (B, 1, vocab) of the rows."""
        slot_ids = torch.as_tensor(range(cache.batch_slots) if slots is None else slots, dtype=torch.long).cpu()
        positions, stepped = cache.begin_every_slot(slot_ids)
        if not isinstance(cache.step_graph, DecodeGraph):
            # The decoder's own method, which holds its weights but not the cache (see DecodeGraph).
            cache.step_graph = DecodeGraph(self._decoder.every_slot, cache)
        logits = cache.step_graph(tokens[:, 0], slot_ids, positions, stepped)
        return logits.view(tokens.shape[0], 1, -1)
