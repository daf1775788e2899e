"""The CSV sink's append-only files: whole rows only, whatever fails part-way."""

from __future__ import annotations

import os
from typing import Any


class RowFile:
    """An append-only CSV file that only ever shows whole rows.

    Writes are unbuffered (one `write` per family per step already), and a write that fails part-way
    (disk full, quota, a file-size limit) cuts the file back to the end of its last complete row before
    the error goes on, so neither a reader nor a later write ever sees half a row. A new file's `header`
    goes out with its first rows, in one write, the file opened just before: a process killed between
    creating a file and its first rows (an empty file, which stopped `analyze`) is now rare, and the
    readers skip such a file."""

    def __init__(self, path: str, header: str = "") -> None:
        self._path = path
        self._fh: Any = None
        self._size = 0
        self._header = header.encode("utf-8")

    def write(self, text: str | bytes) -> None:
        if self._fh is None:
            self._fh = open(self._path, "ab", buffering=0)  # noqa: SIM115 - kept open across steps
            self._size = os.fstat(self._fh.fileno()).st_size
        encoded = text.encode("utf-8") if isinstance(text, str) else text
        if self._header:
            encoded = self._header + encoded
        data = memoryview(encoded)
        try:
            while data:
                data = data[self._fh.write(data) :]
        except BaseException:
            os.ftruncate(self._fh.fileno(), self._size)
            raise
        self._size += len(encoded)
        self._header = b""

    def flush(self) -> None:
        pass  # nothing is buffered

    def gone(self) -> bool:
        """The file was deleted while open (its run directory removed, say): writes would be lost."""
        return self._fh is not None and os.fstat(self._fh.fileno()).st_nlink == 0

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
