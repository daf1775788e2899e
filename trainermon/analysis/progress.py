"""A minimal progress bar on stderr (no dependency), shown only on a terminal or when asked."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`Progress(total, label)`; `advance(n)`; `close()`. A no-op when disabled.

    enabled: True / False, or None for "when the stream is a terminal".
    """

    def __init__(
        self,
        total: float,
        label: str = "",
        enabled: bool | None = None,
        stream: TextIO | None = None,
        width: int = 30,
        min_interval: float = 0.2,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.total = max(float(total), 1e-9)
        self.label = label
        self.width = width
        self.min_interval = min_interval
        self.done = 0.0
        self.note = ""
        self._started = time.monotonic()
        self._last = 0.0
        self._closed = False

    def advance(self, amount: float = 1.0, note: str | None = None) -> None:
        self.done = min(self.total, self.done + amount)
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last >= self.min_interval or self.done >= self.total:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = now - self._started
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        text = f"\r{self.label} [{bar}] {frac * 100:5.1f}% {elapsed:6.1f}s eta {eta:5.1f}s {self.note}"
        self.stream.write(text[:160])
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.enabled:
            if self.done < self.total:
                self.done = self.total
                self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
