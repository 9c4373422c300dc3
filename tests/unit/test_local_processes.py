"""Local children run in their own process group; stopping one ends its grandchildren too."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from grpo_local.processes import Child

# A child that starts a grandchild ignoring SIGTERM (like an engine core stuck in CUDA) and waits.
SCRIPT = """
import signal, subprocess, sys, time
subprocess.Popen([sys.executable, "-c",
                  "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("started", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stop_ends_the_whole_group_including_a_grandchild_that_ignores_sigterm(tmp_path: Path) -> None:
    child = Child(role="server", attempt=1, argv=[sys.executable, "-c", SCRIPT], log_path=tmp_path / "log")
    child.start()
    deadline = time.monotonic() + 20
    while "started" not in (tmp_path / "log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.running and child.group_alive()
    child.stop(grace=1.0)
    assert not child.group_alive()
    assert child.pid is not None and not _alive(child.pid)


def test_a_child_gets_its_own_process_group(tmp_path: Path) -> None:
    child = Child(role="trainer", attempt=1, argv=[sys.executable, "-c", "import time; time.sleep(30)"],
                  log_path=tmp_path / "log")
    child.start()
    try:
        assert child.pid is not None and os.getpgid(child.pid) == child.pid != os.getpgid(0)
    finally:
        child.kill()
    assert not child.group_alive()
