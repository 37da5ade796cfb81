"""Tensor parallelism for models meshyard has never seen: which plan each gets, what is
refused (on the meta device, no process group), and training under the plan matching
one process (2 gloo ranks; fsdp x tp on 4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshyard.config.checks import field_problems
from meshyard.config.load import load_config
from meshyard.config.sections import ParallelConfig
from meshyard.models.gpt import GPT, GPTShape
from meshyard.parallel.tp_modules import per_rank_attributes
from meshyard.parallel.tp_plans import resolve_plan, tp_problems
from tests import shared_spawn
from tests.conftest import tiny_config
from tests.inprocess import fitted
from tests.models import user_models
from tests.models.user_models import hf_gpt2, hf_llama, nanogpt

MODELS = Path(user_models.__file__)
NANOGPT_PLAN = ('--parallel.tp_plan={ "transformer.h.*.attn.c_attn" = "colwise", "transformer.h.*.attn.c_proj" = '
                '"rowwise", "transformer.h.*.mlp.c_fc" = "colwise", "transformer.h.*.mlp.c_proj" = "rowwise", '
                '"transformer.h.*.ln_*" = "sequence_parallel" }')
"""A config plan for nanoGPT: fused q|k|v inferred from c_attn's width, head and embeddings replicated."""


def _meta(build, *args, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return build(*args, **kwargs)


# --- plans and refusals, on the meta device --------------------------------------------------
@pytest.mark.parametrize("build, family, attention, fused", [
    (nanogpt, "GPT-2-style attention", "transformer.h.1.attn", "transformer.h.1.attn.c_attn"),
    (hf_gpt2, "GPT-2-style attention", "transformer.h.1.attn", "transformer.h.1.attn.c_attn"),
    (hf_llama, "the Hugging Face plan of LlamaForCausalLM", "model.layers.1.self_attn", None),  # its config's
])
def test_each_family_gets_a_plan_built_in_or_its_own(build, family, attention, fused):
    model = _meta(build, 64, 16, n_layer=2)
    plan = resolve_plan(model, {}, 2)
    assert family in plan.source and attention in plan.attention and plan.output_head == "lm_head"
    if fused:
        assert plan.splits[fused].parts == 3  # q|k|v kept together per rank
    assert {s.style for s in plan.splits.values()} == {"colwise", "rowwise"}
    assert tp_problems(model, ParallelConfig(tp=2), 2) == []


def test_a_vocabulary_tp_does_not_divide_keeps_embedding_and_head_whole():
    plan = resolve_plan(_meta(nanogpt, 65, 16, n_layer=1), {}, 2)
    assert "lm_head" not in plan.splits and plan.output_head is None
    assert any("vocabulary (65)" in note for note in plan.notes)


@pytest.mark.parametrize("build, kwargs, tp, expected", [
    (nanogpt, {"n_head": 3, "n_embd": 48}, 2, "transformer.h.*.attn: n_head = 3 not divisible by parallel.tp = 2"),
    (hf_gpt2, {}, 8, "transformer.h.*.attn: num_heads = 4 not divisible by parallel.tp = 8"),
    (hf_llama, {}, 4, "model.layers.*.self_attn: key/value heads = 2 not divisible by parallel.tp = 4"),
])
def test_heads_tp_does_not_divide_are_refused(build, kwargs, tp, expected):
    problems = tp_problems(_meta(build, 64, 16, n_layer=1, **kwargs), ParallelConfig(tp=tp), tp)
    assert len(problems) == 1 and problems[0].startswith(expected) and "use a tp that divides" in problems[0]


class NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.embed(tokens))))


def test_a_model_without_a_plan_is_refused_naming_the_three_ways_to_give_one():
    (problem,) = tp_problems(NoBlocks(), ParallelConfig(tp=2), 2)
    assert "no tensor-parallel plan for NoBlocks" in problem
    for way in ("tensor_parallel_plan(tp_mesh)", "[parallel.tp_plan]", "parallel.tp = 1"):
        assert way in problem
    assert tp_problems(NoBlocks(), ParallelConfig(tp=2, pp=2), 2)[0].startswith("parallel.tp = 2 with parallel.pp = 2")


def test_the_model_s_own_plan_comes_first_and_a_config_plan_before_the_built_in():
    class OwnPlan(NoBlocks):
        def tensor_parallel_plan(self, tp_mesh):
            return {}

    assert tp_problems(OwnPlan(), ParallelConfig(tp=2), 2) == []
    model = _meta(nanogpt, 64, 16, n_layer=1)
    plan = resolve_plan(model, {"transformer.h.*.mlp.c_fc": "colwise", "*.c_proj": "rowwise"}, 2)
    assert "parallel.tp_plan" in plan.source and "transformer.h.0.attn.c_attn" not in plan.splits
    assert plan.splits["transformer.h.0.attn.c_proj"].style == "rowwise"


