"""Loading users' own builders named in the config as ``module:function`` or ``file.py:function``."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable


class PluginError(ValueError):
    pass


def is_custom_reference(name: str) -> bool:
    """True for ``pkg.module:function`` and ``path/to/file.py:function`` references."""
    return ":" in name and not name.startswith(":") and not name.endswith(":")


def load_callable(reference: str) -> Callable[..., Any]:
    """Import the function named by ``reference``; errors say exactly what is missing.

    Raises ``PluginError`` naming the file and line when the module does not import
    (a syntax error, a missing import, any error while it runs).
    """
    target, _, attr = reference.rpartition(":")
    module = _import_file(reference, target) if target.endswith(".py") else _import_module(reference, target)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PluginError(f"'{reference}': module '{target}' has no function '{attr}'")
    return fn


def _import_file(reference: str, target: str) -> ModuleType:
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise PluginError(f"'{reference}': file {path} does not exist")
    module_name = f"meshyard_user_{path.stem}_{abs(hash(str(path)))}"
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as the import system does (dataclasses and pickling in
    # the file look themselves up there), and taken out again when it fails, so that the
    # corrected file is read afresh instead of a half-run module being reused.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise PluginError(f"'{reference}': {describe_import_failure(exc)}") from None
    return module


def _import_module(reference: str, target: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (target == exc.name or target.startswith(exc.name + ".")):
            raise PluginError(f"'{reference}': cannot import module '{target}' ({exc}); install it or put its "
                              "folder on PYTHONPATH") from None
        raise PluginError(f"'{reference}': {describe_import_failure(exc)}") from None
    except Exception as exc:  # the import system already dropped the failed module from sys.modules
        raise PluginError(f"'{reference}': {describe_import_failure(exc)}") from None


def describe_import_failure(exc: BaseException) -> str:
    """Where and why a user's module failed to import, in one sentence: file, line, source text, error."""
    if isinstance(exc, SyntaxError):
        where, line, text = exc.filename, exc.lineno, (exc.text or "").strip()
        problem = f"syntax error: {exc.msg}"
    else:
        frame = _user_frame(exc)
        where, line, text = (frame.filename, frame.lineno, (frame.line or "").strip()) if frame else (None, None, "")
        problem = f"{type(exc).__name__}: {exc}"
    location = f" at {where}, line {line}" if where else ""
    source = f" (`{text}`)" if text else ""
    return f"importing it failed{location}{source}: {problem}. Fix that line (or install what it imports) and run again"


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The outermost frame of the traceback that belongs to the user's code.

    The frames above it are this module and the import machinery; the outermost user
    frame is the line the user wrote, even when the error was raised deeper down.
    """
    skip = (__file__, "<frozen ")
    for frame in traceback.extract_tb(exc.__traceback__):
        if not frame.filename.startswith(skip) and "importlib" not in frame.filename:
            return frame
    return None


def unaccepted_keywords(fn: Callable[..., Any], names: Iterable[str]) -> list[str]:
    """Those of ``names`` that ``fn`` cannot take as keyword arguments (none if it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins): let the call decide
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    keywords = {name for name, p in params.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return [name for name in names if name not in keywords]


def call_with_accepted(fn: Callable[..., Any], offered: dict[str, Any], extra: dict[str, Any]) -> Any:
    """Call ``fn`` with ``extra`` plus those ``offered`` keywords its signature accepts."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_any or k in params}
    kwargs.update(extra)
    return fn(**kwargs)
