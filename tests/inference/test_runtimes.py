"""Exports served through their runtimes answer like the eager model they came from.

The trained run is exported once per module in each format (``meshyard export``); each
export is then described and loaded the way the server does it (``describe`` +
``load_engine`` with the runtime), and its engine is held against the eager engine of
the run's checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshyard.cli import main
from meshyard.inference.engine import EagerEngine
from meshyard.inference.loading import describe, load_engine
from meshyard.inference.runtimes import OnnxEngine, TorchScriptEngine, describe_export
from meshyard.inference.sampling import Sampling
from meshyard.inference.source import ModelSourceError
from meshyard.inference.tokenizer import ByteTokenizer

EXPORTS = {"safetensors": ("model.safetensors", "eager"), "torchscript": ("model.pt", "torchscript"),
           "onnx": ("model.onnx", "onnxruntime")}
PROMPTS = [[72], [72, 101, 108, 108, 111], list(range(30, 70)), [10] * 64]


def run_export(*argv: str) -> int:
    return main(["export", *argv])


@pytest.fixture(scope="module")
def exported(trained_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The trained run's float32 export in every format: format -> path."""
    folder = tmp_path_factory.mktemp("exports")
    paths = {}
    for fmt, (file_name, _) in EXPORTS.items():
        paths[fmt] = folder / file_name
        assert run_export(str(trained_run), "--format", fmt, "--out", str(paths[fmt])) == 0
    return paths


@pytest.fixture(scope="module")
def eager(trained_run: Path) -> EagerEngine:
    return load_engine(describe(str(trained_run)))


def engine_of(path: Path, runtime: str):
    return load_engine(describe(str(path)), runtime)


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    scale = expected.abs().max().item()
    worst = (actual - expected).abs().max().item()
    assert worst <= rel * scale, f"max |difference| {worst:.3g} exceeds {rel:g} x {scale:.3g}"


@pytest.mark.parametrize("fmt", list(EXPORTS))
def test_export_engine_gives_the_eager_next_token_logits(fmt, exported, eager):
    engine = engine_of(exported[fmt], EXPORTS[fmt][1])
    engine.warm_up()
    got = engine.next_token_logits(PROMPTS)
    assert got.shape == (len(PROMPTS), 256) and got.dtype == torch.float32
    assert_rel_close(got, eager.next_token_logits(PROMPTS))
    # One sequence alone reads the same logits as in the padded batch.
    assert_rel_close(engine.next_token_logits([PROMPTS[1]])[0], got[1], rel=1e-5)


@pytest.mark.parametrize("fmt", list(EXPORTS))
def test_export_engine_generates_the_eager_greedy_tokens(fmt, exported, eager):
    engine = engine_of(exported[fmt], EXPORTS[fmt][1])
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    sampling = [Sampling(max_new_tokens=n) for n in (12, 6, 9)]
    tokens = engine.generate(prompts, sampling)
    assert [len(t) for t in tokens] == [12, 6, 9]
    assert tokens == eager.generate(prompts, sampling)


def test_engines_are_the_runtime_of_their_format(exported):
    assert isinstance(engine_of(exported["safetensors"], "eager"), EagerEngine)
    assert isinstance(engine_of(exported["torchscript"], "torchscript"), TorchScriptEngine)
    onnx = engine_of(exported["onnx"], "onnxruntime")
    assert isinstance(onnx, OnnxEngine)
    assert onnx.bytes == exported["onnx"].stat().st_size and onnx.supports_generate


@pytest.mark.parametrize("fmt, runtime", [("onnx", "eager"), ("safetensors", "onnxruntime"),
                                          ("torchscript", "onnxruntime")])
def test_a_runtime_that_does_not_run_the_format_is_a_clear_error(fmt, runtime, exported):
    with pytest.raises(ModelSourceError) as caught:
        engine_of(exported[fmt], runtime)
    message = str(caught.value)
    assert f"is a {fmt} export" in message and f"--runtime {EXPORTS[fmt][1]}" in message


def test_export_is_described_from_its_sidecar(exported, trained_run):
    run = describe(str(trained_run))
    for fmt, path in exported.items():
        source = describe(str(path))
        assert (source.name, source.vocab_size, source.context_length) == ("tiny", 256, 64)
        assert source.version == f"{run.version}.{fmt}"
        assert isinstance(source.tokenizer, ByteTokenizer)
        assert source.estimated_bytes == path.stat().st_size and source.checkpoint == ""
        assert source.config is not None and source.config.model.name == "gpt-tiny"
    assert describe_export(str(exported["onnx"]), "canary").name == "canary"


def test_a_file_without_sidecar_is_refused_with_advice(exported, tmp_path):
    stray = tmp_path / "model.onnx"
    stray.write_bytes(exported["onnx"].read_bytes())
    with pytest.raises(ModelSourceError, match="no sidecar model.onnx.json"):
        describe(str(stray))


def test_an_export_that_does_not_fit_its_sidecar_is_refused(exported, tmp_path):
    """A safetensors file whose sidecar describes another model (a wider one) fails to load
    with a message, not a traceback from deep inside PyTorch."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(exported["safetensors"].read_bytes())
    facts = json.loads(Path(f"{exported['safetensors']}.json").read_text())
    facts["config"]["model"]["d_model"] = 128
    Path(f"{path}.json").write_text(json.dumps(facts))
    with pytest.raises(ModelSourceError, match="export the model again"):
        engine_of(path, "eager")
