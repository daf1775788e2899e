"""The output sinks' config sections (`parquet`, `prometheus`): paths stay under MONITOR_OUTPUT_DIR."""

from __future__ import annotations

import os

from trainermon.stats.table import VALUE_STATS

from .schema import MonitorConfig, ParquetConfig, PrometheusConfig
from .values import _choices, _fail, _int, _opt_str, _section

_DEFAULT = MonitorConfig()
PARQUET_COMPRESSIONS = ("zstd", "snappy", "gzip", "lz4", "none")


#: What an output path from the config may be. Config files are edited while jobs run (and by tools),
#: so a config alone never sends output outside MONITOR_OUTPUT_DIR; only the environment can.
RELATIVE_PATH = (
    "a path relative to MONITOR_OUTPUT_DIR without '..' (to write elsewhere, set MONITOR_OUTPUT_DIR)"
)


def _relative_path(section: str, values: dict, key: str) -> None:
    """An output location under MONITOR_OUTPUT_DIR (or null): relative, no '..' component, no NUL."""
    value = values[key]
    if value is None:
        return
    allowed = RELATIVE_PATH + ", or null"
    if not isinstance(value, str) or not value or "\x00" in value:
        raise _fail(f"{section}.{key}", value, allowed)
    parts = value.replace("\\", "/").split("/")
    if os.path.isabs(value) or value.startswith(("/", "\\")) or ".." in parts:
        raise _fail(f"{section}.{key}", value, allowed)


def _compression_level(codec: str, level: int) -> None:
    """Refuse a level the codec does not take, so that the sink does not disable itself at its first flush
    (pyarrow raises only when it writes). Imports pyarrow (once, ~0.1 s); a write of one row to memory."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # the sink itself says that pyarrow is missing
        return
    if codec == "none" or not pa.Codec.supports_compression_level(codec):
        raise _fail("parquet.compression_level", level, f"null ({codec!r} takes no compression level)")
    lo, hi = pa.Codec.minimum_compression_level(codec), pa.Codec.maximum_compression_level(codec)
    allowed = f"null or an integer in [{lo}, {hi}] for {codec!r}"
    if not lo <= level <= hi:  # zstd and lz4 would clamp silently, gzip fails at the first flush
        raise _fail("parquet.compression_level", level, allowed)
    table = pa.table({"x": [0.0]})
    try:  # the sink's own call: whatever this pyarrow refuses is refused here, not at the first flush
        pq.write_table(table, pa.BufferOutputStream(), compression=codec, compression_level=level)
    except (pa.ArrowException, OSError, ValueError):
        raise _fail("parquet.compression_level", level, allowed) from None


def _parquet(raw: dict, formats: tuple[str, ...] = ("parquet",)) -> ParquetConfig:
    """The `parquet` section; the codec's level is checked against pyarrow only when `formats` holds
    parquet (the core runs without pyarrow)."""
    values = _section(raw, "parquet", _DEFAULT.parquet)
    _relative_path("parquet", values, "dir")
    for key in ("steps_per_part", "rows_per_part"):
        values[key] = _int({f"parquet.{key}": values[key]}, f"parquet.{key}", 1, 10**9)
    seconds = values["seconds_per_part"]
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0
    ):
        raise _fail("parquet.seconds_per_part", seconds, "a positive number of seconds, or null (no limit)")
    if values["compression"] not in PARQUET_COMPRESSIONS:
        raise _fail("parquet.compression", values["compression"], f"one of {list(PARQUET_COMPRESSIONS)}")
    level = values["compression_level"]
    if level is not None and (isinstance(level, bool) or not isinstance(level, int)):
        raise _fail("parquet.compression_level", level, "null or an integer (codec-specific range)")
    if level is not None and "parquet" in formats:
        _compression_level(values["compression"], level)
    return ParquetConfig(**values)


def _prometheus(
    raw: dict, ops: tuple[str, ...] = VALUE_STATS, formats: tuple[str, ...] = ("prometheus",)
) -> PrometheusConfig:
    """The `prometheus` section; with the prometheus format on, `stats` may name only statistics that
    `ops` computes (the endpoint would serve 0.0 for the others; with it off, nothing is served)."""
    from trainermon.collect.records import FAMILIES, STATE_FAMILIES

    values = _section(raw, "prometheus", _DEFAULT.prometheus)
    if not isinstance(values["host"], str) or not values["host"]:
        raise _fail("prometheus.host", values["host"], "an address to bind, e.g. '127.0.0.1' or '0.0.0.0'")
    values["port"] = _int({"prometheus.port": values["port"]}, "prometheus.port", 0, 65535)
    _opt_str("prometheus", values, "advertise_host")
    _relative_path("prometheus", values, "sd_dir")
    for key in ("per_parameter", "per_rank"):
        if not isinstance(values[key], bool):
            raise _fail(f"prometheus.{key}", values[key], "true or false")
    _choices("prometheus", values, "stats", VALUE_STATS)
    computed = [s for s in VALUE_STATS if s in ops]
    missing = [s for s in values["stats"] or () if s not in computed]
    if missing and "prometheus" in formats:
        raise _fail(
            "prometheus.stats",
            missing if len(missing) > 1 else missing[0],
            f"the statistics computed from ops {computed} (add the others to ops)",
        )
    _choices("prometheus", values, "families", FAMILIES + STATE_FAMILIES)
    values["max_series"] = _int(
        {"prometheus.max_series": values["max_series"]}, "prometheus.max_series", 1, 10**7
    )
    window = values["max_window_s"]
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not 1 <= window <= 86400:
        raise _fail(
            "prometheus.max_window_s",
            window,
            "a number of seconds in [1, 86400], at least the scrape interval (default 60)",
        )
    values["max_window_s"] = float(window)
    return PrometheusConfig(**values)
