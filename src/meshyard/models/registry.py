"""Model names accepted in ``model.name`` and how each is built (the config edge)."""

from __future__ import annotations

from torch import nn

from meshyard.config.sections import ModelConfig
from meshyard.models.dropout import switch_off_dropout
from meshyard.models.gpt import GPT, GPT_PRESETS, GPTShape
from meshyard.models.hf_auto import HF_MODEL, build_hf_model
from meshyard.models.mlp import MLP
from meshyard.models.moe import MoEShape
from meshyard.plugins import call_with_accepted, is_custom_reference, load_callable

MODEL_NAMES = (*GPT_PRESETS, "gpt", "mlp", HF_MODEL)


def model_vocab(cfg: ModelConfig, vocab_size: int) -> int:
    """The model's vocabulary: ``model.vocab_size``, else the data's ``vocab_size``, rounded
    up to a multiple of ``model.pad_vocab_multiple`` when that is set. Rounding a rounded
    size changes nothing, so a server may pass the model's or the data's vocabulary."""
    vocab = cfg.vocab_size or vocab_size
    multiple = cfg.pad_vocab_multiple
    return -(-vocab // multiple) * multiple if multiple > 0 else vocab


def gpt_shape(cfg: ModelConfig, vocab_size: int, seq_len: int) -> GPTShape:
    """Resolve a preset plus explicit overrides into a concrete ``GPTShape``."""
    preset = GPT_PRESETS.get(cfg.name, GPT_PRESETS["gpt-tiny"])
    return GPTShape(
        vocab_size=model_vocab(cfg, vocab_size),
        context_length=cfg.context_length or seq_len,
        n_layer=cfg.n_layer or preset["n_layer"],
        n_head=cfg.n_head or preset["n_head"],
        d_model=cfg.d_model or preset["d_model"],
        dropout=cfg.dropout,
        tie_embeddings=cfg.tie_embeddings,
        moe=moe_shape(cfg),
    )


def moe_shape(cfg: ModelConfig) -> MoEShape | None:
    """The experts ``model.moe_*`` configure, or None for a dense model."""
    if cfg.moe_experts <= 0:
        return None
    return MoEShape(experts=cfg.moe_experts, top_k=cfg.moe_top_k, shared_experts=cfg.moe_shared_experts,
                    capacity_factor=cfg.moe_capacity_factor, aux_loss_weight=cfg.moe_aux_loss_weight,
                    z_loss_weight=cfg.moe_z_loss_weight)


def build_model(cfg: ModelConfig, vocab_size: int, seq_len: int) -> nn.Module:
    """Build the configured model on the current default device.

    A custom builder gets the keywords it declares among ``vocab_size``,
    ``context_length`` and ``config`` (the ``ModelConfig``), plus ``model.options``.
    ``hf`` is built from the config.json in ``model.init_from`` (its own vocabulary).
    With ``model.no_dropout`` every dropout rate of the built model is set to 0.
    """
    model = _build(cfg, vocab_size, seq_len)
    if cfg.no_dropout:
        switch_off_dropout(model)
    return model


def _build(cfg: ModelConfig, vocab_size: int, seq_len: int) -> nn.Module:
    vocab = model_vocab(cfg, vocab_size)
    if is_custom_reference(cfg.name):
        builder = load_callable(cfg.name)
        offered = {"vocab_size": vocab, "context_length": cfg.context_length or seq_len, "config": cfg}
        model = call_with_accepted(builder, offered, dict(cfg.options))
        if not isinstance(model, nn.Module):
            raise TypeError(f"model builder '{cfg.name}' returned {type(model).__name__}, not an nn.Module")
        return model
    if cfg.name == HF_MODEL:
        return build_hf_model(cfg.init_from)
    if cfg.name == "mlp":
        return MLP(vocab_size=vocab, d_model=cfg.d_model or 128, n_layer=cfg.n_layer or 2)
    return GPT(gpt_shape(cfg, vocab_size, seq_len))
