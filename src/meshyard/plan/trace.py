"""Describe any ``nn.Module`` built on the meta device, by running it without memory.

- Parameters: counted exactly from the module (a tied weight once).
- FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over one forward on meta tensors,
  where attention decomposes into its two matmuls; backward is taken as twice forward.
- Activations: one forward under ``FakeTensorMode`` on a fake CPU copy of the module,
  so the CPU kernels' choices (fused attention without the T x T scores) apply, while
  ``torch.autograd.graph.saved_tensors_hooks`` records every tensor kept for backward.
  Forward hooks on the repeated blocks (the first ``nn.ModuleList``, as meshyard's FSDP
  wrapping uses) attribute each saved tensor to a block or to the rest of the model.

The input is a ``(batch, seq)`` tensor of token ids unless ``make_input`` is given.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from meshyard.config.sections import ModelConfig
from meshyard.models.registry import gpt_shape
from meshyard.plan.model import ActivationProfile, ModelDescription, describe_gpt

InputFactory = Callable[[int, int, torch.device], torch.Tensor]


class TraceError(ValueError):
    """The module cannot be described (no blocks, no way to build an input, ...)."""


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks, found as sharding and checkpointing find them."""
    from meshyard.parallel.units import find_blocks

    return find_blocks(module)


def _token_input(module: nn.Module) -> InputFactory:
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise TraceError("the model has no nn.Embedding to take token ids; pass make_input to describe it")
    vocab = embedding.num_embeddings
    return lambda batch, seq, device: torch.randint(0, vocab, (batch, seq), device=device)


def _count_flops(module: nn.Module, blocks: list[nn.Module], x: torch.Tensor) -> tuple[float, float]:
    """(forward FLOPs inside the blocks, outside them) of one forward on meta tensors."""
    counter = FlopCounterMode(display=False)
    inside = [0.0]
    marks: list[int] = []
    pre = [b.register_forward_pre_hook(lambda *_: marks.append(counter.get_total_flops())) for b in blocks]
    post = [b.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] + counter.get_total_flops()
                                                                    - marks.pop())) for b in blocks]
    try:
        with counter, torch.no_grad():
            module(x)
    except Exception as exc:  # the user's forward: anything it raises on meta tensors
        raise TraceError(f"one forward on the meta device, which counts its FLOPs and saved activations, "
                         f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); a "
                         "forward that reads tensor values (.item(), data-dependent masks) cannot be planned this "
                         "way: plan a GPT of the same size (--model gpt --n-layer/--n-head/--d-model) "
                         "instead") from None
    finally:
        for handle in pre + post:
            handle.remove()
    return inside[0], counter.get_total_flops() - inside[0]


def _saved_bytes(module: nn.Module, blocks: list[nn.Module], make_input: InputFactory, batch: int,
                 seq_len: int) -> tuple[float, float, int, int]:
    """(bytes saved inside blocks, outside them, hidden width, output's last dim), fp32."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = copy.deepcopy(module)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake.to_empty(device="cpu")
        fake_blocks = _blocks(fake)
        params = {p.untyped_storage()._cdata for p in fake.parameters()}
        seen: dict[int, tuple[int, bool]] = {}
        in_block, width = [False], [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in params and storage._cdata not in seen:
                seen[storage._cdata] = (storage.nbytes(), in_block[0])
            return t

        def enter(*_: object) -> None:
            in_block[0] = True

        def leave(_module: nn.Module, _args: object, out: object) -> None:
            in_block[0] = False
            if isinstance(out, torch.Tensor):
                width[0] = out.shape[-1]

        hooks = [b.register_forward_pre_hook(enter) for b in fake_blocks]
        hooks += [b.register_forward_hook(leave) for b in fake_blocks]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fake(make_input(batch, seq_len, torch.device("cpu")))
        for handle in hooks:
            handle.remove()
    inside = sum(n for n, blk in seen.values() if blk)
    outside = sum(n for n, blk in seen.values() if not blk)
    vocab = out.shape[-1] if isinstance(out, torch.Tensor) and out.dim() == 3 else 0
    return float(inside), float(outside), width[0], vocab


def describe_module(module: nn.Module, seq_len: int, name: str = "custom", make_input: InputFactory | None = None,
                    batch: int = 2) -> ModelDescription:
    """Describe ``module`` (on the meta device, or any device: it is copied, never run
    for real) at ``seq_len`` tokens per sample. See the module docstring for how."""
    blocks = _blocks(module)
    if not blocks:
        raise TraceError(f"model '{name}' has no repeated blocks to split into layers")
    make_input = make_input or _token_input(module)
    n_params = sum(p.numel() for p in module.parameters())
    layer_params = round(sum(p.numel() for b in blocks for p in b.parameters()) / len(blocks))
    meta = copy.deepcopy(module).to_empty(device="meta") if next(module.parameters()).device.type != "meta" else module
    inside_flops, outside_flops = _count_flops(meta, _blocks(meta), make_input(batch, seq_len, torch.device("meta")))
    inside, outside, width, vocab = _saved_bytes(module, blocks, make_input, batch, seq_len)
    tokens, n = batch * seq_len, len(blocks)
    unit = 4.0 * width  # traced in fp32: bytes of d_model elements
    return ModelDescription(
        name=name, n_params=n_params, n_layer=n, d_model=width, n_head=0, vocab_size=vocab,
        context_length=seq_len, layer_params=layer_params, embedding_params=n_params - n * layer_params,
        head_params=0, matmul_params_per_layer=0, head_matmul_params=0,
        activations=ActivationProfile(replicated=inside / n / tokens / unit, sharded=0.0,
                                      sp_replicated=inside / n / tokens / unit, fp32_bytes_per_token=0.0,
                                      fp32_bytes_per_token_sharded=0.0, mask_bytes_per_token=0.0),
        head_saved_units=outside / tokens / unit,
        largest_param=max(p.numel() for p in module.parameters()),
        tied_embeddings=False, tp_capable=False, traced_seq_len=seq_len,
        fuses_head_loss=bool(getattr(module, "fuses_head_loss", False)),
        traced_layer_flops=inside_flops / n / tokens, traced_head_flops=outside_flops / tokens,
    )


def describe_config(cfg: ModelConfig, vocab_size: int, seq_len: int) -> ModelDescription:
    """Describe the model a meshyard ``[model]`` section builds: GPT presets and custom
    GPT sizes in closed form, anything else (``mlp``, your own builder) by tracing it
    on the meta device."""
    from meshyard.models.registry import build_model
    from meshyard.plugins import is_custom_reference

    if cfg.name != "mlp" and not is_custom_reference(cfg.name):
        return describe_gpt(gpt_shape(cfg, vocab_size, seq_len), name=cfg.name)
    with torch.device("meta"):
        module = build_model(cfg, vocab_size, seq_len)
    return describe_module(module, seq_len, name=cfg.name)
