"""CSV exporter in msprobe's layout, so existing scripts keep working.

Files: `{run_dir}/{family}_{first}-{last}.csv`, where [first, last] is the step bucket of
`step_count_per_record` steps. Columns: `vpp_stage,name,step[,micro_step],{ops...},shape,dtype,shard,skipped`
(micro_step for actv, actv_grad, comm, and grad_unreduced with monitor_mbs_grad; `comm` rows end
with `calls,bytes` after `skipped`): msprobe's columns, then
trainermon's `shard`, empty unless the rank's row holds only a piece of the tensor (a DTensor's local
shard), and `skipped` (1: the step's optimizer update was skipped, by a loss scaler's overflow or by
the framework; 2: skipped by the training loop itself, whose Inf/NaN are anomalies (`own_skip`); 0: it
ran; empty: not known), so
msprobe's readers, which select columns by name, keep working. Families with columns of their own
append them after `skipped` (`comm`: `calls,bytes`; `update`: `ratio`; `moe_load`: see
`collect/family_columns.py`). Each family's rows of a step go to the file in one unbuffered write, so
a killed process leaves complete rows only, and a write that fails part-way (disk full) is cut back
to the last complete row. Rank 0 also writes the cross-rank summaries to `xrank_{first}-{last}.csv`
(`XRANK_HEADER`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from operator import attrgetter, itemgetter

import numpy as np

from trainermon.collect.family_columns import FAMILY_COLUMNS
from trainermon.collect.records import XRANK_COLUMNS, StatBatch
from trainermon.stats.table import BY_NAME, Kind

from .base import Exporter, RunInfo
from .row_file import RowFile

logger = logging.getLogger("trainermon")

#: Trailing columns of `comm_*.csv`: the collective calls a row sums over and the bytes they moved.
COMM_COLUMNS = ("calls", "bytes")
#: Columns of `xrank_*.csv` (cross-rank summaries; `family` is the summarised family).
XRANK_HEADER = ["vpp_stage", "name", "step", "micro_step", "family", "stat", *XRANK_COLUMNS]
#: Columns some families have beyond the statistics (appended at the end of their files).
EXTRA_COLUMNS = {family: tuple(name for name, _ in cols) for family, cols in FAMILY_COLUMNS.items()}
_KIND = {name: kind for cols in FAMILY_COLUMNS.values() for name, kind in cols}
_FAMILY = attrgetter("family")
_HEAD, _MICRO, _SHAPE, _DTYPE, _SHARD = (itemgetter(i) for i in range(5))  # fields of `CsvExporter._texts`
# One string per micro-step and dtype for every row's kept texts (a new string per row: ~0.5 MB on (c))
_MICRO_TEXT = tuple(str(i) for i in range(256))
_DTYPE_TEXT: dict = {}


try:  # the lines built without the GIL (exporters/_csvtext.c); not compiled: `lines_in_python`
    from trainermon.exporters import _csvtext as _native
except ImportError:
    _native = None
#: One CSV column for `lines`: a text for every line, a text per line, or float64 values to format.
Column = str | list | np.ndarray


def lines(columns: list[Column], n: int, ndigits: int) -> bytes:
    """`n` CSV lines (UTF-8), each the columns' fields joined by ',' (numbers as "%.{ndigits}g" writes
    them). Built natively with the GIL released where the extension was compiled; same bytes either way."""
    if _native is not None:
        return _native.lines(columns, n, ndigits)
    return lines_in_python(columns, n, ndigits)


def lines_in_python(columns: list[Column], n: int, ndigits: int) -> bytes:
    """`lines` without the extension (its reference in the tests)."""
    if not n or not columns:
        return b""
    fmt = f"%.{ndigits}g"
    fields = [
        [c] * n if isinstance(c, str) else c if isinstance(c, list) else list(map(fmt.__mod__, c.tolist()))
        for c in columns
    ]
    return ("\n".join(map(",".join, zip(*fields))) + "\n").encode("utf-8")


def _floats(values: list, fmt: str) -> str:
    return "[" + ", ".join("NaN" if x != x else fmt % x for x in values) + "]"


def _float64(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float64)


_NEEDS_QUOTES = re.compile(r'[,"\r\n]')
#: An actv_grad row's name: `{module}.input`, `.input_{i}`, `.input_{keyword}`, `.output`, `.output_{i}`
_IO_NAME = re.compile(r"\.(input|output)(?:_([^.]*))?$")


def _io_key(name: str) -> tuple:
    """(module, output?, (kind, number)) of an actv_grad row's name: numbered slots in order, a keyword's
    after them; a name of another form is a module of its own."""
    m = _IO_NAME.search(name)
    if m is None:
        return name, 0, (0, -1)
    suffix = m.group(2)
    number = (0, -1) if suffix is None else (0, int(suffix)) if suffix.isdigit() else (1, 0)
    return name[: m.start()], int(m.group(1) == "output"), number


def msprobe_grad_order(rows: list, keys: list[tuple]) -> list[int]:
    """The positions of a step's actv_grad `rows` (`keys`: their `_io_key`) in msprobe's order. msprobe's
    backward hook writes a module's input rows, then its output rows, when the module's input gradients
    are done; the collector has the rows as the gradients arrived (a module's outputs first, long before
    its inputs). Each (vpp_stage, module, micro_step) is placed where its last input row is, or where its
    first output row is when it has no input row (no input needs a gradient: msprobe's hook runs when the
    output gradients arrive)."""
    groups: dict[tuple, list] = {}  # -> [its last input row, its first output row, [(order, position)]]
    for pos, (row, (module, output, number)) in enumerate(zip(rows, keys)):
        group = groups.setdefault((row.vpp_stage, module, row.micro_step), [-1, -1, []])
        if not output:
            group[0] = pos
        elif group[1] < 0:
            group[1] = pos
        group[2].append(((output, number, pos), pos))
    anchored = sorted(groups.values(), key=lambda g: g[0] if g[0] >= 0 else g[1])
    return [pos for g in anchored for _, pos in sorted(g[2])]


def _csv_field(text: str) -> str:
    """One field as the csv module writes it (quoted when it holds a comma, a quote or a line break, or is
    empty). Most fields need no quotes and come back as they are: no StringIO and csv writer per field."""
    if text and _NEEDS_QUOTES.search(text) is None:
        return text
    return '"' + text.replace('"', '""') + '"'


class CsvExporter(Exporter):
    def __init__(self) -> None:
        self._files: dict[str, tuple[int, RowFile]] = {}
        # id(row) -> its fixed fields' text (see `_texts`), for the rows of the last step written, which
        # `_alive` holds (so no other object can have their ids)
        self._by_row: dict[int, tuple[str, ...]] = {}
        self._alive: tuple = ()
        self._shapes: dict[tuple[int, ...], str] = {}
        # vpp_stage -> name -> "vpp_stage,name": one text for all the families of a tensor (wg, mv, param
        # rows of one parameter; actv and actv_grad of one slot): 0.16 MB less on (c)'s 4.3k-row steps
        self._names: dict[int, dict[str, str]] = {}
        self._io_keys: dict[str, tuple] = {}  # actv_grad name -> `_io_key`
        self._grad_order: tuple[tuple, list[int]] = ((), [])  # the last actv_grad rows and their order

    def open(self, run: RunInfo) -> None:
        self.run_dir = run.run_dir
        self.ops = run.config.ops
        self.ndigits = run.config.ndigits
        self.per_record = run.config.step_count_per_record
        os.makedirs(self.run_dir, exist_ok=True)
        # Which piece of the parallel layout this rank's own rows come from, and how msprobe's tags name
        # its unreduced gradients (`trainermon convert --to tensorboard` reads it)
        layout = {"rank": run.rank, "world_size": run.world_size, **run.coords}
        layout["grad_unreduced_kind"] = run.grad_unreduced_kind
        with open(os.path.join(self.run_dir, "layout.json"), "w", encoding="utf-8") as fh:
            json.dump(layout, fh, sort_keys=True)

    def header(self, with_micro_step: bool, family: str = "") -> list[str]:
        head = ["vpp_stage", "name", "step"] + (["micro_step"] if with_micro_step else [])
        extra = COMM_COLUMNS if family == "comm" else EXTRA_COLUMNS.get(family, ())
        return head + list(self.ops) + ["shard", "skipped"] + list(extra)

    def write(self, batch: StatBatch) -> None:
        # Column-wise formatting (one C-level format per value, cached per-row text for name, shape and
        # dtype): this runs on the worker thread, and every microsecond it holds the GIL is a
        # microsecond the training thread may wait.
        all_rows = batch.rows
        if len(self._shapes) > len(all_rows) or sum(map(len, self._names.values())) > len(all_rows):
            self._shapes.clear()  # shapes and names that steps no longer use (MoE token counts change)
            self._names.clear()
        known = self._by_row.get
        made: dict[tuple, tuple[str, ...]] = {}  # this write's new texts, shared by the rows of one tensor
        all_texts = [known(id(r)) or self._texts(r, made) for r in all_rows]
        # Only this step's rows keep their texts: where shapes change every step (MoE experts' token
        # counts) each step brings new row objects, whose texts would otherwise pile up.
        self._by_row = dict(zip(map(id, all_rows), all_texts))
        self._alive = tuple(all_rows)  # rows may come as a list: a copy its owner cannot change
        by_family: dict[str, list[int]] = {}
        for i, family in enumerate(map(_FAMILY, batch.rows)):
            by_family.setdefault(family, []).append(i)
        step = str(batch.step)
        written: list[tuple[list[int], str]] = []  # (indices, text) of the families formatted so far
        for family, indices in by_family.items():
            if family == "actv_grad":
                indices = self._in_grad_order(batch.rows, indices)
            rows = [batch.rows[i] for i in indices]
            with_micro = any(r.micro_step is not None for r in rows)
            handle = self._file_for(family, batch.step, with_micro)
            # A family whose lines equal another's (grad_reduced and grad_unreduced without data
            # parallelism: the same tensors) reuses that text, since a line has no family column.
            extra = EXTRA_COLUMNS.get(family, ())
            text = None
            if not extra:
                text = next((t for other, t in written if self._same_lines(batch, other, indices)), None)
            if text is None:
                texts = [all_texts[i] for i in indices]
                text = self._format(batch, rows, texts, indices, step, with_micro, extra)
                if not extra:
                    written.append((indices, text))
            handle.write(text)
        if batch.xrank is not None and batch.xrank.rows:
            self._write_xrank(batch)

    def _in_grad_order(self, all_rows: list, indices: list[int]) -> list[int]:
        """actv_grad's rows in msprobe's order (`msprobe_grad_order`), on the worker thread: worked out
        once for the rows a step has (the collector hands over the same row objects every step)."""
        rows = tuple(all_rows[i] for i in indices)
        last, order = self._grad_order
        if rows != last:  # the same objects: one identity check per row
            if len(self._io_keys) > 2 * len(rows) + 1024:
                self._io_keys.clear()
            known, keys = self._io_keys, []
            for row in rows:
                key = known.get(row.name)
                if key is None:
                    key = known[row.name] = _io_key(row.name)
                keys.append(key)
            order = msprobe_grad_order(list(rows), keys)
            self._grad_order = (rows, order)
        return [indices[p] for p in order]

    def _write_xrank(self, batch: StatBatch) -> None:
        """Cross-rank summaries (written by rank 0 only): `xrank_{first}-{last}.csv`, one line per
        (family, name, micro_step, statistic), msprobe's leading columns then the summary's."""
        table, fmt = batch.xrank, f"%.{self.ndigits}g"
        handle = self._file_for("xrank", batch.step, True, XRANK_HEADER)
        columns = [
            [fmt % v for v in table.values[c].tolist()]
            if table.values[c].dtype.kind == "f"
            else [str(v) for v in table.values[c].tolist()]
            for c in XRANK_COLUMNS
        ]
        lines = (
            f"{vpp},{_csv_field(name)},{batch.step},{'' if micro is None else micro},{fam},{stat},"
            + ",".join(values)
            for (fam, vpp, name, micro, stat), *values in zip(table.rows, *columns)
        )
        handle.write("".join(line + "\n" for line in lines))

    def _same_lines(self, batch: StatBatch, a: list[int], b: list[int]) -> bool:
        if len(a) != len(b):
            return False
        # The values first: whole columns at once, and they differ at once between families that
        # describe the same parameters (param, exp_avg, ...), where the names would all match.
        if not all(
            np.array_equal(batch.values[op][a], batch.values[op][b], equal_nan=True)
            for op in self.ops
            if op in batch.values
        ):
            return False
        rows = batch.rows
        return all(rows[i][1:] == rows[j][1:] for i, j in zip(a, b))  # every field but the family

    def _format(
        self,
        batch: StatBatch,
        rows: list,
        texts: list[tuple[str, ...]],
        indices: list[int],
        step: str,
        with_micro: bool,
        extra: tuple = (),
    ) -> bytes:
        columns: list[Column] = [list(map(_HEAD, texts)), step]
        if with_micro:
            columns.append(list(map(_MICRO, texts)))
        for op in self.ops:
            if op == "shape":
                columns.append(list(map(_SHAPE, texts)))
            elif op == "dtype":
                columns.append(list(map(_DTYPE, texts)))
            elif BY_NAME[op].kind is Kind.FLOAT:  # ndigits significant digits; nan, inf, -inf
                columns.append(_float64(batch.values[op][indices]))
            elif BY_NAME[op].kind is Kind.COUNT:
                columns.append([str(int(v)) for v in batch.values[op][indices].tolist()])
        columns.append(list(map(_SHARD, texts)))
        # skipped: 1 (2: by the loop itself), done: 0, not known: empty
        skipped = batch.scalars.update_skipped
        columns.append(
            "" if skipped is None else "2" if skipped and batch.scalars.own_skip else str(int(skipped))
        )
        if rows and rows[0].family == "comm":
            columns += [[str(r.calls) for r in rows], [str(r.nbytes) for r in rows]]
        fmt = f"%.{self.ndigits}g"
        for column in extra:  # NaN (empty for ints and lists) where a batch has none
            got = batch.values.get(column)
            kind = _KIND[column]
            if got is None:
                columns.append("nan" if kind == "float" else "")
            elif kind == "list":
                columns.append([_csv_field(str(v)) if v is not None else "" for v in got[indices].tolist()])
            elif kind == "flist":  # JSON (NaN for a missing value), ndigits significant digits
                columns.append(
                    [_csv_field(_floats(v, fmt)) if v is not None else "" for v in got[indices].tolist()]
                )
            elif kind == "int":
                columns.append([str(int(v)) if v == v else "" for v in got[indices].tolist()])
            else:
                columns.append(_float64(got[indices]))
        return lines(columns, len(rows), self.ndigits)

    def _texts(self, row, made: dict) -> tuple[str, ...]:
        """The row's fixed fields as CSV text: (`vpp_stage,name`, micro_step, shape, dtype, shard), kept
        (`write`) by the row object's id: the collector hands over the same RowMeta objects every step
        (`RowMetaCache`), so a step's lines cost one lookup per row for these fields. The families of one
        tensor (a parameter's wg, mv and param rows; a slot's actv and actv_grad) share one tuple through
        `made`: 1356 tuples instead of 4862 on (c) `all`, 0.34 MB less."""
        slot = (row.vpp_stage, row.name, row.micro_step, row.shape, row.dtype, row.shard)
        texts = made.get(slot)
        if texts is not None:
            return texts
        shape = self._shapes.get(row.shape)
        if shape is None:
            shape = self._shapes[row.shape] = _csv_field(str(list(row.shape)))
        micro = row.micro_step or 0
        names = self._names.get(row.vpp_stage)
        if names is None:
            names = self._names[row.vpp_stage] = {}
        name = names.get(row.name)
        if name is None:
            name = names[row.name] = f"{row.vpp_stage},{_csv_field(row.name)}"
        texts = (
            name,
            _MICRO_TEXT[micro] if micro < len(_MICRO_TEXT) else str(micro),
            shape,
            _DTYPE_TEXT.get(row.dtype) or _DTYPE_TEXT.setdefault(row.dtype, str(row.dtype)),
            _csv_field(row.shard) if row.shard else "",
        )
        made[slot] = texts
        return texts

    def _file_for(self, family: str, step: int, with_micro: bool, header: list | None = None) -> RowFile:
        first = (step // self.per_record) * self.per_record
        path = os.path.join(self.run_dir, f"{family}_{first}-{first + self.per_record - 1}.csv")
        current = self._files.get(family)
        lost = current is not None and current[0] == first  # this bucket's file: still there?
        if lost and not current[1].gone():  # one fstat per family and step, on the worker thread
            return current[1]
        if lost or not os.path.isdir(self.run_dir):  # a new bucket's file: its directory may be gone
            # Made first: where it cannot be (a file took its place) the error disables this sink, and a
            # promise of a new file would be false.
            os.makedirs(self.run_dir, exist_ok=True)
            logger.warning(
                "trainermon: %s was deleted while open; rows from step %d on go to a new file there "
                "(the rows written before it was deleted are gone with it)",
                path if lost else self.run_dir,
                step,
            )
        if current is not None:
            current[1].close()
        new = not os.path.exists(path)
        handle = RowFile(path, ",".join(header or self.header(with_micro, family)) + "\n" if new else "")
        self._files[family] = (first, handle)
        return handle

    def flush(self) -> None:
        for _, handle in self._files.values():
            handle.flush()

    def close(self) -> None:
        for _, handle in self._files.values():
            handle.close()
        self._files.clear()
