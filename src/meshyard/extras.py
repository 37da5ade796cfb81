"""Optional dependencies: a feature that needs one says which pip extra installs it.

meshyard's core installs only what training needs. Plots, the Prometheus endpoint,
safetensors export, TensorBoard, Weights & Biases, object storage and Kubernetes manifests each come with an extra
(``pip install 'meshyard[report]'`` and so on); asking for such a feature without its
package is bad input, reported before anything runs.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import fsspec

from meshyard.config.sections import CheckpointConfig, MetricsConfig
from meshyard.errors import BadInput

# top-level import name -> (pip extra, distribution name)
EXTRAS: dict[str, tuple[str, str]] = {
    "matplotlib": ("report", "matplotlib"),
    "prometheus_client": ("prometheus", "prometheus-client"),
    "safetensors": ("safetensors", "safetensors"),
    "transformers": ("hf", "transformers"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "s3fs": ("s3", "s3fs"),
    "yaml": ("k8s", "pyyaml"),
    "starlette": ("serve", "starlette"),
    "uvicorn": ("serve", "uvicorn"),
    "httptools": ("serve", "httptools"),
    "jinja2": ("serve", "jinja2"),
    "redis": ("redis", "redis"),
    "onnx": ("export", "onnx"),
    "onnxscript": ("export", "onnxscript"),
    "onnxruntime": ("export", "onnxruntime"),
    "tokenizers": ("text", "tokenizers"),
    "wandb": ("wandb", "wandb"),
}


class MissingExtra(BadInput, ImportError):
    """A feature's optional package is not installed; the message names the extra."""


def missing_message(module: str, feature: str) -> str:
    extra, distribution = EXTRAS[module.split(".")[0]]
    return (f"{feature} needs the '{distribution}' package, which is not installed; "
            f"install it with: pip install 'meshyard[{extra}]'")


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None
        return False


def check(module: str, feature: str) -> str | None:
    """The problem to report when ``feature`` cannot have ``module``, else None."""
    return None if is_installed(module) else missing_message(module, feature)


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise ``MissingExtra`` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(missing_message(module, feature)) from None


def config_problems(metrics: MetricsConfig, checkpoint: CheckpointConfig) -> list[str]:
    """What a config asks for that this installation lacks, one message per feature."""
    wanted = [(metrics.prometheus, "prometheus_client", "metrics.prometheus = true"),
              (metrics.tensorboard, "tensorboard", "metrics.tensorboard = true"),
              (metrics.wandb, "wandb", "metrics.wandb = true")]
    problems = [problem for on, module, feature in wanted if on and (problem := check(module, feature))]
    storage = _storage_problem(checkpoint.dir)
    return problems + [storage] if storage else problems


def _storage_problem(url: str) -> str | None:
    """A checkpoint location whose fsspec filesystem is unknown or not installed."""
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        return None
    where = f"checkpoint.dir = '{url}'"
    if protocol in ("s3", "s3a"):
        return check("s3fs", where)
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return f"{where}: fsspec knows no storage protocol '{protocol}://'; use a local path, s3:// or memory://"
    except ImportError as exc:  # fsspec knows it, but its package is not installed
        return f"{where}: {exc}"
    return None