def test_a_config_plan_infers_fused_blocks_and_names_what_it_cannot_do():
    model = _meta(nanogpt, 64, 16, n_layer=2)
    plan = resolve_plan(model, {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
                                "transformer.h.*.ln_*": "sequence_parallel"}, 2)
    assert plan.splits["transformer.h.1.attn.c_attn"].parts == 3 and plan.attention == [
        "transformer.h.0.attn", "transformer.h.1.attn"]
    assert plan.splits["transformer.h.0.ln_1"].style == "replicate" and "sequence_parallel" in plan.notes[0]
    bad = {"lm_head": "colwise", "transformer.ln_f": "rowwise", "transformer.h.*.attn.q": "colwise"}
    problems = tp_problems(model, ParallelConfig(tp=2, tp_plan=bad), 2)
    assert any("'transformer.h.*.attn.q' matches no module" in p for p in problems)
    assert any(p.startswith("transformer.ln_f is a LayerNorm: 'rowwise' splits nn.Linear") for p in problems)
    assert any("one tied tensor that the plan splits differently" in p for p in problems)


class RootTable(nn.Module):
    """nanoGPT blocks under a root holding a learned position table of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nanogpt(64, 16, n_layer=1)
        self.table = nn.Parameter(torch.zeros(16, 32))


def test_a_module_with_parameters_of_its_own_around_split_modules_is_refused():
    (problem,) = tp_problems(_meta(RootTable), ParallelConfig(tp=2), 2)
    assert problem.startswith("the model's root (RootTable) holds parameters of its own (table)")


class OriginalNanoGPTAttention(user_models.CausalSelfAttention):
    """nanoGPT's original attention: the head width comes from the full input width."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def test_a_forward_that_cannot_run_on_a_rank_s_heads_is_refused_by_a_trial_on_meta():
    model = _meta(nanogpt, 64, 16, n_layer=1)
    model.transformer.h[0].attn.__class__ = OriginalNanoGPTAttention
    (problem,) = tp_problems(model, ParallelConfig(tp=2), 2)
    assert problem.startswith("NanoGPT's forward fails once each rank holds 1/2 of the heads (RuntimeError: ")
    assert "tensor_parallel_plan(tp_mesh)" in problem


class WrappedGPT(nn.Module):
    """meshyard's GPT inside a user's wrapper: its attention reads the head width as
    C // n_head and views -1 heads, so the head rule would give it heads twice as wide."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTShape(vocab_size=64, context_length=16, n_layer=1, n_head=4, d_model=32))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens)


def test_a_forward_that_would_run_on_wrong_heads_is_refused_by_the_trial():
    plan = {"gpt.blocks.*.attn.qkv": "colwise", "gpt.blocks.*.attn.proj": "rowwise"}
    (problem,) = tp_problems(_meta(WrappedGPT), ParallelConfig(tp=2, tp_plan=plan), 2)
    assert problem.startswith("WrappedGPT's attention runs on heads 16 wide instead of 8")
    # meshyard's GPT itself keeps its own plan, whatever the config says.
    gpt = _meta(WrappedGPT).gpt
    assert tp_problems(gpt, ParallelConfig(tp=2, tp_plan=plan), 2) == []


def test_the_head_rule_divides_counts_and_widths_and_keeps_head_dim():
    gpt2_attention = _meta(hf_gpt2, 64, 16, n_layer=1).transformer.h[0].attn
    assert per_rank_attributes(gpt2_attention, 2) == {"num_heads": 2, "embed_dim": 16, "split_size": 16}
    nano_attention = _meta(nanogpt, 64, 16, n_layer=1).transformer.h[0].attn
    assert per_rank_attributes(nano_attention, 2) == {"n_head": 2, "n_embd": 16}


def test_config_tp_plan_values_are_checked(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text('[parallel.tp_plan]\n"blocks.*.attn.qkv" = "colwize"\n"lm_head" = "colwise"\n')
    assert field_problems(load_config(path)) == [
        "parallel.tp_plan: 'blocks.*.attn.qkv' = 'colwize' is not one of 'colwise', 'rowwise', "
        "'sequence_parallel', 'replicate'"]


# --- training under tensor parallelism matches one process ------------------------------------
def _overrides(builder: str, *extra: str) -> tuple[str, ...]:
    return (f"--model.name={MODELS}:{builder}", "--model.options={ n_layer = 2 }", "--data.vocab_size=64",
            "--train.steps=3", "--train.global_batch=4", "--optim.warmup_steps=1", *extra)


CASES = {
    "nanogpt": _overrides("nanogpt"),
    "hf_gpt2": _overrides("hf_gpt2"),
    "hf_llama": _overrides("hf_llama"),
    "nanogpt-config-plan": _overrides("nanogpt", NANOGPT_PLAN),
}


def _losses(tmp: str, rank: int, world_size: int, name: str, overrides: tuple[str, ...]) -> list[float]:
    cfg = tiny_config(Path(tmp) / name, *overrides)
    return fitted(cfg, Path(tmp) / name / "run", rank, world_size).trainer.progress.losses


def _train_cases(rank: int, world_size: int, tmp: str, cases: dict[str, tuple[str, ...]]) -> dict[str, list[float]]:
    return {name: _losses(tmp, rank, world_size, name, overrides) for name, overrides in cases.items()}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[float]]:
    """Each model trained in one process (strategy none), in this test process."""
    tmp = tmp_path_factory.mktemp("reference")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _train_cases(0, 1, str(tmp), {name: (*CASES[name], "--parallel.strategy=none")
                                             for name in ("nanogpt", "hf_gpt2", "hf_llama")})
    finally:
        dist.destroy_process_group()


def _assert_matches(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference) == 3
    assert losses == pytest.approx(reference, rel=1e-5)


class GainNorm(nn.Module):
    """A replicated module holding a parameter and a replicated submodule."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((width,), 1.5))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * self.gain


