"""Child processes of a local run, each in its own process group.

The server may start engine children of its own (vLLM's engine core, its
workers); they inherit the group, so signalling the group ends them all and no
orphan keeps a GPU or a port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Seconds a child gets between SIGTERM and SIGKILL.
STOP_GRACE_SECONDS = 20.0


@dataclass
class Child:
    """One child process (and its group) with its log file."""

    role: str
    attempt: int
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,  # its own process group (and session): killpg reaches its children
            )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        """Exit code, or None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def group_alive(self) -> bool:
        """Whether any process of the group is left (the leader may exit before its children)."""
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> int | None:
        """SIGTERM the group, wait up to grace, then SIGKILL it; returns the leader's exit code."""
        if self.proc is None:
            return None
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not self.group_alive():
                break
            time.sleep(0.1)
        if self.group_alive():
            self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._reap_group()
        return self.proc.poll()

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        self._reap_group()

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def _reap_group(self, timeout: float = 5.0) -> None:
        """Wait until the group is empty (grandchildren are reaped by init once they die)."""
        deadline = time.monotonic() + timeout
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
