"""msprobe's `csv2tensorboard_by_step`, for scripts that call it: the CSV output of the runs between two
times (trainermon's or msprobe's) as TensorBoard event files laid out and tagged as msprobe writes them,
`{output}/rank{R}/{family}/` with tags `vp{vpp}:{name}[:micro{m}]/{statistic}`, one scalar per CSV step.
(`trainermon convert --to tensorboard` writes the TensorBoard sink's tags instead.)

Run directories are `{time}-rank{R}-...` under `monitor_path`, `{time}` as `Nov27_09-06-49`; the times
given select them, both ends included. The directories of one rank and run id (a dynamic reload that
changes the columns or the sinks opens a new one) are one run, read in time order; directories without
CSV are skipped. Where msprobe keeps an arbitrary one of several runs (run ids) of one rank in the range,
this takes the latest and names the others in a warning; where it writes an empty output for a range with
no run, this raises.

`to_tensorboard` is `trainermon convert --to tensorboard`: the TensorBoard sink's tags, one event-file
directory per rank directory."""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import shutil
import threading
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime
from typing import Any

from trainermon.collect.family_columns import FAMILY_COLUMNS
from trainermon.exporters.csv_files import FILE
from trainermon.exporters.parquet_files import STATS

from .convert import (
    Written,
    _columns,
    _layout,
    _make_out,
    _number,
    _rank_and_run,
    _read_csv,
    find_csv_files,
)
from .names import msprobe_tag
from .parquet_left_out import parquet_left_out

logger = logging.getLogger("trainermon")

#: The families msprobe converts (its `data_type_list` values), and SGD's momentum_buffer, which
#: `trainermon convert --to tensorboard` converts too (msprobe monitors no such state).
FAMILIES = (
    "actv",
    "actv_grad",
    "exp_avg",
    "exp_avg_sq",
    "grad_unreduced",
    "grad_reduced",
    "param_origin",
    "param_updated",
    "momentum_buffer",
)
#: Statistic columns written as scalars, where the CSV has them (msprobe's, then trainermon's own).
STAT_COLUMNS = ("norm", "min", "max", "zeros", "nans", "id", "mean", "infs", "numel")
TIME_FORMAT = "%b%d_%H-%M-%S"
_RUN_DIR = re.compile(r"^([\w-]{0,20})-rank(\d{1,5})-")
MAX_PROCESSES = 128


def csv2tensorboard_by_step(
    monitor_path: str | os.PathLike,
    time_start: str | None = None,
    time_end: str | None = None,
    process_num: int = 1,
    data_type_list: list[str] | None = None,
    output_dirpath: str | os.PathLike | None = None,
) -> str:
    """Convert the runs under `monitor_path` whose time is within [`time_start`, `time_end`] (None: open)
    for the families in `data_type_list` (None: all of `FAMILIES`), `process_num` ranks at a time; return
    the output directory (default `{monitor_path}/{now}-csv2tensorboard_by_step`). Needs tensorboard."""
    if (
        isinstance(process_num, bool)
        or not isinstance(process_num, int)
        or not 1 <= process_num <= MAX_PROCESSES
    ):
        raise ValueError(f"process_num: {process_num!r}; allowed: an integer from 1 to {MAX_PROCESSES}")
    families = _families(data_type_list)
    monitor_path = os.fspath(monitor_path)
    if not os.path.isdir(monitor_path):
        raise FileNotFoundError(f"monitor_path: {monitor_path!r} is not a directory")
    start, end = _time("time_start", time_start), _time("time_end", time_end)
    if start is not None and end is not None and start > end:
        raise ValueError(f"time_start: {time_start!r} is after time_end {time_end!r}")
    runs = run_directories(monitor_path, start, end)
    if not runs:
        raise FileNotFoundError(
            f"monitor_path: no '{{time}}-rank{{R}}-...' run directory in {monitor_path!r} between "
            f"{time_start or 'the first'} and {time_end or 'the last'}"
        )
    if output_dirpath is None:
        now = datetime.now().strftime(TIME_FORMAT)
        output_dirpath = os.path.join(monitor_path, f"{now}-csv2tensorboard_by_step")
    out = os.fspath(output_dirpath)
    os.makedirs(out, exist_ok=True)
    tasks = [(rank, paths, families, out) for rank, paths in sorted(runs.items())]
    written: set[str] = set()
    workers = min(process_num, len(tasks))
    if workers > 1 and threading.active_count() > 1:
        # A forked copy of a process with threads may hold their locks forever, and a spawned one runs
        # the caller's script again (without a main guard: the conversion, again, in every worker)
        logger.warning(
            "trainermon: csv2tensorboard_by_step: process_num=%d, but this process runs %d threads: "
            "converting in this process, one rank after another",
            process_num,
            threading.active_count(),
        )
        workers = 1
    if workers == 1:
        for task in tasks:
            written.update(convert_rank(*task))
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            for future in [pool.submit(convert_rank, *task) for task in tasks]:
                written.update(future.result())
    asked = families if data_type_list is not None else () if written else FAMILIES
    if [f for f in asked if f not in written]:
        logger.warning(
            "trainermon: csv2tensorboard_by_step: no rows of %s in the %d run(s) converted",
            [f for f in asked if f not in written],
            len(tasks),
        )
    logger.info("trainermon: csv2tensorboard_by_step: %d rank(s) written to %s", len(tasks), out)
    return out


