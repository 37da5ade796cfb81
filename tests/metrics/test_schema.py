"""The step-record schema: standard library only, true to what a real run writes, and
consistent with the producers and readers of records."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import meshyard
from meshyard.metrics import schema
from meshyard.metrics.schema import FIELDS, PHASE_KEYS, RANK_FIELDS, UNITS, keys_from, validate_record

SRC = Path(meshyard.__file__).resolve().parent
SCHEMA_FILE = SRC / "metrics" / "schema.py"


# -- the module stands alone ---------------------------------------------------------

def test_schema_imports_only_the_standard_library():
    """Loaded from its file, since ``import meshyard`` runs meshyard/__init__.py, which
    imports the API and with it torch."""
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('step_schema', {str(SCHEMA_FILE)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['step_schema'] = module\n"
        "spec.loader.exec_module(module)\n"
        "assert module.validate_record({}) and module.PHASES\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
        "assert not [name for name in sys.modules if name.startswith('meshyard')], 'meshyard'\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    imported = set()
    for node in ast.walk(ast.parse(SCHEMA_FILE.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


# -- a real run's records --------------------------------------------------------------

def test_every_record_of_a_real_run_validates(make_config):
    """One process with every optional figure a CPU run can produce: the breakdown, MFU,
    per-rank windows, compression accounting, the fp16 loss scale (a narrow model keeps
    fp16 fast on CPU), evaluation and (synchronous) checkpoints."""
    cfg = make_config("--parallel.strategy=none", "--train.steps=6", "--train.eval_every=3",
                      "--metrics.gather_every=2", "--checkpoint.enabled=true", "--checkpoint.interval=2",
                      "--checkpoint.async_save=false", "--precision.dtype=fp16", "--model.d_model=32",
                      "--metrics.mfu=true")
    records = meshyard.run(cfg, nproc=1).metrics()
    assert [r["step"] for r in records] == list(range(1, 7))
    for record in records:
        assert validate_record(record) == [], record
    seen = set().union(*records)
    expected = {*PHASE_KEYS, "other_s", "busy_s", "mfu", "model_tflops", "loss_scale", "rss_bytes", "peak_rss_bytes",
                *keys_from("comm.accounting"), "ranks", "stragglers", "straggler_hosts", "eval_loss",
                "checkpoint_stall_s", "checkpoint_step", "checkpoint_s", "checkpoint_commit_s"}
    assert expected <= seen, expected - seen
    assert set(records[1]["ranks"]) == set(RANK_FIELDS)


# -- validate_record -------------------------------------------------------------------

def _good_record() -> dict:
    return {"step": 3, "loss": 4.5, "lr": 1e-3, "grad_norm": 0.7, "step_time_s": 0.1, "data_time_s": 0.01,
            "tokens_per_s": 2560.0, "samples_per_s": 80.0, "tokens_seen": 768, "time": 1.7e9,
            "forward_s": 0.03, "rss_bytes": 2**28, "ranks": {"busy_s": [0.09, 0.1]}, "stragglers": [1],
            "straggler_hosts": ["node (10.0.0.2)"],
            "nonfinite": [{"rank": 0, "what": "loss", "value": "nan"}], "checkpoint_error": "disk full"}


def test_a_good_record_has_no_problems():
    assert validate_record(_good_record()) == []
    assert validate_record({**_good_record(), "loss": float("nan")}) == []  # NaN is still a number


def test_validate_record_names_missing_unknown_and_mistyped_keys():
    record = _good_record()
    del record["loss"]
    record["losss"] = 4.5
    record["grad_norm"] = "0.7"
    assert sorted(validate_record(record)) == ["'grad_norm' is str, expected float or int",
                                               "missing required key 'loss'", "unknown key 'losss'"]


@pytest.mark.parametrize("change, problem", [
    ({"step": 3.0}, "'step' is float, expected int"),  # a count is never fractional
    ({"step": True}, "'step' is bool, expected int"),  # JSON true is not a number
    ({"eval_loss": None}, "'eval_loss' is null, expected float or int"),
    ({"stragglers": ["1"]}, "'stragglers'[0] is str, expected int"),
    ({"straggler_hosts": [1]}, "'straggler_hosts'[0] is int, expected str"),
    ({"ranks": {"busy_s": 0.1}}, "'ranks.busy_s' is not a list of numbers (one per rank)"),
    ({"ranks": {"speed": [1.0]}}, "unknown per-rank figure 'ranks.speed'"),
])
def test_validate_record_checks_types_inside(change, problem):
    assert validate_record({**_good_record(), **change}) == [problem]


def test_a_record_must_be_an_object():
    assert validate_record([1, 2]) == ["a step record is a JSON object, not list"]  # type: ignore[arg-type]


# -- the schema itself -------------------------------------------------------------------

def test_every_field_is_described():
    for key, field in FIELDS.items():
        assert field.types and field.unit in UNITS, key
        assert field.description and "\n" not in field.description, key
        assert field.source.split(".")[0] in ("train", "metrics", "comm"), key
        if field.exported:
            assert set(field.types) <= {int, float}, key
    assert set(PHASE_KEYS) <= set(FIELDS) and schema.OTHER_KEY in FIELDS


def test_phases_have_one_definition():
    from meshyard.doctor import diagnose
    from meshyard.metrics import timing

    assert schema.PHASES == ("data", "forward", "backward", "comm", "optimizer")
    assert timing.PHASES is schema.PHASES and diagnose.PHASES is schema.PHASES


# -- producers write only schema keys ------------------------------------------------------

def _written_keys(path: Path, names: set[str]) -> set[str]:
    """Constant keys stored into the dicts called ``names`` (``figures["x"] = ...``) or
    given in a dict literal assigned to one of them (or returned, when ``names`` holds
    "return")."""
    def named(node: ast.AST) -> bool:  # ``figures`` or ``self._stats``
        return (isinstance(node, ast.Name) and node.id in names) or (
            isinstance(node, ast.Attribute) and node.attr in names)

    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and named(node.value)
                and isinstance(node.slice, ast.Constant)):
            keys.add(node.slice.value)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(named(t) for t in targets):
                keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Dict) and "return" in names:
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return keys


@pytest.mark.parametrize("module, names, at_least", [
    ("train/trainer.py", {"record", "figures"}, {"step", "loss", "eval_loss", "loss_scale", "nonfinite",
                                                 "checkpoint_stall_s", "checkpoint_error"}),
    ("metrics/meter.py", {"figures"}, {"busy_s", "mfu", "model_tflops"}),
    ("metrics/timing.py", {"figures"}, {"allgather_wait_s"}),
    ("metrics/memory.py", {"figures", "return"}, {"rss_bytes", "peak_rss_bytes", "gpu_peak_reserved_bytes"}),
    ("train/pipeline_step.py", {"stats"}, set(keys_from("train.pipeline_step"))),
    ("train/expert_load.py", {"return"}, set(keys_from("train.expert_load"))),
])
def test_producers_write_schema_keys(module, names, at_least):
    written = _written_keys(SRC / module, names)
    assert at_least <= written, at_least - written  # the scan still sees the producer's keys
    assert written <= set(FIELDS), written - set(FIELDS)


def test_figures_of_producers_built_elsewhere_are_in_the_schema():
    from meshyard.comm.accounting import ByteCounter
    from meshyard.metrics.memory import NVML_FIGURES

    assert set(ByteCounter().take()) == set(keys_from("comm.accounting"))
    assert set(NVML_FIGURES) <= set(keys_from("metrics.memory"))


# -- readers read only schema keys ---------------------------------------------------------

def _read_keys(path: Path, names: set[str]) -> set[str]:
    """Constant keys read from records called ``names`` (or ``records[i]``): ``r["x"]``,
    ``r.get("x")`` and ``"x" in r``."""

    def is_record(node: ast.AST) -> bool:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "records":
            return True
        return isinstance(node, ast.Name) and node.id in names

    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_record(node.value):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                keys.add(node.slice.value)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and is_record(node.func.value) and node.args and isinstance(node.args[0], ast.Constant)):
            keys.add(node.args[0].value)
        elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
              and isinstance(node.ops[0], (ast.In, ast.NotIn)) and is_record(node.comparators[0])):
            keys.add(node.left.value)
    return keys


@pytest.mark.parametrize("module, names", [
    ("metrics/console.py", {"record"}),
    ("metrics/exporters.py", {"record"}),
    ("metrics/records.py", {"record"}),
    ("doctor/diagnose.py", {"r", "record"}),
    ("doctor/report.py", {"r"}),
    ("verify/compare.py", {"e", "a"}),
    ("bench/compression.py", set()),  # its ``r`` is also a result row: records[i] only
    ("worker.py", set()),
])
def test_readers_read_schema_keys(module, names):
    read = _read_keys(SRC / module, names)
    assert read <= set(FIELDS), read - set(FIELDS)
