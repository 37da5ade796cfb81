"""meshyard's GPT as Hugging Face's ``GPT2LMHeadModel``: the same architecture (learned
positions, pre-norm LayerNorm with eps 1e-5, tanh GELU, 1/sqrt(head_dim) attention, a head
tied to the token embedding unless ``tie_embeddings`` is off) under other names.

GPT-2 keeps its projections as ``Conv1D`` layers, whose weight is stored (in, out): the
transpose of ``nn.Linear``'s (out, in). Its fused ``c_attn`` splits q, k and v the way
meshyard's ``qkv`` does (three blocks of d_model, heads contiguous within each).
"""

from __future__ import annotations

import re
from typing import Any

from meshyard.models.gpt import GPTShape

GPT2_ARCHITECTURE = "GPT2LMHeadModel"

# meshyard name pattern -> (GPT-2 name template, whether the matrix is transposed)
_NAMES: list[tuple[re.Pattern[str], str, bool]] = [
    (re.compile(r"tok_emb\.weight"), "transformer.wte.weight", False),
    (re.compile(r"pos_emb\.weight"), "transformer.wpe.weight", False),
    (re.compile(r"blocks\.(\d+)\.ln_([12])\.(weight|bias)"), "transformer.h.{0}.ln_{1}.{2}", False),
    (re.compile(r"blocks\.(\d+)\.attn\.qkv\.weight"), "transformer.h.{0}.attn.c_attn.weight", True),
    (re.compile(r"blocks\.(\d+)\.attn\.qkv\.bias"), "transformer.h.{0}.attn.c_attn.bias", False),
    (re.compile(r"blocks\.(\d+)\.attn\.proj\.weight"), "transformer.h.{0}.attn.c_proj.weight", True),
    (re.compile(r"blocks\.(\d+)\.attn\.proj\.bias"), "transformer.h.{0}.attn.c_proj.bias", False),
    (re.compile(r"blocks\.(\d+)\.mlp\.fc\.weight"), "transformer.h.{0}.mlp.c_fc.weight", True),
    (re.compile(r"blocks\.(\d+)\.mlp\.fc\.bias"), "transformer.h.{0}.mlp.c_fc.bias", False),
    (re.compile(r"blocks\.(\d+)\.mlp\.proj\.weight"), "transformer.h.{0}.mlp.c_proj.weight", True),
    (re.compile(r"blocks\.(\d+)\.mlp\.proj\.bias"), "transformer.h.{0}.mlp.c_proj.bias", False),
    (re.compile(r"ln_f\.(weight|bias)"), "transformer.ln_f.{0}", False),
    (re.compile(r"lm_head\.weight"), "lm_head.weight", False),
]


class NotGPT2(ValueError):
    """A meshyard GPT that GPT-2's architecture cannot express."""


def gpt2_config(shape: GPTShape, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``shape`` as a ``GPT2LMHeadModel``."""
    if not shape.bias:
        raise NotGPT2("GPT-2 has biases in every projection and LayerNorm; this GPT was built without them")
    return {
        "architectures": [GPT2_ARCHITECTURE], "model_type": "gpt2",
        "vocab_size": shape.vocab_size, "n_positions": shape.context_length, "n_ctx": shape.context_length,
        "n_embd": shape.d_model, "n_layer": shape.n_layer, "n_head": shape.n_head,
        "n_inner": shape.mlp_ratio * shape.d_model, "activation_function": "gelu_new",
        "resid_pdrop": shape.dropout, "embd_pdrop": shape.dropout, "attn_pdrop": shape.dropout,
        "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
        "tie_word_embeddings": shape.tie_embeddings, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }


def gpt2_name(name: str, tied: bool) -> tuple[str, bool] | None:
    """GPT-2's name for the meshyard GPT tensor ``name`` and whether its matrix is stored
    transposed; None for the head when it is tied (GPT-2 stores the embedding once)."""
    if tied and name == "lm_head.weight":
        return None
    for pattern, template, transposed in _NAMES:
        match = pattern.fullmatch(name)
        if match:
            return template.format(*match.groups()), transposed
    raise NotGPT2(f"'{name}' is not a tensor of meshyard's GPT")
