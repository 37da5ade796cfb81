"""``model.init_from``: a run starts from a Hugging Face folder, a meshyard checkpoint or an
exported file, every rank reading only its own part.

The standard: after the load, the model's logits equal ``from_pretrained``'s on the same
input (fp32), on one process and under fsdp, tp=2 and pp=2 (the session's shared 2-rank
spawn builds each case and hands back the full tensors of its parameters, gathered from
the shards and stages; the logits are computed here). Tiny GPT-2 folders (2 layers, width
32) made with ``save_pretrained`` of random models: nothing is downloaded.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshyard.checkpoint.init_source import find_source
from meshyard.checkpoint.initialize import NameMap, load_initial_weights
from meshyard.config.load import ConfigError
from meshyard.models.gpt import GPT
from meshyard.models.registry import gpt_shape
from meshyard.parallel.data_parallel import unwrap
from meshyard.parallel.pipeline import tied_groups
from meshyard.validate import validate
from tests import shared_spawn
from tests.conftest import tiny_config
from tests.inprocess import cpu_runtime, fit_here
from tests.pipeline_masks import can_train, skip_unless_trainable

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

WIDTH, LAYERS, HEADS, VOCAB, SEQ = 32, 2, 4, 256, 32
GPT_SIZE = (f"--model.n_layer={LAYERS}", f"--model.n_head={HEADS}", f"--model.d_model={WIDTH}")
LAYOUTS = {"fsdp": ("--parallel.strategy=fsdp",), "tp2": ("--parallel.strategy=none", "--parallel.tp=2"),
           "pp2": ("--parallel.strategy=none", "--parallel.pp=2")}
MODELS = {"hf": ("--model.name=hf",), "gpt": ("--model.name=gpt", *GPT_SIZE)}
# The memory case: a GPT-2 folder of about 34 MB (8.4M fp32 parameters).
BIG = {"n_embd": 256, "n_layer": 8, "n_head": 8, "vocab_size": 8192, "n_positions": 32}


def gpt2_folder(folder: Path, seed: int = 0, **sizes) -> Path:
    """A random GPT2LMHeadModel saved as a Hugging Face folder (no dropout)."""
    shape = {"vocab_size": VOCAB, "n_positions": SEQ, "n_embd": WIDTH, "n_layer": LAYERS, "n_head": HEADS,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0, **sizes}
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).save_pretrained(folder)
    return folder


def _config(folder: Path, init_from: Path | str, *overrides: str):
    return tiny_config(folder, f"--model.init_from={init_from}", "--train.steps=2", *overrides)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters as whole tensors (DTensors gathered over their mesh: every rank
    of it calls this with the same model)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in unwrap(model).named_parameters()}


def _built_state(cfg, rank: int, world_size: int, resume: str = "none") -> tuple[int, dict[str, torch.Tensor]]:
    from meshyard.train.build import build_trainer

    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    built = build_trainer(cfg, cpu_runtime(rank, world_size), run_dir, resume)
    try:
        return built.trainer.progress.step, _full_state(built.trainer.model)
    finally:
        built.trainer.close()


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model.eval()(tokens)
    return getattr(out, "logits", out)


def _reference_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    return _logits(transformers.AutoModelForCausalLM.from_pretrained(folder), tokens).detach()


def _logits_from_state(model_name: str, folder: Path, state: dict[str, torch.Tensor],
                       tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a fresh model of the case's kind holding ``state`` (the gathered weights)."""
    if model_name == "hf":
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    else:
        cfg = tiny_config(folder / "unused", *MODELS["gpt"]).model
        model = GPT(gpt_shape(cfg, VOCAB, SEQ))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return _logits(model, tokens).detach()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


# ---- two ranks: fsdp, tp=2, pp=2, a checkpoint, and the memory figure -----------------------

def _peak_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _measured_load(cfg, folder: str, rank: int, world_size: int) -> dict:
    """Peak resident memory of this rank while it loads ``folder`` into a built model
    (the peak is reset just before: /proc/self/clear_refs), against the model's bytes."""
    from meshyard.train.build import build_trainer

    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    built = build_trainer(cfg, cpu_runtime(rank, world_size), run_dir, "none")
    try:
        model = built.trainer.model
        source = find_source(folder)
        model_bytes = sum(torch.Size(info.shape).numel() * 4 for info in source.tensors.values())
        dist.barrier()
        before = _rss_kib()
        Path("/proc/self/clear_refs").write_text("5")
        read = load_initial_weights(model, source, NameMap(ties=tied_groups(unwrap(model))), note=lambda _: None)
        peak = _peak_kib()
        return {"model_bytes": model_bytes, "read_bytes": read, "peak_delta_bytes": (peak - before) * 1024}
    finally:
        built.trainer.close()