def run_directories(monitor_path: str, start: datetime | None, end: datetime | None) -> dict[int, list[str]]:
    """{rank: its run's directories in time order} within [start, end]. A dynamic reload that changes the
    columns or the sinks opens a new directory of the same run id: all of them are the run. Of several
    run ids of a rank, the latest-started wins, with a warning naming the others (as msprobe's converter
    keeps one). Directories without a CSV file (prometheus.json/parquet.json pointers) are skipped.
    Costs one listing per directory."""
    found: dict[int, dict[str, list[tuple[datetime, str]]]] = defaultdict(lambda: defaultdict(list))
    for name in sorted(os.listdir(monitor_path)):
        match = _RUN_DIR.match(name)
        path = os.path.join(monitor_path, name)
        if match is None or not os.path.isdir(path):
            continue
        when = _parse_time(match.group(1))
        if when is None:
            logger.warning("trainermon: csv2tensorboard_by_step: no run time in the name %s: skipped", name)
            continue
        if (start is None or when >= start) and (end is None or when <= end) and _has_csv(path):
            rank, run_id = _rank_and_run(path)
            found[int(match.group(2))][run_id].append((when, path))
    chosen = {}
    for rank, by_run in found.items():
        for dirs in by_run.values():
            dirs.sort()
        # a run starts at its first directory; a tie (one second) goes to the one that wrote last
        runs = sorted(by_run.values(), key=lambda dirs: (dirs[0][0], dirs[-1][0], dirs[-1][1]))
        chosen[rank] = [path for _, path in runs[-1]]
        if len(runs) > 1:
            logger.warning(
                "trainermon: csv2tensorboard_by_step: rank %d has %d runs in the range; "
                "converting the latest (%s), not %s",
                rank,
                len(runs),
                [os.path.basename(p) for p in chosen[rank]],
                [os.path.basename(p) for dirs in runs[:-1] for _, p in dirs],
            )
    return chosen


def _has_csv(directory: str) -> bool:
    return any(FILE.match(name) for name in os.listdir(directory))


def convert_rank(rank: int, directories: list[str] | str, families: tuple[str, ...], out: str) -> list[str]:
    """One rank's run directories (in time order: a step two of them hold is taken from the later one,
    warned): one event-file directory per family with rows (an earlier one replaced); returns the
    families written."""
    from torch.utils.tensorboard import SummaryWriter

    directories = [directories] if isinstance(directories, str) else directories
    written = []
    seen: dict[tuple[str, int], set[int]] = {}  # (family, rank): the CSV steps, for the Parquet note
    for family in families:
        pattern = re.compile(rf"{re.escape(family)}_\d+-\d+\.csv")
        series: dict[str, dict[int, list[tuple[str, float]]]] = defaultdict(dict)
        for directory in directories:
            own: dict[str, dict[int, list[tuple[str, float]]]] = defaultdict(dict)
            for name in sorted(f for f in os.listdir(directory) if pattern.fullmatch(f)):
                _read_family(os.path.join(directory, name), own)
            _merge(series, own, directory)
        seen[(family, rank)] = {step for steps in series.values() for step in steps}
        if not series:
            continue
        target = os.path.join(out, f"rank{rank}", family)
        if os.path.exists(target):
            logger.warning("trainermon: csv2tensorboard_by_step: replacing %s", target)
            shutil.rmtree(target)
        writer = SummaryWriter(target)
        try:
            for tag, steps in series.items():
                for step in sorted(steps):
                    for stat, value in steps[step]:
                        writer.add_scalar(f"{tag}/{stat}", value, step)
        finally:
            writer.close()
        written.append(family)
    # a dynamic run's Parquet phase (format switched mid-run): its steps are not CSV, said per rank
    note = parquet_left_out(directories, _rank_and_run(directories[0])[1], seen, families)
    if note is not None:
        logger.warning("trainermon: csv2tensorboard_by_step: rank %d: %s", rank, note)
    return written