def nanogpt_nested_norm(vocab_size: int, context_length: int, n_layer: int) -> nn.Module:
    model = nanogpt(vocab_size, context_length, n_layer=n_layer)
    model.transformer.ln_f = GainNorm(32)
    return model


BUILDERS = {"nanogpt": nanogpt, "hf_gpt2": hf_gpt2, "hf_llama": hf_llama, "nested": nanogpt_nested_norm}


def _forward_backward(name: str, mesh=None, loss_parallel: bool = False) -> dict:
    """Loss and full gradients of one step of a user model (under tensor parallelism on
    ``mesh`` when given, its head's logits vocabulary-split with ``loss_parallel``)."""
    import contextlib

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

    from meshyard.parallel.tensor_parallel import apply_tp
    from meshyard.models.outputs import logits_of
    from meshyard.train.loss import next_token_loss

    torch.manual_seed(0)
    model = BUILDERS[name](64, 16, n_layer=2)
    if mesh is not None:
        apply_tp(model, mesh, loss_parallel=loss_parallel, log=lambda message: None)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with loss_parallel_context() if loss_parallel else contextlib.nullcontext():
        logits = logits_of(model(tokens))
        assert isinstance(logits, DTensor) == loss_parallel
        loss = next_token_loss(logits, tokens)
        loss.backward()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    return {"loss": full(loss).item(), "grads": {n: full(p.grad) for n, p in model.named_parameters()}}


def _tp2(rank: int, world_size: int, tmp: str, cases: dict[str, tuple[str, ...]]) -> dict:
    """One spawn: gradients of one step of each model under apply_tp (logits gathered
    and vocabulary-split), then each training case through build_trainer."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))["tp"]
    grads = {(name, split): _forward_backward(name, mesh, split) for name in BUILDERS for split in (False, True)}
    return {"grads": grads, "losses": _train_cases(rank, world_size, tmp, cases)}


TP2_CASES = {name: (*overrides, "--parallel.strategy=none", "--parallel.tp=2") for name, overrides in CASES.items()}
TP2_CASES["hf_gpt2-gathered-logits"] = (*TP2_CASES["hf_gpt2"], "--parallel.loss_parallel=false")
shared_spawn.register(2, "tp_plans: tp2", __name__, lambda request, folder: (_tp2, (str(folder), TP2_CASES)))


def test_tp2_gives_user_models_the_gradients_and_losses_of_one_process(request, references):
    """Trained in the session's one spawn of two ranks."""
    _, results = shared_spawn.result(request, 2, "tp_plans: tp2")
    assert results[0]["losses"] == results[1]["losses"]
    for name, losses in results[0]["losses"].items():
        _assert_matches(losses, references[name.split("-")[0]])
    one_process_grads = {name: _forward_backward(name) for name in BUILDERS}  # once per model, for both splits
    for (name, split), out in results[0]["grads"].items():
        reference = one_process_grads[name]
        assert out["loss"] == pytest.approx(reference["loss"], rel=1e-5), name
        assert out["grads"].keys() == reference["grads"].keys(), "parameter names are kept"
        for param, grad in reference["grads"].items():
            torch.testing.assert_close(out["grads"][param], grad, rtol=1e-5, atol=1e-6, msg=f"{name} {split}: {param}")


FSDP_X_TP_CASES = {name: (*CASES[name], "--parallel.strategy=fsdp", "--parallel.tp=2", "--parallel.dp_shard=2")
                   for name in ("hf_gpt2", "hf_llama")}
shared_spawn.register(4, "tp_plans: fsdp x tp", __name__,
                      lambda request, folder: (_train_cases, (str(folder), FSDP_X_TP_CASES)))


def test_fsdp_x_tp_on_four_ranks_trains_user_models_as_one_process_does(request, references):
    """Built on the meta device, split, sharded, then materialized (the fsdp default);
    trained in the session's one spawn of four ranks."""
    _, results = shared_spawn.result(request, 4, "tp_plans: fsdp x tp")
    for name in FSDP_X_TP_CASES:
        _assert_matches(results[0][name], references[name])
