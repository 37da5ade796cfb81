"""Closed-form counts of meshyard's GPT: exact parameters, PaLM FLOPs, and no torch needed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import meshyard.models.flops as flops
from meshyard.models.flops import gpt_counts, gpt_training_flops_per_token
from meshyard.models.gpt import GPT, GPTShape

SHAPES = [
    GPTShape(vocab_size=256, context_length=64, n_layer=2, n_head=2, d_model=64),
    GPTShape(vocab_size=300, context_length=32, n_layer=3, n_head=2, d_model=32, bias=False, mlp_ratio=3,
             tie_embeddings=False),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_count_is_the_built_models(shape):
    assert gpt_counts(shape).n_params == sum(p.numel() for p in GPT(shape).parameters())


def test_training_flops_are_six_n_plus_attention_for_gpt2():
    shape = GPTShape(vocab_size=50257, context_length=1024, n_layer=12, n_head=12, d_model=768)
    counts = gpt_counts(shape)
    matmul_weights = shape.n_layer * counts.matmul_params_per_layer + counts.head_matmul_params
    expected = 6 * matmul_weights + 12 * shape.n_layer * shape.d_model * 1024
    assert gpt_training_flops_per_token(shape, 1024) == pytest.approx(expected)


def test_the_formulas_import_no_torch():
    tree = ast.parse(Path(flops.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.startswith("torch") for name in imported)
