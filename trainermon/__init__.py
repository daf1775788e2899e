"""trainermon: a low-overhead training-status monitor for PyTorch, drop-in for msprobe's TrainerMon."""

from .config import ConfigError, MonitorConfig, load_config, parse_config
from .monitor import PrintStructDone, TrainerMon

__version__ = "0.1.0"
__all__ = ["TrainerMon", "ConfigError", "MonitorConfig", "PrintStructDone", "load_config", "parse_config"]
