"""``meshyard export``: every format checked against eager on held-out data, INT8 held to
its loss gate, and nothing written when a check fails.

One tiny run is trained for the module (longer than the serving tests' run, so that the
model has learnt something INT8 can lose, and with a held-out split of several samples);
each format is exported once as INT8, which also writes and checks its float32 export
first (the figures land in the sidecar).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshyard.cli import main
from meshyard.export.exporter import ExportRefused, ExportRequest, check_int8_loss, check_parity
from meshyard.export.parity import compare, held_out
from meshyard.export.quantize import linears_to_quantize, quantize_linears
from meshyard.inference.int8 import int8_entries, quantized_linears, set_int8_entries
from meshyard.inference.loading import describe, load_engine
from tests.trained_runs import CORPUS_TEXT, train

FILES = {"safetensors": "model.safetensors", "torchscript": "model.pt", "onnx": "model.onnx"}


def run_export(*argv: str) -> int:
    return main(["export", *argv])


def sidecar(path: Path) -> dict:
    return json.loads(Path(f"{path}.json").read_text())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-tiny on byte text, 40 steps, a tenth of the samples held out."""
    folder = tmp_path_factory.mktemp("export-run")
    corpus = folder / "corpus.txt"
    corpus.write_text(CORPUS_TEXT)
    return train(folder, "--model.name=gpt-tiny", "--data.source=text", f"--data.paths=['{corpus}']",
                 "--data.val_fraction=0.1", "--train.steps=40", "--optim.warmup_steps=4")