def _merge(series: dict, own: dict, directory: str) -> None:
    """Add one directory's rows to `series`; the steps of one run's directories are disjoint (a reload
    starts the new directory at the next collected step), so a step in both is said, the later kept."""
    again = 0
    for tag, steps in own.items():
        again += sum(step in series[tag] for step in steps)
        series[tag].update(steps)
    if again:
        logger.warning(
            "trainermon: csv2tensorboard_by_step: %s: %d (tag, step) pairs an earlier directory of the run "
            "holds too; this directory's values are written",
            directory,
            again,
        )


def _read_family(path: str, series: dict[str, dict[int, list[tuple[str, float]]]]) -> None:
    rows = _read_csv(path)
    if not rows:
        return
    columns = _columns(rows, "")
    stats = [s for s in STAT_COLUMNS if s in rows[0]]
    repeated = 0
    for i, row in enumerate(rows):
        tag = f"vp{columns['vpp_stage'][i]}:{columns['name'][i]}"
        micro = int(columns["micro_step"][i])
        if micro >= 0:
            tag = f"{tag}:micro{micro}"
        step = int(columns["step"][i])
        values = [(stat, _number(row[stat])) for stat in stats]
        if step in series[tag]:  # a graph run backward twice: two rows of one name and micro-step (README)
            repeated += 1
            series[tag][step] += values  # both kept: two points at that step
        else:
            series[tag][step] = values
    if repeated:
        logger.warning(
            "trainermon: csv2tensorboard_by_step: %s: %d rows repeat a name, micro-step and step (a graph run"
            " backward twice gives two actv_grad rows); both are written",
            path,
            repeated,
        )


def _families(data_type_list: list[str] | None) -> tuple[str, ...]:
    if data_type_list is None or data_type_list == []:  # msprobe: an empty list is every family
        return FAMILIES
    if not isinstance(data_type_list, list):
        raise ValueError(f"data_type_list: {data_type_list!r}; allowed: a list from {list(FAMILIES)}")
    for family in data_type_list:
        if family not in FAMILIES:
            raise ValueError(f"data_type_list: {family!r}; allowed: {list(FAMILIES)}")
    return tuple(dict.fromkeys(data_type_list))


def _parse_time(text: str) -> datetime | None:
    """A run directory's time, in a leap year (the names have none: Feb29 must parse), or None."""
    try:
        return datetime.strptime(f"2000{text}", f"%Y{TIME_FORMAT}")
    except (TypeError, ValueError):
        return None


