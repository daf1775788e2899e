"""Configuration: typed sections (`schema`, the only defaults), validation (`parse`), the environment
(`env`)."""

from .env import Env, read_env
from .parse import ConfigError, load_config, parse_config, read_config_json
from .schema import AlertConfig, AttnLogitConfig, MonitorConfig, ParquetConfig, PrometheusConfig

__all__ = [
    "AlertConfig",
    "AttnLogitConfig",
    "ConfigError",
    "Env",
    "MonitorConfig",
    "ParquetConfig",
    "PrometheusConfig",
    "load_config",
    "parse_config",
    "read_config_json",
    "read_env",
]
