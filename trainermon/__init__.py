"""trainermon: a low-overhead training-status monitor for PyTorch, drop-in for msprobe's TrainerMon."""

from typing import TYPE_CHECKING

from .config import ConfigError, MonitorConfig, load_config, parse_config

if TYPE_CHECKING:
    from .api import PrintStructDone, TrainerMon
    from .csv2tb import csv2tensorboard_by_step
    from .loader import load
    from .seed import seed_all

__version__ = "0.1.0"
__all__ = [
    "TrainerMon",
    "ConfigError",
    "csv2tensorboard_by_step",
    "MonitorConfig",
    "PrintStructDone",
    "load",
    "load_config",
    "parse_config",
    "seed_all",
]


def __getattr__(name: str):
    # Imported on first use: the monitor needs torch, `load` needs pyarrow; the offline tools
    # (`trainermon analyze`, `trainermon.analysis`) need neither and start without them.
    if name in ("TrainerMon", "PrintStructDone"):
        from . import api

        return getattr(api, name)
    if name == "seed_all":
        from .seed import seed_all

        return seed_all
    if name == "csv2tensorboard_by_step":
        from .csv2tb import csv2tensorboard_by_step

        return csv2tensorboard_by_step
    if name == "load":
        from .loader import load

        return load
    raise AttributeError(f"module 'trainermon' has no attribute {name!r}")
