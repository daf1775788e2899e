"""trainermon: a low-overhead training-status monitor for PyTorch, drop-in for msprobe's TrainerMon."""

from .config import ConfigError, MonitorConfig, load_config, parse_config
from .monitor import PrintStructDone, TrainerMon

__version__ = "0.1.0"
__all__ = [
    "TrainerMon",
    "ConfigError",
    "MonitorConfig",
    "PrintStructDone",
    "load",
    "load_config",
    "parse_config",
]


def __getattr__(name: str):
    # `trainermon.load` imports pyarrow: only when it is used, never at `import trainermon`.
    if name == "load":
        from .loader import load

        return load
    raise AttributeError(f"module 'trainermon' has no attribute {name!r}")
