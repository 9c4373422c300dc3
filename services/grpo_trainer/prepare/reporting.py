"""What `grpo prepare` says: protocol lines on stdout, notes on stderr, a fetch's progress, the termination message."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from grpo_api import exit_codes
from grpo_api.prepare_protocol import DONE, FAILED, PROGRESS, format_event
from grpo_trainer.prepare.errors import DownloadStopped, HubAnswerRefused

#: At most one throttled progress line per fetch this often (a finished file always gets one).
PROGRESS_INTERVAL_S = 5.0


@dataclass(frozen=True)
class PrepareResult:
    model_dir: Path
    dataset_path: Path
    prompts: int
    rewards: int

    @property
    def message(self) -> str:
        return (
            f"sources ready: model {self.model_dir}, dataset {self.dataset_path} ({self.prompts} prompts), "
            f"{self.rewards} reward function{'s' if self.rewards != 1 else ''}"
        )


class Reporter:
    """Protocol lines on stdout, plain notes on stderr; never a secret (hub tokens are masked)."""

    def __init__(self, out: IO[str] | None = None, err: IO[str] | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self._secrets: list[str] = []
        self._lock = threading.Lock()

    def add_secret(self, value: str | None) -> None:
        if value and value not in self._secrets:
            self._secrets.append(value)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _write(self, stream: IO[str], line: str) -> None:
        with self._lock:
            stream.write(line + "\n")
            stream.flush()

    def progress(self, message: str) -> None:
        self._write(self.out, format_event(PROGRESS, self.redact(message)))

    def note(self, message: str) -> None:
        self._write(self.err, f"grpo prepare: {self.redact(message)}")

    def final(self, message: str, *, failed: bool, permanent: bool = False) -> str:
        """Print the last line; returns it (the termination message)."""
        line = (
            format_event(FAILED, self.redact(message), permanent=permanent)
            if failed
            else format_event(DONE, self.redact(message))
        )
        self._write(self.out, line)
        return line


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - loop returns


class FetchProgress:
    """Files and bytes done of one repository; a progress line at each finished file and at most every
    PROGRESS_INTERVAL_S in between."""

    def __init__(
        self,
        label: str,
        sizes: dict[str, int | None],
        reporter: Reporter,
        *,
        interval: float = PROGRESS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        limits: dict[str, int | None] | None = None,
    ) -> None:
        self.label = label
        self.sizes = sizes
        #: the most bytes a file may have: what the file list announces (None: unknown, no bound)
        self.limits = limits if limits is not None else {}
        self.reporter = reporter
        self.interval = interval
        self.clock = clock
        self.received: dict[str, int] = dict.fromkeys(sizes, 0)
        self.done: set[str] = set()
        self._lock = threading.Lock()
        self._last = clock()
        self.stopped = threading.Event()

    def stop(self) -> None:
        """Every download still running stops at its next chunk (raises DownloadStopped from its bar)."""
        self.stopped.set()

    @property
    def total_bytes(self) -> int | None:
        sizes = list(self.sizes.values())
        return None if any(s is None for s in sizes) else sum(s or 0 for s in sizes)

    def message(self) -> str:
        done = sum(self.received.values())
        total = self.total_bytes
        size = f"{human_bytes(done)} / {human_bytes(total)}" if total is not None else human_bytes(done)
        return f"{self.label}: {len(self.done)}/{len(self.sizes)} files, {size}"

    def _emit(self) -> None:
        self._last = self.clock()
        self.reporter.progress(self.message())

    def add(self, name: str, n: float) -> None:
        with self._lock:
            self.received[name] = max(0, self.received.get(name, 0) + int(n))
            if self.clock() - self._last >= self.interval:
                self._emit()

    def finish(self, name: str) -> None:
        with self._lock:
            self.done.add(name)
            size = self.sizes.get(name)
            if size is not None:
                self.received[name] = size
            self._emit()

    def bar(self, name: str) -> type[_FileBar]:
        """A tqdm stand-in for hf_hub_download(tqdm_class=...) that counts one file's bytes.

        A class, not a partial: huggingface_hub looks for `update_transfer` on it to route Xet's network
        bytes into the same bar (they are not counted: the written bytes are)."""
        progress = self

        class Bar(_FileBar):
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(progress, name, **kwargs)

        return Bar


class _FileBar:
    """The tqdm surface huggingface_hub 1.33 uses in http_get and xet_get. It sees every chunk before it is
    written, so it stops a file that goes on past the size the file list announces."""

    def __init__(self, progress: FetchProgress, name: str, *, total: int | None = None, initial: int = 0,
                 **_: Any) -> None:
        self.progress = progress
        self.name = name
        self.total = total
        self.n = initial
        self.format_dict: dict[str, Any] = {}
        self.limit = progress.limits.get(name)
        if self.limit is not None and total is not None and total > self.limit:
            raise HubAnswerRefused(f"the endpoint sends {total} bytes, more than the {self.limit} bytes its file "
                                   "list announces")
        if initial:
            progress.add(name, initial)

    def __enter__(self) -> _FileBar:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def update(self, n: float | None = 1) -> None:
        if self.progress.stopped.is_set():
            raise DownloadStopped("another file of the repository failed")
        self.n += int(n or 0)
        if self.limit is not None and self.n > self.limit:
            raise HubAnswerRefused(f"the endpoint sends more than the {self.limit} bytes its file list announces")
        self.progress.add(self.name, n or 0)

    def update_transfer(self, n: float | None = 1) -> None:
        return None

    def close(self) -> None:
        return None

    def refresh(self, *_: Any, **__: Any) -> None:
        return None

    def set_postfix_str(self, *_: Any, **__: Any) -> None:
        return None

    def set_transfer_postfix_str(self, *_: Any, **__: Any) -> None:
        return None

    def set_description(self, *_: Any, **__: Any) -> None:
        return None


def write_termination_message(line: str, reporter: Reporter) -> None:
    """The final line into the termination log: $GRPO_TERMINATION_LOG (created), else /dev/termination-log
    when it exists and is writable (Kubernetes)."""
    try:
        exit_codes.write_termination_message(line)
    except OSError as exc:
        reporter.note(f"cannot write the termination message to {exit_codes.termination_log_path()}: {exc}")
