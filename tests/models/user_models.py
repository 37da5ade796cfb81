"""Models meshyard has never seen, as users bring them (``model.name = "<this file>:<builder>"``).

- ``nanogpt``: the nanoGPT layout: a ModuleDict ``transformer`` holding the embeddings
  (``wte``, ``wpe``), a ModuleList ``h`` of blocks and ``ln_f``; fused ``c_attn``,
  ``c_proj``, ``c_fc``; a forward that loops over its blocks; tied head.
- ``untraceable``: the nanoGPT with a forward that branches on a tensor's value, which
  pipeline parallelism (it traces the forward) must refuse.
- ``hf_gpt2`` and ``hf_llama``: Hugging Face ``transformers`` models built from a tiny
  config (random init, no download); they return a ``ModelOutput`` with ``.logits``.
- ``hf_opt`` (q_proj/k_proj/v_proj/out_proj, fc1/fc2, learned positions, tied head; its
  default dropout 0.1 unless ``dropout`` says otherwise) and ``hf_neox`` (a fused
  query_key_value laid out per head, parallel residual): Hugging Face models whose
  configs publish their own tensor- and pipeline-parallel plans (NeoX) or none (OPT).
- ``hf_mistral``: a Llama-style model whose attention keeps to a ``sliding_window`` of
  recent tokens when one is given.
- ``broken_forward``: raises a ValueError in its forward (from a helper function), on
  every rank or only on ``rank``: how a failing worker is reported.

Builders take the keywords meshyard offers (``vocab_size``, ``context_length``).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        head_dim = self.n_embd // self.n_head
        q, k, v = (t.view(B, T, self.n_head, head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_embd)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 4, n_head: int = 4, n_embd: int = 32,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nanogpt(vocab_size: int, context_length: int, n_layer: int = 4, n_head: int = 4, n_embd: int = 32) -> nn.Module:
    return NanoGPT(vocab_size, context_length, n_layer=n_layer, n_head=n_head, n_embd=n_embd)


class Untraceable(NanoGPT):
    """A nanoGPT whose forward branches on a tensor's value: torch.export cannot trace it."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = super().forward(idx)
        if logits.mean() > 0:  # data-dependent control flow
            return logits
        return -logits


def untraceable(vocab_size: int, context_length: int, n_layer: int = 4) -> nn.Module:
    return Untraceable(vocab_size, context_length, n_layer=n_layer)


def hf_gpt2(vocab_size: int, context_length: int, n_layer: int = 4) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=context_length, n_embd=32, n_layer=n_layer, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        use_cache=False)
    return GPT2LMHeadModel(config)


def hf_llama(vocab_size: int, context_length: int, n_layer: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context_length,
                         bos_token_id=0, eos_token_id=0, use_cache=False,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def hf_mistral(vocab_size: int, context_length: int, n_layer: int = 2, sliding_window: int | None = None) -> nn.Module:
    """A Llama-style model whose attention may keep to a sliding window of recent tokens."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context_length,
                           sliding_window=sliding_window, bos_token_id=0, eos_token_id=0, use_cache=False)
    return MistralForCausalLM(config)


def hf_opt(vocab_size: int, context_length: int, n_layer: int = 2, dropout: float = 0.1) -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=vocab_size, hidden_size=32, ffn_dim=64, num_hidden_layers=n_layer,
                       num_attention_heads=4, max_position_embeddings=context_length, word_embed_proj_dim=32,
                       dropout=dropout, pad_token_id=1, bos_token_id=0, eos_token_id=0, use_cache=False)
    return OPTForCausalLM(config)


def hf_neox(vocab_size: int, context_length: int, n_layer: int = 2, tp_style: str = "") -> nn.Module:
    """``tp_style``: another style for query_key_value in the config's tensor-parallel plan."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
                           num_attention_heads=4, max_position_embeddings=context_length, bos_token_id=0,
                           eos_token_id=0, use_cache=False)
    if tp_style:
        config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.attention.query_key_value": tp_style}
    return GPTNeoXForCausalLM(config)


def _check_batch(x: torch.Tensor) -> torch.Tensor:
    raise ValueError(f"broken on purpose: a batch of shape {tuple(x.shape)}\nsecond line, not shown on the console")


class BrokenForward(nn.Module):
    """Fails in its forward, from a helper function, on every rank or only on ``rank``."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 8)
        self.head = nn.Linear(8, vocab_size)
        self.rank = rank

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        if self.rank < 0 or str(self.rank) == os.environ.get("RANK", "0"):
            x = _check_batch(x)
        return self.head(x)


def broken_forward(vocab_size: int, rank: int = -1) -> nn.Module:
    return BrokenForward(vocab_size, rank)
