"""meshyard: distributed training for PyTorch from one TOML file.

Public API::

    meshyard.load_config(path, overrides) -> Config
    meshyard.run(config, nproc=None) -> RunResult
"""

from meshyard.api import RunResult, run
from meshyard.config.load import ConfigError, load_config
from meshyard.config.sections import Config

__all__ = ["Config", "ConfigError", "RunResult", "load_config", "run"]
__version__ = "0.1.0"
