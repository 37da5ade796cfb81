"""A model builder that breaks tensor parallelism on purpose: the fused q/k/v projection
split column-wise in plain blocks, so rank 0 computes all of q and half of k."""

from __future__ import annotations

from torch import nn


def build(vocab_size: int, context_length: int) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel

    from meshyard.models.gpt import GPT, GPTShape
    from meshyard.parallel import tensor_parallel

    # Runs in each worker before parallelize(): every later TP plan of this process
    # uses the naive split for attn.qkv.
    tensor_parallel.FusedQKVParallel = ColwiseParallel
    return GPT(GPTShape(vocab_size=vocab_size, context_length=context_length, n_layer=2, n_head=2, d_model=64))
