"""Statistics: which tensors can be read (`kinds`), partial statistics and how they merge (`partials`), the
engine that computes them on the tensor's device (`engine`, with the native CPU kernel in `fused`)."""

from .engine import CHUNK, DEVICE_CHUNK, GROUP_MAX, RUN, EngineOptions, StatsEngine
from .kinds import Readable, Unreadable, readable
from .partials import (
    ADDITIVE,
    INFS,
    MAX,
    MIN,
    NANS,
    NUM_PARTIALS,
    PARTIAL_NAMES,
    SUM,
    SUMSQ,
    ZEROS,
    empty_partials,
    finalize,
    merge,
    reduce_across,
)

__all__ = [
    "ADDITIVE",
    "CHUNK",
    "DEVICE_CHUNK",
    "GROUP_MAX",
    "INFS",
    "MAX",
    "MIN",
    "NANS",
    "NUM_PARTIALS",
    "PARTIAL_NAMES",
    "RUN",
    "SUM",
    "SUMSQ",
    "ZEROS",
    "EngineOptions",
    "Readable",
    "StatsEngine",
    "Unreadable",
    "empty_partials",
    "finalize",
    "merge",
    "readable",
    "reduce_across",
]
