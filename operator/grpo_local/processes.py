"""Child processes of a local run, each in its own process group, each process of it marked.

The server may start engine children of its own (vLLM's engine core, its
workers); they inherit the group, so signalling the group ends them all and no
orphan keeps a GPU or a port. Not every descendant stays in the group: torchrun
starts each trainer rank in a session of its own. So every process a child
starts also carries the child's mark in its environment ($GRPO_LOCAL_PROCESS_MARK),
which it keeps whatever group it moves to: a child has ended only when no
process of its group and no process with its mark is left (Linux: read from
/proc; elsewhere the group alone).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

#: Seconds a child gets between SIGTERM and SIGKILL.
STOP_GRACE_SECONDS = 20.0
#: Seconds to wait for SIGKILLed processes to be gone.
KILL_WAIT_SECONDS = 10.0
#: The variable every process of a child carries: the child's own mark.
ENV_PROCESS_MARK = "GRPO_LOCAL_PROCESS_MARK"
PROC = Path("/proc")


def marked_processes(mark: str, group: int) -> list[int]:
    """Live processes (zombies do not count) in process group `group` or carrying `mark` in their environment."""
    needle = f"{ENV_PROCESS_MARK}={mark}".encode()
    found = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after the last ")"
            state, _ppid, pgrp = stat[stat.rindex(b")") + 2:].split()[:3]
            if state == b"Z":
                continue
            if int(pgrp) == group or needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue  # gone meanwhile, or another user's
    return found


@dataclass
class Child:
    """One child process (and its group and every process carrying its mark) with its log file."""

    role: str
    attempt: int
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: Set once nothing of the child is left: no process of it can appear again.
    _ended: bool = field(default=False, init=False, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env, ENV_PROCESS_MARK: self.mark},
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

    def processes(self) -> list[int]:
        """Every live process of the child: its group and every process carrying its mark, the leader included
        while it runs."""
        if self.proc is None or self._ended:
            return []
        if not PROC.is_dir():
            return [self.proc.pid] if self.group_alive() else []
        found = marked_processes(self.mark, self.proc.pid)
        if self.proc.poll() is None and self.proc.pid not in found:
            found.append(self.proc.pid)
        return found

    def alive(self) -> bool:
        """Whether any process of the child is left: the leader, its group, or one that left the group."""
        if self.proc is None or self._ended:
            return False
        if self.proc.poll() is None:
            return True
        self._ended = not self.processes()
        return not self._ended

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> int | None:
        """SIGTERM the group, wait up to grace for every process of the child to end, then SIGKILL what is
        left; returns the leader's exit code."""
        if self.proc is None:
            return None
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.1)
        self.kill()
        return self.proc.poll()

    def kill(self, timeout: float = KILL_WAIT_SECONDS) -> None:
        """SIGKILL every process of the child and wait (up to timeout) until none is left, and until init has
        reaped those of the group (a zombie holds no port, but still answers a signal to the group)."""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        while self.alive():
            self._signal_group(signal.SIGKILL)
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.05)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)