def _two_rank_cases(rank: int, world_size: int, cases: list[tuple[str, object, str]]) -> dict:
    results = {}
    for name, cfg, kind in cases:
        if kind == "memory":
            results[name] = _measured_load(cfg, str(cfg.model.init_from), rank, world_size)
        else:
            results[name] = _built_state(cfg, rank, world_size)
        dist.barrier()
    return results


def _make_two_rank_job(request: pytest.FixtureRequest, folder: Path):
    folder_small = gpt2_folder(folder / "gpt2")
    big = gpt2_folder(folder / "gpt2-big", **BIG)
    source_run = _trained_checkpoint(folder / "source")
    cases = [(f"{model}-{layout}", _config(folder / f"{model}-{layout}", folder_small, *MODELS[model], *overrides),
              "state") for model in MODELS for layout, overrides in LAYOUTS.items() if can_train(model, overrides)]
    cases.append(("checkpoint-fsdp", _config(folder / "ckpt-fsdp", source_run, *GPT_SIZE, "--parallel.strategy=fsdp"),
                  "state"))
    cases.append(("memory", tiny_config(folder / "memory", "--model.name=hf", f"--model.init_from={big}",
                                        "--parallel.strategy=fsdp", f"--data.vocab_size={BIG['vocab_size']}"),
                  "memory"))
    for _, cfg, _ in cases:
        validate(cfg, 2)
    return _two_rank_cases, (cases,)


def _trained_checkpoint(folder: Path) -> Path:
    """A one-process run of a tiny GPT, 2 steps, its final checkpoint saved; its run directory."""
    cfg = tiny_config(folder, *GPT_SIZE, "--train.steps=2", "--checkpoint.enabled=true",
                      "--checkpoint.async_save=false", "--parallel.strategy=none")
    fit_here(cfg)
    return Path(cfg.run.run_dir)


shared_spawn.register(2, "init_from: layouts", __name__, _make_two_rank_job)


@pytest.fixture(scope="module")
def two_ranks(request) -> tuple[Path, dict]:
    folder, per_rank = shared_spawn.result(request, 2, "init_from: layouts")
    merged: dict[str, dict] = {}
    for rank_results in per_rank:
        for case, value in rank_results.items():
            if case == "memory":
                merged.setdefault(case, {})[len(merged.get(case, {}))] = value
            else:
                step, state = value
                entry = merged.setdefault(case, {"steps": [], "state": {}})
                entry["steps"].append(step)
                entry["state"].update(state)  # the stages of pp; equal whole tensors otherwise
    return folder, merged


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_logits_equal_from_pretrained_under_each_layout(two_ranks, model, layout):
    skip_unless_trainable(model, LAYOUTS[layout])
    folder, merged = two_ranks
    case = merged[f"{model}-{layout}"]
    assert case["steps"] == [0, 0]
    tokens = _tokens()
    got = _logits_from_state(model, folder / "gpt2", case["state"], tokens)
    torch.testing.assert_close(got, _reference_logits(folder / "gpt2", tokens), rtol=1e-5, atol=1e-6)


def test_a_checkpoint_starts_a_new_run_at_step_zero_with_its_weights_on_another_layout(two_ranks):
    from meshyard.checkpoint.tools import model_state
    from meshyard.checkpoint.locate import locate

    folder, merged = two_ranks
    case = merged["checkpoint-fsdp"]
    assert case["steps"] == [0, 0]
    saved = model_state(locate(str(folder / "source" / "run"), {}))
    assert saved.keys() >= case["state"].keys()
    for name, tensor in case["state"].items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)


def test_peak_memory_of_a_rank_loading_stays_below_the_model(two_ranks):
    _, merged = two_ranks
    for rank, figure in sorted(merged["memory"].items()):
        model_mb, peak_mb = figure["model_bytes"] / 2**20, figure["peak_delta_bytes"] / 2**20
        print(f"\nrank {rank} of 2 (fsdp): model {model_mb:.1f} MiB, read {figure['read_bytes'] / 2**20:.1f} MiB, "
              f"peak resident growth during the load {peak_mb:.1f} MiB ({peak_mb / model_mb:.2f} of the model)")
        assert figure["read_bytes"] <= 0.55 * figure["model_bytes"]  # its half of every tensor
        assert figure["peak_delta_bytes"] < figure["model_bytes"]


# ---- one process -----------------------------------------------------------------------

@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return gpt2_folder(tmp_path_factory.mktemp("init") / "gpt2")


@pytest.mark.parametrize("model", list(MODELS))
def test_one_process_logits_equal_from_pretrained(tmp_path, folder, one_rank, model):
    cfg = _config(tmp_path, folder, *MODELS[model], "--parallel.strategy=none")
    validate(cfg, 1)
    step, state = _built_state(cfg, 0, 1)
    assert step == 0
    tokens = _tokens()
    torch.testing.assert_close(_logits_from_state(model, folder, state, tokens), _reference_logits(folder, tokens),
                               rtol=1e-5, atol=1e-6)