def _time(key: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    when = _parse_time(value) if isinstance(value, str) else None
    if when is None:
        raise ValueError(f"{key}: {value!r}; allowed: a run directory's time prefix such as 'Nov27_09-06-49'")
    return when


#: Marks the event files `to_tensorboard` writes, so that a re-conversion replaces only its own.
EVENTS_SUFFIX = ".trainermon-convert"


def to_tensorboard(csv_dir: str | os.PathLike, out: str | os.PathLike) -> Written:
    """Write every CSV file under `csv_dir` as TensorBoard scalars under `out/{rank directory}`, tagged as
    the TensorBoard sink tags them, each tag in step order; return the directories written. Event files an
    earlier conversion wrote there are removed once the new one is complete (`Written.replaced`); other
    event files there (the sink's own) are an error, as their points would be doubled. Needs tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ValueError(
            "trainermon convert --to tensorboard needs the tensorboard package: "
            "pip install 'trainermon[tensorboard]'"
        ) from exc
    csv_dir, out = os.fspath(csv_dir), os.fspath(out)
    groups = find_csv_files(csv_dir) if os.path.isdir(csv_dir) else {}
    if not groups:
        raise FileNotFoundError(
            f"trainermon convert: no '{{family}}_{{first}}-{{last}}.csv' files under {csv_dir!r}"
        )
    _make_out(out)
    targets = {d: os.path.join(out, os.path.basename(os.path.normpath(d))) for d in groups}
    names = [os.path.basename(t) for t in targets.values()]
    shared = sorted({n for n in names if names.count(n) > 1})  # runA/rank0 and runB/rank0
    if shared:
        raise ValueError(
            f"trainermon convert: several rank directories under {csv_dir!r} are named {shared[0]!r}, so "
            "their event files would land in one directory; allowed: distinct rank directory names"
        )
    earlier = {d: _earlier_events(out, target) for d, target in targets.items()}  # all checked first
    written = Written()
    seen: dict[str, dict[tuple[str, int], set[int]]] = defaultdict(dict)  # run id: (family, rank): steps
    for directory, files in sorted(groups.items()):
        writer = SummaryWriter(log_dir=targets[directory], filename_suffix=EVENTS_SUFFIX)
        try:
            _write_scalars(writer, directory, files, seen[_rank_and_run(directory)[1]])
        except BaseException:  # a bad CSV file: the earlier events stay alone, not beside a partial copy
            writer.close()
            for name in os.listdir(targets[directory]):
                path = os.path.join(targets[directory], name)
                if name.endswith(EVENTS_SUFFIX) and path not in earlier[directory]:
                    os.unlink(path)
            raise
        finally:
            writer.close()
        for path in earlier[directory]:
            os.unlink(path)
        written.replaced.extend(earlier[directory])
        written.append(targets[directory])
    for run_id, csv_steps in sorted(seen.items()):  # a dynamic run's Parquet phase: said, not silent
        note = parquet_left_out([d for d in groups if _rank_and_run(d)[1] == run_id], run_id, csv_steps)
        if note is not None:
            logger.warning("trainermon convert: %s", note)
            written.notes.append(note)
    return written


def _earlier_events(out: str, target: str) -> list[str]:
    """The event files an earlier `to_tensorboard` wrote in `target`; ValueError for any other."""
    if not os.path.isdir(target):
        return []
    names = sorted(n for n in os.listdir(target) if "tfevents" in n)
    others = [n for n in names if not n.endswith(EVENTS_SUFFIX)]
    if others:
        raise ValueError(
            f"OUT {out!r}: {target} holds event files that trainermon convert did not write ({others[0]}"
            f"{', ...' if len(others) > 1 else ''}): converting would double their points; allowed: an OUT "
            "whose rank directories hold no other event files (remove them, or choose another OUT)"
        )
    return [os.path.join(target, n) for n in names]


def _write_scalars(
    writer: Any, directory: str, files: list[tuple[str, str]], steps: dict[tuple[str, int], set[int]]
) -> None:
    """The rows of one rank directory's files (in family, then step order) as scalars; their steps added
    to `steps[(family, rank)]`."""
    rank, _run_id = _rank_and_run(directory)
    unreduced = _layout(directory).get("grad_unreduced_kind", "pre_grad")
    for family, path in files:
        rows = _read_csv(path)
        if not rows:
            continue
        rows.sort(key=lambda r: int(r["step"]))  # stable: a step's rows keep their order
        columns = _columns(rows, "")
        steps.setdefault((family, rank), set()).update(columns["step"].tolist())
        stats = [s for s in STATS if columns.get(s) is not None]
        # as the TensorBoard sink: numel, and the family's own numbers (update: ratio; moe_load ...)
        stats += [c for c in ("numel",) if c in rows[0]] + [
            c for c, kind in FAMILY_COLUMNS.get(family, ()) if kind in ("float", "int") and c in rows[0]
        ]
        for i, r in enumerate(rows):
            micro = int(columns["micro_step"][i])
            prefix = msprobe_tag(
                family,
                columns["vpp_stage"][i],
                columns["name"][i],
                None if micro < 0 else micro,
                rank,
                unreduced,
            )
            for stat in stats:
                writer.add_scalar(f"{prefix}_{stat}", _number(r[stat]), int(r["step"]))
