"""Loading users' own builders named in the config as ``module:function`` or ``file.py:function``."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable


class PluginError(ValueError):
    pass


def is_custom_reference(name: str) -> bool:
    """True for ``pkg.module:function`` and ``path/to/file.py:function`` references."""
    return ":" in name and not name.startswith(":") and not name.endswith(":")


def load_callable(reference: str) -> Callable[..., Any]:
    """Import the function named by ``reference``; errors say exactly what is missing."""
    target, _, attr = reference.rpartition(":")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise PluginError(f"'{reference}': file {path} does not exist")
        module_name = f"meshyard_user_{path.stem}_{abs(hash(str(path)))}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise PluginError(f"'{reference}': cannot import module '{target}' ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PluginError(f"'{reference}': module '{target}' has no function '{attr}'")
    return fn


def call_with_accepted(fn: Callable[..., Any], offered: dict[str, Any], extra: dict[str, Any]) -> Any:
    """Call ``fn`` with ``extra`` plus those ``offered`` keywords its signature accepts."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_any or k in params}
    kwargs.update(extra)
    return fn(**kwargs)