@pytest.fixture(scope="module")
def int8_exports(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("int8")
    paths = {fmt: folder / name for fmt, name in FILES.items()}
    for fmt, path in paths.items():
        assert run_export(str(run_dir), "--format", fmt, "--int8", "--out", str(path)) == 0
    return paths


@pytest.fixture(scope="module")
def eager(run_dir: Path):
    return load_engine(describe(str(run_dir)))


@pytest.mark.parametrize("fmt", list(FILES))
def test_float32_export_matches_eager_on_held_out_data(fmt, int8_exports):
    parity = sidecar(int8_exports[fmt])["parity"]
    assert parity["max_abs_logit_diff"] <= 1e-4
    assert abs(parity["loss_change"]) <= 1e-5
    assert 0.5 < parity["eager_loss"] < 5.0  # trained below the uniform 5.55 on held-out bytes
    if fmt == "safetensors":  # the same eager module on the same weights
        assert parity["max_abs_logit_diff"] == 0.0


@pytest.mark.parametrize("fmt", list(FILES))
def test_int8_export_passes_the_loss_gate_and_is_smaller(fmt, int8_exports):
    facts = sidecar(int8_exports[fmt])
    check = facts["int8_check"]
    assert facts["int8"] is True and facts["version"].endswith(f".{fmt}.int8")
    assert check["relative_loss_change"] <= 0.02
    assert check["max_abs_logit_diff"] > 0  # it is quantized: not the float32 model any more
    assert check["int8_bytes"] == int8_exports[fmt].stat().st_size
    # gpt-tiny: 100k of its 120k parameters are in linear layers (the tied head stays float32)
    assert check["size_ratio"] > 1.7
    assert check["fp32_seconds"] > 0 and check["int8_seconds"] > 0


def test_sidecar_describes_the_export(int8_exports, run_dir):
    run = describe(str(run_dir))
    facts = sidecar(int8_exports["onnx"])
    assert {k: facts[k] for k in ("format", "vocab_size", "context_length", "tokenizer", "name")} == {
        "format": "onnx", "vocab_size": 256, "context_length": 64, "tokenizer": "bytes", "name": "tiny"}
    assert facts["version"] == f"{run.version}.onnx.int8" and facts["source"] == run.checkpoint
    assert facts["config"]["model"]["name"] == "gpt-tiny" and facts["opset"] >= 17


def test_int8_safetensors_holds_int8_linears_and_keeps_the_head_tied(int8_exports, eager):
    from safetensors import safe_open

    with safe_open(str(int8_exports["safetensors"]), framework="pt") as f:
        dtypes = {key: f.get_tensor(key).dtype for key in f.keys()}
    int8 = sorted(key.removesuffix(".weight_int8") for key, dtype in dtypes.items() if dtype == torch.int8)
    assert int8 == sorted(f"blocks.{i}.{layer}" for i in range(2) for layer in ("attn.qkv", "attn.proj", "mlp.fc",
                                                                               "mlp.proj"))
    assert dtypes["tok_emb.weight"] == torch.float32 and not any(k.startswith("lm_head") for k in dtypes)
    reloaded = load_engine(describe(str(int8_exports["safetensors"])), "eager").module
    assert reloaded.lm_head.weight is reloaded.tok_emb.weight
    tokens = torch.arange(3 * 40).reshape(3, 40) % 256
    with torch.inference_mode():  # the same int8 model as quantizing the eager one here
        assert torch.equal(reloaded(tokens), quantize_linears(eager.module)(tokens))


@pytest.mark.parametrize("fmt, runtime", [("torchscript", "torchscript"), ("onnx", "onnxruntime")])
def test_int8_engine_stays_near_eager(fmt, runtime, int8_exports, eager):
    engine = load_engine(describe(str(int8_exports[fmt])), runtime)
    prompts = [[72, 101, 108, 108, 111], list(range(40, 100))]
    got, expected = engine.next_token_logits(prompts), eager.next_token_logits(prompts)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_a_corrupted_int8_model_is_refused_by_the_gate(run_dir, eager):
    """The gate on real int8 models: the correct one passes, one whose weight scales were
    corrupted (x30 in every layer) is refused at the default 2%."""
    held = held_out(describe(str(run_dir)).config.data, batches=2)
    request = ExportRequest(str(run_dir), "torchscript", Path("never.pt"), int8=True)
    good = quantize_linears(eager.module)
    check_int8_loss(request, compare(eager.forward, good, held))
    bad = quantize_linears(eager.module)
    for layer in quantized_linears(bad).values():
        entries = int8_entries(layer)
        set_int8_entries(layer, {**entries, "weight_scale": entries["weight_scale"] * 30})
    parity = compare(eager.forward, bad, held)
    with pytest.raises(ExportRefused, match="INT8 torchscript export loses too much accuracy"):
        check_int8_loss(request, parity)
    with pytest.raises(ExportRefused, match="differ by up to"):  # nor would it pass as a float32 export
        check_parity(ExportRequest(str(run_dir), "torchscript", Path("never.pt")), parity)


def test_nan_logits_and_a_shape_fixed_export_are_refused_not_passed(run_dir, eager):
    held = held_out(describe(str(run_dir)).config.data, batches=1)
    request = ExportRequest(str(run_dir), "torchscript", Path("never.pt"))
    check_parity(request, compare(eager.forward, eager.forward, held))  # the same model passes

    def nan_logits(tokens: torch.Tensor) -> torch.Tensor:
        return eager.forward(tokens).masked_fill(tokens[..., None] == tokens[0, 0], float("nan"))

    example_shape = held.batches[0][0].shape

    def fixed_shape(tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape != example_shape:
            raise RuntimeError(f"expected input of shape {tuple(example_shape)}")
        return eager.forward(tokens)

    for broken in (nan_logits, fixed_shape):
        with pytest.raises(ExportRefused, match="non-finite logits, logits of another shape, or failed"):
            check_parity(request, compare(eager.forward, broken, held))


def test_refused_export_leaves_nothing_behind(run_dir, tmp_path, capsys):
    out = tmp_path / "refused.safetensors"
    # An INT8 model cannot be 50% better than float32: the gate must refuse.
    assert run_export(str(run_dir), "--format", "safetensors", "--int8", "--max-loss-increase=-0.5",
                      "--out", str(out)) == 1
    captured = capsys.readouterr()
    assert "refused" in captured.err and "--max-loss-increase" in captured.err
    assert "max |logit diff|" in captured.out and "smaller" in captured.out  # the figures were printed
    assert list(tmp_path.iterdir()) == []  # no export, no sidecar, no scratch folder


@pytest.mark.parametrize("argv, problem", [
    (["--format", "onnx", "--out", "{tmp}/model.pt"], "does not end in .onnx"),
    (["--format", "torchscript", "--out", "{tmp}/model.pt", "--batches", "0"], "--batches"),
])
def test_bad_arguments_exit_2_with_one_paragraph(argv, problem, run_dir, tmp_path, capsys):
    assert run_export(str(run_dir), *[a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert problem in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_exporting_an_export_or_nothing_is_bad_input(int8_exports, tmp_path, capsys):
    assert run_export(str(int8_exports["onnx"]), "--format", "onnx", "--out", str(tmp_path / "again.onnx")) == 2
    assert "already an export" in capsys.readouterr().err
    assert run_export(str(tmp_path / "missing"), "--format", "onnx", "--out", str(tmp_path / "x.onnx")) == 2
    assert "does not exist" in capsys.readouterr().err


def test_only_a_tied_head_is_left_in_float32():
    from meshyard.models.gpt import GPT, GPTShape

    tied = GPT(GPTShape(vocab_size=64, context_length=16, n_layer=1, n_head=2, d_model=16))
    untied = GPT(GPTShape(vocab_size=64, context_length=16, n_layer=1, n_head=2, d_model=16, tie_embeddings=False))
    blocks = ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj"]
    assert linears_to_quantize(tied) == blocks
    assert linears_to_quantize(untied) == [*blocks, "lm_head"]
    assert sorted(quantized_linears(quantize_linears(untied))) == sorted([*blocks, "lm_head"])
