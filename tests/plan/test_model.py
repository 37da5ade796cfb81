"""The model description: exact parameter counts, FLOPs and saved activations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshyard.config.sections import ModelConfig
from meshyard.models.gpt import GPT, GPT_PRESETS, GPTShape
from meshyard.plan.model import describe_gpt
from meshyard.plan.trace import describe_config, describe_module

SHAPES = [
    *(GPTShape(vocab_size=256, context_length=128, **preset) for preset in GPT_PRESETS.values()),
    GPTShape(vocab_size=50257, context_length=1024, n_layer=12, n_head=12, d_model=768),
    GPTShape(vocab_size=1000, context_length=64, n_layer=3, n_head=4, d_model=96, tie_embeddings=False),
    GPTShape(vocab_size=300, context_length=32, n_layer=2, n_head=2, d_model=32, bias=False, mlp_ratio=3),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s.n_layer}d{s.d_model}v{s.vocab_size}")
def test_parameter_count_matches_the_built_model_exactly(shape):
    with torch.device("meta"):
        model = GPT(shape)
    desc = describe_gpt(shape)
    assert desc.n_params == sum(p.numel() for p in model.parameters())
    assert desc.layer_params == sum(p.numel() for p in model.blocks[0].parameters())
    assert desc.largest_param == max(p.numel() for p in model.parameters())


def test_forward_flops_match_the_flop_counter():
    """2 FLOPs per matmul weight per token plus attention's QK^T and AV (4 T d per layer)."""
    shape = GPTShape(vocab_size=512, context_length=64, n_layer=2, n_head=4, d_model=128)
    with torch.device("meta"):
        model = GPT(shape)
        tokens = torch.zeros(2, 64, dtype=torch.long)
    counter = torch.utils.flop_counter.FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(tokens)  # on meta, attention decomposes into the two counted matmuls
    desc = describe_gpt(shape)
    assert counter.get_total_flops() == pytest.approx(desc.forward_flops_per_token(64) * 2 * 64)
    assert desc.training_flops_per_token(64) == 3 * desc.forward_flops_per_token(64)


def test_six_n_plus_attention_for_gpt2():
    """PaLM's 6N + 12 L d T, where N counts the matmul weights (the head included)."""
    desc = describe_gpt(GPTShape(vocab_size=50257, context_length=1024, n_layer=12, n_head=12, d_model=768))
    matmul = 12 * 12 * 768**2 + 50257 * 768
    assert desc.training_flops_per_token(1024) == 6 * matmul + 12 * 12 * 768 * 1024


def test_activation_profile_matches_autograd_saved_tensors():
    """16 d_model units per token per layer (+ fp32 norm statistics and log-sum-exp), as
    autograd saves them on CPU; the tracer sees the same from a meta-built model."""
    shape = GPTShape(vocab_size=256, context_length=128, n_layer=2, n_head=2, d_model=64)
    desc = describe_gpt(shape)
    with torch.device("meta"):
        traced = describe_module(GPT(shape), seq_len=128)
    extras = (desc.activations.fp32_bytes_per_token + desc.activations.fp32_bytes_per_token_sharded) / (4 * 64)
    assert desc.activations.total_units == 16
    assert traced.activations.replicated == pytest.approx(16 + extras)
    assert traced.n_params == desc.n_params
    assert traced.layer_forward_flops_per_token(128) == desc.layer_forward_flops_per_token(128)
    assert traced.head_forward_flops_per_token() == desc.head_forward_flops_per_token()
    assert desc.fuses_head_loss and traced.fuses_head_loss  # meshyard's GPT, described or traced


def test_real_forward_saves_what_the_closed_form_counts():
    shape = GPTShape(vocab_size=256, context_length=64, n_layer=2, n_head=2, d_model=64)
    model = GPT(shape)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, 256, (4, 65))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 256), tokens[:, 1:].reshape(-1))
    desc = describe_gpt(shape)
    t = 4 * 64
    per_layer = desc.activations.total_units * 64 * 4 + desc.activations.fp32_bytes_per_token \
        + desc.activations.fp32_bytes_per_token_sharded
    # Two blocks, final norm in/out (+ its fp32 statistics), token ids and targets (int64),
    # the fp32 log-softmax, and the position ids of one sequence.
    expected = t * (2 * per_layer + desc.head_saved_units * 64 * 4 + 8 + 8 + 8 + 256 * 4) + 64 * 8
    assert sum(saved.values()) == pytest.approx(expected, rel=1e-4)


def test_describe_config_uses_the_registry_shapes():
    desc = describe_config(ModelConfig(name="gpt-mini"), vocab_size=256, seq_len=128)
    with torch.device("meta"):
        model = GPT(GPTShape(vocab_size=256, context_length=128, **GPT_PRESETS["gpt-mini"]))
    assert desc.n_params == sum(p.numel() for p in model.parameters())
    assert desc.tp_capable


def test_describe_config_traces_other_models():
    from meshyard.models.mlp import MLP

    desc = describe_config(ModelConfig(name="mlp", n_layer=3, d_model=64), vocab_size=256, seq_len=32)
    assert desc.n_params == sum(p.numel() for p in MLP(256, 64, 3).parameters())
    assert desc.n_layer == 3 and not desc.tp_capable and not desc.fuses_head_loss
    assert desc.vocab_size == 256 and desc.d_model == 64


def test_a_users_model_is_traced_by_its_repeated_blocks_wherever_they_sit():
    from tests.models.user_models import nanogpt

    with torch.device("meta"):
        model = nanogpt(vocab_size=256, context_length=32, n_layer=3)
    described = describe_module(model, seq_len=32)
    assert described.n_layer == 3 and described.traced_layer_flops > 0


def test_a_forward_that_reads_values_is_refused_with_what_to_do():
    class ReadsValues(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
                                               for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            if h.sum().item() > 0:  # data-dependent: no value on the meta device
                h = h * 2
            for block in self.blocks:
                h = block(h)
            return h

    from meshyard.plan.trace import TraceError

    with torch.device("meta"):
        model = ReadsValues()
    with pytest.raises(TraceError, match=r"\.item\(\).*plan a GPT of the same size"):
        describe_module(model, seq_len=8, name="reads-values", make_input=lambda b, s, d: torch.zeros(
            b, s, dtype=torch.long, device=d))
