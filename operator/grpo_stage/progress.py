"""Progress lines (every 10% of the bytes) and the final summary."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Counts the file bytes sent; writes a line to out at every `step` percent (none when out is None)."""

    def __init__(
        self,
        total_bytes: int,
        out: TextIO | None,
        step: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total_bytes
        self.out = out
        self.step = step
        self.clock = clock
        self.started = clock()
        self.done = 0
        self._next_mark = step

    def advance(self, name: str, n: int) -> None:
        self.done += n
        if self.out is None or self.total <= 0:
            return
        percent = self.done * 100 // self.total
        if percent < self._next_mark:
            return
        self._next_mark = (percent // self.step + 1) * self.step
        elapsed = max(self.clock() - self.started, 1e-6)
        self.out.write(
            f"grpo stage: {percent:3d}%  {human_bytes(self.done)} / {human_bytes(self.total)}  "
            f"{human_bytes(self.done / elapsed)}/s  {name}\n"
        )
        self.out.flush()

    def elapsed(self) -> float:
        return self.clock() - self.started
