"""Packages point one way: what each layer may import, read from the source itself.

Every import is found by parsing (at any depth: inside functions and ``TYPE_CHECKING``
blocks too, and ``importlib.import_module("...")`` with a literal name), so a rule
cannot be dodged by importing late. Each failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

import meshyard

SRC = Path(meshyard.__file__).resolve().parent
ROOT = SRC.parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative imports resolved against ``path``'s package."""
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _literal_import(node: ast.Call) -> str | None:
    """The name in ``importlib.import_module("x")`` or ``__import__("x")``, when it is a literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
        return node.args[0].value if isinstance(node.args[0].value, str) else None
    return None


def _module_level(node: ast.AST) -> Iterator[ast.AST]:
    """The statements run on import: everything but the bodies of functions and classes."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield from _module_level(child)


def imports(path: Path, module_level_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of everything ``path`` imports; ``from m import n`` gives ``m.n``
    so that ``from meshyard import plan`` counts as importing ``meshyard.plan``."""
    tree = ast.parse(path.read_text(), str(path))
    for node in _module_level(tree) if module_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(path, node)
            yield from ((node.lineno, f"{module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and (name := _literal_import(node)):
            yield node.lineno, name


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offending_imports(folder: str, forbidden: Callable[[str], bool]) -> list[str]:
    """'file:line imports name' for every import under ``src/meshyard/<folder>`` that
    ``forbidden(name)`` refuses."""
    found = []
    for path in sorted((SRC / folder).rglob("*.py")):
        for line, name in imports(path):
            if forbidden(name):
                found.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    return found


def offending_file_imports(path: Path, forbidden: Callable[[str], bool]) -> list[str]:
    """'file:line imports name' for every import of the one file ``path`` that ``forbidden(name)`` refuses."""
    return [f"{path.relative_to(ROOT.parent)}:{line} imports {name}" for line, name in imports(path) if forbidden(name)]


def test_the_run_directory_module_imports_nothing_of_meshyard():
    # The bottom layer: every package, config/ included, names run-directory paths through it.
    found = offending_file_imports(SRC / "run_dir.py", lambda name: _within(name, "meshyard"))
    assert not found, "run_dir.py may import nothing of meshyard:\n" + "\n".join(found)


def test_the_errors_module_imports_nothing_of_meshyard():
    # Below every package, config/ included: each may raise BadInput or derive its errors from it.
    found = offending_file_imports(SRC / "errors.py", lambda name: _within(name, "meshyard"))
    assert not found, "errors.py may import nothing of meshyard:\n" + "\n".join(found)


def test_config_imports_nothing_of_meshyard_outside_config():
    found = offending_imports("config", lambda name: _within(name, "meshyard")
                              and not _within(name, "meshyard.config") and name != "meshyard.run_dir.RunDir"
                              and not _within(name, "meshyard.errors"))
    assert not found, ("config/ may import only meshyard.config.*, meshyard.run_dir and meshyard.errors:\n"
                       + "\n".join(found))


def test_metrics_import_nothing_from_the_planner():
    found = offending_imports("metrics", lambda name: _within(name, "meshyard.plan"))
    assert not found, "metrics/ must not import meshyard.plan:\n" + "\n".join(found)


def test_models_never_import_torch_distributed():
    found = offending_imports("models", lambda name: _within(name, "torch.distributed"))
    assert not found, "models/ are plain nn.Modules, without torch.distributed:\n" + "\n".join(found)


LAYERS = [
    ("launch", ("meshyard.jobs", "meshyard.plan"),
     "launch/ only starts processes; job descriptions live in jobs/, placement in plan/"),
    ("plan", ("meshyard.launch", "meshyard.jobs"),
     "plan/ (placement included) sits below launch/ and jobs/"),
    ("jobs", ("meshyard.cli",),
     "jobs/ is a library under the command line"),
]
"""(folder under src/meshyard, packages it must not import, why): DESIGN.md's layout where it is checked."""

JOBS_IMPORTERS = ("meshyard.cli", "meshyard.jobs")
"""Job descriptions sit near the top of the layout: only the command line imports them."""


@pytest.mark.parametrize("folder, forbidden, why", LAYERS, ids=[layer[0] for layer in LAYERS])
def test_packages_import_only_what_sits_below_them(folder, forbidden, why):
    found = offending_imports(folder, lambda name: any(_within(name, package) for package in forbidden))
    assert not found, f"{why}:\n" + "\n".join(found)


def test_only_the_command_line_imports_the_job_descriptions():
    found = [f"{path.relative_to(ROOT.parent)}:{line} imports {name}"
             for path in sorted(SRC.rglob("*.py"))
             if not any(_within(_module_name(path), allowed) for allowed in JOBS_IMPORTERS)
             for line, name in imports(path) if _within(name, "meshyard.jobs")]
    assert not found, "only meshyard.cli may import meshyard.jobs:\n" + "\n".join(found)


def test_launch_holds_only_what_starts_processes():
    modules = sorted(path.stem for path in (SRC / "launch").glob("*.py") if path.stem != "__init__")
    assert modules == ["agent", "local", "nodes", "rendezvous"], (
        "launch/ starts processes (local, agent, nodes, rendezvous); job descriptions go to jobs/, "
        f"placement to plan/: found {modules}")


def _source_of(module: str) -> Path | None:
    relative = Path(*module.split("."))
    for candidate in (ROOT / relative.with_suffix(".py"), ROOT / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_a_worker_loads_no_planner_module():
    probe = ("import json, sys; import meshyard.worker; "
             "print(json.dumps(sorted(m for m in sys.modules if m == 'meshyard' or m.startswith('meshyard.'))))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    planner = [m for m in loaded if _within(m, "meshyard.plan")]
    # Name the module-level imports that pull the planner in, from the modules that were loaded.
    culprits = [f"{path.relative_to(ROOT.parent)}:{line} imports {name}"
                for module in loaded if not _within(module, "meshyard.plan") and (path := _source_of(module))
                for line, name in imports(path, module_level_only=True) if _within(name, "meshyard.plan")]
    assert not planner, (f"importing meshyard.worker loads {', '.join(planner)}; pulled in by:\n"
                         + "\n".join(culprits or ["(an import below module level: see the modules above)"]))


# What runs a trained model, in layers, lowest first (docs/architecture.md). A package of a
# row imports nothing from a later row, nor from the other packages of its own row; the
# last row (entry points, launchers and the tools that read whole runs) is only a target.
MODEL_LAYERS: list[tuple[str, ...]] = [
    ("inference",),
    ("serve", "export"),
    ("cli", "api", "worker", "validate", "launch", "bench", "verify", "doctor", "plan"),
]


def _above(package: str) -> list[str]:
    """The packages ``package`` of ``MODEL_LAYERS`` may not import: every later row, and
    the other packages of its own row."""
    row = next(i for i, layer in enumerate(MODEL_LAYERS) if package in layer)
    return [other for layer in MODEL_LAYERS[row:] for other in layer if other != package]


@pytest.mark.parametrize("package", [p for layer in MODEL_LAYERS[:-1] for p in layer])
def test_model_packages_import_only_the_layers_below_them(package):
    above = [f"meshyard.{other}" for other in _above(package)]
    found = offending_imports(package, lambda name: any(_within(name, other) for other in above))
    assert not found, f"{package}/ may not import {', '.join(above)}:\n" + "\n".join(found)


def test_serve_and_export_never_import_each_other():
    assert "export" in _above("serve") and "serve" in _above("export")


def test_inference_stands_below_serve_export_and_the_training_loop():
    assert {"serve", "export", "cli", "api", "worker"} <= set(_above("inference"))
    found = offending_imports("inference", lambda name: _within(name, "meshyard.train"))
    assert not found, "inference/ runs a trained model, without the training loop:\n" + "\n".join(found)


def _module_of(name: str) -> str | None:
    """The meshyard module an imported name lies in (``meshyard.a.b.C`` -> ``meshyard.a.b``)."""
    parts = name.split(".")
    while parts and not _source_of(".".join(parts)):
        parts.pop()
    return ".".join(parts) or None


def import_circles(packages: list[str]) -> list[list[str]]:
    """Circles among the modules of ``src/meshyard/<package>`` for each of ``packages``,
    counting imports at any depth (a late import hides a circle only from Python)."""
    graph: dict[str, set[str]] = {}
    for package in packages:
        for path in sorted((SRC / package).rglob("*.py")):
            graph[_module_name(path)] = {module for _, name in imports(path) if _within(name, "meshyard")
                                         and (module := _module_of(name)) and module != _module_name(path)}
    circles, done = [], set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            circles.append(trail[trail.index(module):] + [module])
            return
        if module in done or module not in graph:
            return
        for target in sorted(graph[module]):
            visit(target, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return circles


def test_no_import_circle_anywhere():
    """No two modules of meshyard import each other, directly or round a loop, at any depth:
    a type-only import (``TYPE_CHECKING``) or a late one inside a function counts."""
    circles = import_circles([""])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_circle_rule_sees_a_circle_hidden_in_a_function(tmp_path, monkeypatch):
    package = tmp_path / "meshyard" / "pkg"
    package.mkdir(parents=True)
    (tmp_path / "meshyard" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from meshyard.pkg.b import g\n")
    (package / "b.py").write_text("def g():\n    from meshyard.pkg import a\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "meshyard")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_circles(["pkg"]) == [["meshyard.pkg.a", "meshyard.pkg.b", "meshyard.pkg.a"]]


MAX_FUNCTION_LINES = 60


def long_functions(folder: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'file:line name (N lines)' for every function or method under ``folder`` longer
    than ``limit`` lines: the span of its ``def`` statement, docstring included."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_needs_more_than_60_lines():
    found = long_functions(SRC)
    assert not found, "split these into named steps:\n" + "\n".join(found)


def test_the_length_rule_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text(f"def too_long():\n{body}\n\n\ndef short():\n    pass\n")
    assert long_functions(tmp_path / "pkg") == ["pkg/long.py:1 too_long (61 lines)"]


# A run directory's layout is the product's contract (the README's table): its names are
# spelled in run_dir.py alone. Files are found anywhere in a string; folders as the whole
# string or a segment of a path, since words such as "checkpoints" are also prose.
RUN_DIR_FILES = ("config.toml", "run.json", "summary.json", "metrics.jsonl", "restarts.jsonl", "preemption.json",
                 "agent.log", "report.html", "prometheus.json", "tokenizer.json")
RUN_DIR_FOLDERS = ("logs", "failures", "hang", "checkpoints")  # not "tensorboard": also a package's name
_FOLDER = re.compile(rf"(?:^|/)(?:{'|'.join(RUN_DIR_FOLDERS)})(?:/|$)")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of string constants standing alone as statements: docstrings of modules,
    classes and functions, and those under attributes."""
    return {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def run_dir_names_spelled(folder: Path, owner: Path | None = None) -> list[str]:
    """'file:line spells name' for every string constant under ``folder`` (f-strings'
    parts included; docstrings and comments not) holding a run-directory name, but in ``owner``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        if path == owner:
            continue
        tree = ast.parse(path.read_text(), str(path))
        docstrings = _docstrings(tree)
        strings = sorted((node.lineno, node.col_offset, node.value) for node in ast.walk(tree)
                         if isinstance(node, ast.Constant) and isinstance(node.value, str)
                         and id(node) not in docstrings)
        for line, _, text in strings:
            names = [name for name in RUN_DIR_FILES if name in text] + _FOLDER.findall(text)
            found += [f"{path.relative_to(folder.parent)}:{line} spells {name.strip('/')!r}" for name in names]
    return found


def test_run_directory_names_are_spelled_only_in_run_dir():
    found = run_dir_names_spelled(SRC, owner=SRC / "run_dir.py")
    assert not found, "name these through meshyard.run_dir.RunDir:\n" + "\n".join(found)


def test_the_run_directory_rule_sees_names_in_strings_but_not_in_docstrings_or_prose(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        '"""Writes metrics.jsonl and logs/."""\n'
        "# config.toml\n"
        "def f(run_dir, rank):\n"
        '    """Reads run.json."""\n'
        '    note = "keeps the newest checkpoints; logs nothing"\n'
        '    return run_dir / "logs" / f"{rank}/summary.json", f"{run_dir}/checkpoints", note\n')
    assert run_dir_names_spelled(tmp_path / "pkg") == [
        "pkg/mod.py:6 spells 'logs'", "pkg/mod.py:6 spells 'summary.json'", "pkg/mod.py:6 spells 'checkpoints'"]


# One command shape (cli.py): a module that adds a subcommand's parser does it in
# ``register(subparsers)``, which binds a handler ``(args, overrides) -> int`` with
# ``set_defaults(handler=...)``; private helpers may add parsers for it.
REGISTER = "register"
HANDLER_ARGS = ["args", "overrides"]


def _adds_a_parser(node: ast.AST) -> bool:
    return any(isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_parser"
               for call in ast.walk(node))


def _bound_handlers(tree: ast.Module) -> list[ast.expr]:
    """The values of ``handler=`` in every ``set_defaults(...)`` call of ``tree``."""
    return [keyword.value for call in ast.walk(tree) if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute) and call.func.attr == "set_defaults"
            for keyword in call.keywords if keyword.arg == "handler"]


def command_shape_problems(folder: Path) -> list[str]:
    """'file: problem' for every module under ``folder`` that adds a subcommand's parser
    other than through ``register``, binds no handler, or binds one of another signature."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        adders = sorted(name for name, node in functions.items() if _adds_a_parser(node))
        if not adders:
            continue
        where = path.relative_to(folder.parent)
        if REGISTER not in functions:
            found.append(f"{where}: adds parsers ({', '.join(adders)}) but defines no {REGISTER}(subparsers)")
        others = [name for name in adders if name != REGISTER and not name.startswith("_")]
        if others:
            found.append(f"{where}: registers through {', '.join(others)}; only {REGISTER} may")
        handlers = _bound_handlers(tree)
        if not handlers:
            found.append(f"{where}: binds no handler (set_defaults(handler=...))")
        for handler in handlers:
            node = functions.get(handler.id) if isinstance(handler, ast.Name) else None
            names = [a.arg for a in node.args.posonlyargs + node.args.args] if node else None
            if names != HANDLER_ARGS:
                found.append(f"{where}:{handler.lineno} handler {ast.unparse(handler)} is not a function of "
                             f"this module taking ({', '.join(HANDLER_ARGS)}): {names}")
    return found


def test_every_command_registers_through_register_and_one_handler_signature():
    found = command_shape_problems(SRC)
    assert not found, "give every command the one shape (see meshyard/cli.py):\n" + "\n".join(found)


def test_the_command_shape_rule_sees_another_registration_name_and_handler(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "good.py").write_text(
        "def register(subparsers):\n    p = subparsers.add_parser('x')\n    p.set_defaults(handler=main)\n\n\n"
        "def main(args, overrides):\n    return 0\n")
    (tmp_path / "pkg" / "bad.py").write_text(
        "def add_parser(subparsers):\n    p = subparsers.add_parser('y')\n    p.set_defaults(handler=main)\n\n\n"
        "def main(args):\n    return 0\n")
    assert command_shape_problems(tmp_path / "pkg") == [
        "pkg/bad.py: adds parsers (add_parser) but defines no register(subparsers)",
        "pkg/bad.py: registers through add_parser; only register may",
        "pkg/bad.py:3 handler main is not a function of this module taking (args, overrides): ['args']"]


def modules_assigning(folder: Path, name: str) -> list[str]:
    """The files under ``folder`` that assign ``name`` at any depth."""
    def assigns(node: ast.AST) -> bool:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        return any(isinstance(target, ast.Name) and target.id == name for target in targets)
    return [str(path.relative_to(folder.parent)) for path in sorted(folder.rglob("*.py"))
            if any(assigns(node) for node in ast.walk(ast.parse(path.read_text(), str(path))))]


def test_the_bad_input_exit_code_is_defined_once():
    assert modules_assigning(SRC, "EXIT_BAD_INPUT") == ["meshyard/errors.py"], (
        "EXIT_BAD_INPUT is defined in meshyard/errors.py alone; import it from there")
