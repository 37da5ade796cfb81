"""A Hugging Face Llama, built from a config: random initial weights, nothing downloaded.

meshyard trains any ``transformers`` causal LM as it comes: its forward returns a
``ModelOutput`` whose ``logits`` the loss is taken from, FSDP and activation
checkpointing wrap each ``LlamaDecoderLayer``, and tensor and pipeline parallelism
recognise the Llama layout (``q_proj/k_proj/v_proj/o_proj``, ``gate_proj/up_proj/down_proj``).
The same few lines work for ``GPT2LMHeadModel``, ``MistralForCausalLM`` and the like.

Needs the ``transformers`` package (``pip install 'meshyard[hf]'``). Run it with:
    meshyard run examples/hf_llama.toml
"""

from __future__ import annotations

from torch import nn


def build(vocab_size: int, context_length: int, hidden: int = 64, layers: int = 4, heads: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=context_length,
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads // 2,
        # Special token ids inside the vocabulary (transformers warns otherwise); no KV
        # cache, which training never reads.
        bos_token_id=1, eos_token_id=2, use_cache=False,
    )
    return LlamaForCausalLM(config)
