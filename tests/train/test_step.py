"""The step runner of layouts without pipelining: the fused head loss through it."""

from __future__ import annotations

import pytest
import torch

from meshyard.config.load import ConfigError
from meshyard.models import linear_cross_entropy
from meshyard.models.gpt import GPT, GPTShape
from meshyard.train.precision import build_precision
from meshyard.train.step import MicroBatchStep
from tests.models.user_models import nanogpt

CPU = torch.device("cpu")
SHAPE = GPTShape(vocab_size=53, context_length=12, n_layer=2, n_head=2, d_model=16)


@pytest.fixture(autouse=True)
def five_rows_a_block(monkeypatch):
    """Several blocks (of 5 rows) in each micro-batch of 24 tokens, not one."""
    monkeypatch.setattr(linear_cross_entropy, "BLOCK_ELEMENTS", 5 * SHAPE.vocab_size)
    assert linear_cross_entropy.block_rows(SHAPE.vocab_size, "cpu") == 5


def _runner(fused: bool, dtype: torch.dtype = torch.float32) -> MicroBatchStep:
    torch.manual_seed(0)
    return MicroBatchStep(GPT(SHAPE), build_precision(dtype, CPU, False, False), CPU, fused_loss=fused)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, SHAPE.vocab_size, (4, 13), generator=torch.Generator().manual_seed(1))
    return [(tokens[:2, :-1], tokens[:2, 1:]), (tokens[2:, :-1], tokens[2:, 1:])]  # accumulated


def test_the_fused_loss_gives_the_losses_and_gradients_of_the_logits():
    plain, fused = _runner(False), _runner(True)
    torch.testing.assert_close(fused.forward_backward(_batches()), plain.forward_backward(_batches()),
                               rtol=1e-6, atol=0)
    for (name, param), plain_param in zip(fused.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(param.grad, plain_param.grad, rtol=1e-4, atol=1e-7, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(fused.eval_loss(*_batches()[0]), plain.eval_loss(*_batches()[0]),
                                   rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_the_fused_loss_is_as_accurate_as_the_logits(dtype):
    """Against fp32 gradients, the rounding of bf16 or of fp16 (under its GradScaler, whose
    scale the gradients carry until the optimizer step): of the order of the logits' path's
    and of the dtype's own precision, fused or not."""
    reference, plain, fused = _runner(False), _runner(False, dtype), _runner(True, dtype)
    losses = [runner.forward_backward(_batches()) for runner in (reference, plain, fused)]
    torch.testing.assert_close(losses[2], losses[1], rtol=1e-3, atol=0)
    scale = fused.precision.scaler.get_scale() if dtype == torch.float16 else 1.0
    assert scale == plain.precision.scaler.get_scale() and (scale > 1) == (dtype == torch.float16)
    for name, exact in reference.model.named_parameters():
        plain_error, fused_error = (_relative_error(dict(runner.model.named_parameters())[name].grad / scale,
                                                    exact.grad) for runner in (plain, fused))
        assert 0 < fused_error <= 2 * max(plain_error, torch.finfo(dtype).eps), (name, fused_error, plain_error)


def _relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return float((value.double() - exact.double()).norm() / exact.double().norm())


def test_a_model_that_returns_only_logits_is_refused_in_one_paragraph():
    with pytest.raises(ConfigError) as caught:
        precision = build_precision(torch.float32, CPU, False, False)
        MicroBatchStep(nanogpt(vocab_size=53, context_length=12), precision, CPU, fused_loss=True)
    [problem] = caught.value.problems
    assert problem.startswith("train.fused_linear_loss = true needs a model whose forward computes the loss")
    assert "NanoGPT returns logits only: set train.fused_linear_loss = false" in problem


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_each_micro_batch_begins_a_step_of_the_cuda_graphs(monkeypatch, cuda_graphs):
    """With train.cuda_graphs the runner marks each micro-batch as a new step of the graphs
    (their outputs of the step before may then be overwritten); without, never. The region
    runs eagerly here (torch.compile stubbed): only the marking is under test."""
    from meshyard.parallel.compile import Compilation, inductor_options

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    compilation = Compilation(True, inductor_options(False, cuda_graphs))
    runner = MicroBatchStep(GPT(SHAPE), build_precision(torch.float32, CPU, False, False), CPU,
                            compilation=compilation, compile_whole=True)
    assert compilation.graphs == cuda_graphs
    described = "the model and its loss" + (" (CUDA graphs)" if cuda_graphs else "")
    assert compilation.describe() == described
    runner.forward_backward(_batches()[:1])
    assert len(marks) == cuda_graphs
