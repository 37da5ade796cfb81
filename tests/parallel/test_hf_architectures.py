"""Hugging Face architectures meshyard has no plan of its own for, under every layout.

OPT (q_proj/k_proj/v_proj/out_proj, fc1/fc2, hidden states passed between its layers as
a transposed view, dropout 0.1 by default) gets meshyard's OPT/BART-style built-in plan;
GPT-NeoX (a fused query_key_value laid out head by head) the plan its config publishes
(``config.base_model_tp_plan``), and its pipeline stages are cut at the layers its
``base_model_pp_plan`` names. On the meta device: which plan each gets, how transformers'
styles map to meshyard's, what is refused, and what dropout is switched off. On two
gloo ranks (one cell after another in the session's shared spawn): each model under
tp = 2 and pp = 2 trains to per-step losses within 1e-5 (relative) of one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshyard.config.load import ConfigError, load_config
from meshyard.config.sections import ModelConfig, ParallelConfig
from meshyard.models.dropout import active_dropout, switch_off_dropout
from meshyard.models.registry import build_model
from meshyard.parallel.hf_plans import HF_STYLES, hf_layer_list, hf_splits
from meshyard.parallel.pipeline import stage_starts
from meshyard.parallel.tp_modules import Split
from meshyard.parallel.tp_plans import resolve_plan, tp_problems
from meshyard.validate import validate
from tests import shared_spawn
from tests.conftest import tiny_config
from tests.inprocess import fitted
from tests.models import user_models
from tests.pipeline_masks import can_train, skip_unless_trainable

pytest.importorskip("transformers")

USER_MODELS = Path(user_models.__file__).resolve()
MODELS = ("hf_opt", "hf_neox")
LAYOUTS = {"tp2": ("--parallel.strategy=none", "--parallel.tp=2"), "pp2": ("--parallel.strategy=none", "--parallel.pp=2")}
STEPS = 3
LOSS_REL = 1e-5  # as tests/parallel/test_user_models.py


def _meta(build, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return build(64, 16, **kwargs)


# --- plans, on the meta device ---------------------------------------------------------------
def test_opt_gets_the_built_in_opt_plan_and_its_heads_are_counted():
    model = _meta(user_models.hf_opt)
    plan = resolve_plan(model, {}, 2)
    assert "OPT/BART-style attention" in plan.source and "OPT/BART-style MLP" in plan.source
    layer = "model.decoder.layers.1"
    assert {plan.splits[f"{layer}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")} == {Split("colwise")}
    assert plan.splits[f"{layer}.self_attn.out_proj"] == Split("rowwise")
    assert plan.splits[f"{layer}.fc1"] == Split("colwise") and plan.splits[f"{layer}.fc2"] == Split("rowwise")
    assert f"{layer}.self_attn" in plan.attention and plan.output_head == "lm_head"
    assert tp_problems(model, ParallelConfig(tp=2), 2) == []
    [problem] = tp_problems(model, ParallelConfig(tp=8), 8)
    assert problem.startswith("model.decoder.layers.*.self_attn: num_heads = 4 not divisible by parallel.tp = 8")


def test_neox_gets_its_own_plan_with_its_per_head_fused_projection_split_plainly():
    model = _meta(user_models.hf_neox)
    plan = resolve_plan(model, {}, 2)
    assert "Hugging Face plan of GPTNeoXForCausalLM" in plan.source
    # Laid out head by head, so a plain column split keeps whole heads: not 3 fused blocks.
    assert plan.splits["gpt_neox.layers.0.attention.query_key_value"] == Split("colwise")
    assert plan.splits["gpt_neox.layers.0.mlp.dense_4h_to_h"] == Split("rowwise")
    assert plan.splits["gpt_neox.embed_in"] == Split("rowwise") and plan.splits["lm_head"].gather
    assert plan.attention == ["gpt_neox.layers.0.attention", "gpt_neox.layers.1.attention"]
    assert tp_problems(model, ParallelConfig(tp=2), 2) == []
    [problem] = tp_problems(model, ParallelConfig(tp=8), 8)
    assert problem.startswith("gpt_neox.layers.*.attention: query heads = 4 not divisible by parallel.tp = 8")


def test_a_config_plan_still_comes_before_the_hugging_face_plan():
    model = _meta(user_models.hf_neox)
    plan = resolve_plan(model, {"gpt_neox.layers.*.mlp.dense_h_to_4h": "colwise",
                                "gpt_neox.layers.*.mlp.dense_4h_to_h": "rowwise"}, 2)
    assert "parallel.tp_plan" in plan.source and "gpt_neox.layers.0.attention.query_key_value" not in plan.splits


def _with_plan(model: nn.Module, plan: dict[str, str]) -> nn.Module:
    model.config.base_model_tp_plan = plan
    return model


def test_transformers_styles_map_to_meshyard_splits():
    assert HF_STYLES["colwise"] == Split("colwise") and HF_STYLES["colwise_rep"].gather
    assert HF_STYLES["colwise_gather_output"].gather and HF_STYLES["packed_colwise"].parts == 2
    assert HF_STYLES["rowwise"] == Split("rowwise") and HF_STYLES["rowwise_rep"].whole_input
    assert HF_STYLES["embedding_rowwise"] == Split("rowwise") and HF_STYLES["sequence_parallel"].style == "replicate"
    model = _with_plan(_meta(user_models.hf_neox), {
        "layers.*.attention.query_key_value": "colwise", "layers.*.attention.dense": "rowwise",
        "layers.*.input_layernorm": "sequence_parallel", "layers.*.mlp.dense_4h_to_h": "rowwise_rep",
        "no_such_module": "colwise"})
    found = hf_splits(model)
    assert found.splits["gpt_neox.layers.1.input_layernorm"] == Split("replicate") and not found.problems
    assert found.splits["gpt_neox.layers.0.mlp.dense_4h_to_h"] == Split("rowwise", whole_input=True)
    assert any("'sequence_parallel' entries" in note for note in found.notes)


def test_a_style_meshyard_cannot_honour_is_one_clear_problem_before_any_worker_starts(tmp_path):
    model = _with_plan(_meta(user_models.hf_neox), {
        "layers.*.attention.query_key_value": "local_colwise", "layers.*.attention.dense": "rowwise",
        "layers.*.mlp.dense_h_to_4h": "moe_tp_experts", "layers.*.attention.dense.weight": "packed_rowwise"})
    [problem] = tp_problems(model, ParallelConfig(tp=2), 2)
    assert problem.startswith("parallel.tp: the Hugging Face plan of GPTNeoXForCausalLM asks for "
                              "'gpt_neox.layers.*.attention.query_key_value' = 'local_colwise'")
    assert "'moe_tp_experts'" in problem and "'packed_rowwise'" in problem
    for way in ("[parallel.tp_plan]", "tensor_parallel_plan(tp_mesh)", "parallel.tp = 1"):
        assert way in problem
    # Through validation, as `meshyard run` and `verify` see it: a ConfigError (exit 2), not a traceback.
    cfg = tiny_config(tmp_path, f"--model.name={USER_MODELS}:hf_neox", "--model.options={ tp_style = 'local_colwise' }",
                      "--parallel.strategy=none", "--parallel.tp=2", "--run.nproc=2")
    with pytest.raises(ConfigError) as refused:
        validate(cfg, 2)
    assert any("cannot carry out" in p for p in refused.value.problems)


def test_pipeline_stages_are_cut_at_the_layers_the_pp_plan_names():
    model = _meta(user_models.hf_neox, n_layer=4)
    assert hf_layer_list(model) == "gpt_neox.layers"
    assert stage_starts(model, 2, None) == ["gpt_neox.layers.2"]
    assert stage_starts(model, 4, [1, 1, 1, 1]) == ["gpt_neox.layers.1", "gpt_neox.layers.2", "gpt_neox.layers.3"]
    assert hf_layer_list(_meta(user_models.hf_opt)) is None  # OPT publishes no pp plan: its repeated blocks
    assert stage_starts(_meta(user_models.hf_opt), 2, None) == ["model.decoder.layers.1"]


# --- dropout ---------------------------------------------------------------------------------
def test_dropout_a_model_holds_itself_is_found_and_switched_off():
    model = user_models.hf_opt(64, 16)
    assert active_dropout(model) == ["model.decoder.dropout = 0.1", "model.decoder.layers.*.dropout = 0.1"]
    tokens = torch.randint(0, 64, (2, 16))
    model.train()
    assert not torch.equal(model(tokens).logits, model(tokens).logits)  # random in training
    assert switch_off_dropout(model) == ["model.decoder.dropout = 0.1", "model.decoder.layers.*.dropout = 0.1"]
    assert active_dropout(model) == [] and model.config.dropout == 0.0
    assert torch.equal(model(tokens).logits, model(tokens).logits)
    assert active_dropout(user_models.hf_neox(64, 16)) == []  # 0 by default; its config's classifier rate is not its


def test_model_no_dropout_switches_off_what_the_builder_set():
    cfg = ModelConfig(name=f"{USER_MODELS}:hf_opt", no_dropout=True)
    with torch.device("meta"):
        assert active_dropout(build_model(cfg, 64, 16)) == []
        assert active_dropout(build_model(ModelConfig(name="gpt-tiny", dropout=0.1, no_dropout=True), 64, 16)) == []
    assert load_config(None, ["--model.no_dropout=true"]).model.no_dropout


# --- training under tp = 2 and pp = 2 matches one process -----------------------------------
def _overrides(model: str, *layout: str) -> tuple[str, ...]:
    # OPT's default dropout (0.1) would draw other masks under each layout: switched off.
    return (f"--model.name={USER_MODELS}:{model}", "--model.no_dropout=true", f"--train.steps={STEPS}",
            "--precision.dtype=fp32", *layout)


def _fit(folder: Path, overrides: tuple[str, ...], rank: int = 0, world_size: int = 1) -> list[float]:
    return list(fitted(tiny_config(folder, *overrides), folder / "run", rank, world_size).trainer.progress.losses)


def _cells(rank: int, world_size: int, folder: str) -> dict[str, list[float]]:
    return {f"{model}-{layout}": _fit(Path(folder) / f"{model}-{layout}", _overrides(model, *LAYOUTS[layout]), rank,
                                      world_size)
            for model in MODELS for layout in LAYOUTS if can_train(model, LAYOUTS[layout])}


shared_spawn.register(2, "hf_architectures: cells", __name__, lambda request, folder: (_cells, (str(folder),)))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, list[float]]:
    """Each model trained on one process (a 1-rank group in this process)."""
    folder = tmp_path_factory.mktemp("hf-one-process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return {model: _fit(folder / model, _overrides(model, "--parallel.strategy=none")) for model in MODELS}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_hugging_face_architectures_match_one_process(request, one_process, model, layout):
    skip_unless_trainable(model, LAYOUTS[layout])
    _, per_rank = shared_spawn.result(request, 2, "hf_architectures: cells")
    got = per_rank[-1][f"{model}-{layout}"]  # the last rank holds the loss under pipelining
    assert len(got) == len(one_process[model]) == STEPS
    assert got == pytest.approx(one_process[model], rel=LOSS_REL), f"{model} under {layout}"