def test_a_sharded_folder_with_an_index_loads_too(tmp_path, one_rank):
    sharded = tmp_path / "sharded"
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH,
                                                                 n_layer=LAYERS, n_head=HEADS))
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    _, state = _built_state(_config(tmp_path, sharded, *MODELS["hf"], "--parallel.strategy=none"), 0, 1)
    tokens = _tokens()
    torch.testing.assert_close(_logits_from_state("hf", sharded, state, tokens), _reference_logits(sharded, tokens),
                               rtol=1e-5, atol=1e-6)


def test_an_exported_file_starts_a_run(tmp_path):
    from meshyard.checkpoint.locate import locate
    from meshyard.checkpoint.tools import export, model_state

    run_dir = _trained_checkpoint(tmp_path / "source")
    ref = locate(str(run_dir), {})
    file = export(ref, tmp_path / "model.safetensors", report=lambda _: None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    step, state = _built_state(_config(tmp_path / "new", file, *GPT_SIZE, "--parallel.strategy=none"), 0, 1)
    assert step == 0
    saved = model_state(ref)
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)


def test_a_run_resuming_its_own_checkpoint_ignores_init_from_and_says_so_once(tmp_path, folder, one_rank):
    cfg = _config(tmp_path, folder, *MODELS["gpt"], "--parallel.strategy=none", "--checkpoint.enabled=true",
                  "--checkpoint.async_save=false")
    from tests.inprocess import fitted

    Path(cfg.run.run_dir).mkdir(parents=True)
    first = _full_state(fitted(cfg, Path(cfg.run.run_dir), resume="none").trainer.model)
    step, state = _built_state(cfg, 0, 1, resume="auto")
    assert step == 2
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, first[name], rtol=0, atol=0)
    log = (Path(cfg.run.run_dir) / "logs" / "rank0.log").read_text()
    assert log.count("model.init_from") == 1 and "ignored" in log


# ---- errors: one paragraph each, as a ConfigError (exit code 2) ----------------------------

def _problems(cfg) -> str:
    with pytest.raises(ConfigError) as raised:
        validate(cfg, 1)
        _built_state(cfg, 0, 1)
    assert "Traceback" not in str(raised.value)
    return "\n".join(raised.value.problems)


def test_a_path_that_does_not_exist(tmp_path):
    text = _problems(_config(tmp_path, tmp_path / "nowhere", "--parallel.strategy=none"))
    assert "does not exist" in text and "Hugging Face model folder" in text


def test_a_path_of_no_known_kind(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (tmp_path / "notes.txt", empty):
        text = _problems(_config(tmp_path, path, "--parallel.strategy=none"))
        assert f"model.init_from = '{path}' is none of" in text


def test_hf_needs_init_from_and_a_hugging_face_folder(tmp_path, folder):
    assert "model.init_from is empty" in _problems(tiny_config(tmp_path, "--model.name=hf"))
    file = tmp_path / "model.safetensors"
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2)}, str(file))
    assert "builds the model from the config.json" in _problems(_config(tmp_path, file, "--model.name=hf"))


@pytest.mark.parametrize("overrides, expected", [
    (("--model.n_layer=3",), r"tensor\(s\) of the model are not in .*blocks\.2\."),
    (("--model.n_layer=1",), r"tensor\(s\) of Hugging Face folder .* are not in the model: transformer\.h\.1\."),
    (("--model.d_model=64",), r"blocks\.0\.attn\.proj\.bias \(stored as transformer\.h\.0\.attn\.c_proj\.bias\): "
                              r"\[32\] stored, \[64\] in the model"),
    (("--model.tie_embeddings=false",), r"ties its output head to its token embedding .* set "
                                        r"model.tie_embeddings = true"),
])
def test_a_folder_that_does_not_fit_the_model(tmp_path, folder, one_rank, overrides, expected):
    cfg = _config(tmp_path, folder, *MODELS["gpt"], "--parallel.strategy=none", *overrides)
    text = _problems(cfg)
    assert re.search(expected, text), text


def test_a_float_parameter_from_an_integer_tensor(tmp_path, one_rank):
    from safetensors.torch import save_file

    cfg = _config(tmp_path, tmp_path / "model.safetensors", *GPT_SIZE, "--parallel.strategy=none")
    state = GPT(gpt_shape(cfg.model, VOCAB, SEQ)).state_dict()
    state = {name: tensor.clone() for name, tensor in state.items() if name != "lm_head.weight"}
    state["ln_f.weight"] = torch.ones(WIDTH, dtype=torch.int32)
    save_file(state, str(tmp_path / "model.safetensors"))
    text = _problems(cfg)
    assert "ln_f.weight: I32 stored, float32 in the model" in text


def test_a_vocabulary_other_than_the_data(tmp_path, one_rank):
    other = gpt2_folder(tmp_path / "gpt2-300", vocab_size=300)
    text = _problems(_config(tmp_path, other, "--model.name=hf", "--parallel.strategy=none"))
    assert "has a vocabulary of 300 token ids" in text and "has 256" in text
