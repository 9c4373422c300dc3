"""No process of an attempt outlives it: the `grpo train` launcher, its torchrun and every rank end together,
whichever of them dies first, and `grpo run` starts the next attempt only once all of them have ended.

torchrun starts each rank in a session of its own, so a signal to the launcher's process group never reached
the ranks: with the launcher killed they trained on beside the next attempt, against its fresh server (same
port) and into the same checkpoint folder (issue 33).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from grpo_local.processes import Child
from tests.fixtures.local_runs import children, grpo_run, run_file
from tests.fixtures.server import RunningServer
from tests.fixtures.trainer_runs import cli_env, grpo_train, token_fraction, trainer_config
from tests.fixtures.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie has ended: it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def child_pids(pid: int) -> list[int]:
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids += [int(p) for p in task.read_text().split()]
        except OSError:
            continue
    return pids


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def attempt_processes(launcher: int) -> dict[str, int]:
    """The launcher, its torchrun and torchrun's ranks by name ("rank 0", ...), once both ranks are up."""
    found = {"launcher": launcher}
    torchruns = child_pids(launcher)
    assert len(torchruns) == 1, torchruns
    found["torchrun"] = torchruns[0]
    for pid in child_pids(torchruns[0]):
        found[f"rank {environ(pid)['RANK']}"] = pid
    return found


def gone_within(pids: dict[str, int], seconds: float) -> list[str]:
    """The names of the processes still alive after `seconds` (empty: all gone)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [name for name, pid in pids.items() if alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [f"{name} (pid {pid})" for name, pid in pids.items() if alive(pid)]


# ------------------------------------------------------------------------------------------- the mechanisms


def test_a_local_child_has_ended_only_when_a_process_that_left_its_group_has_too(tmp_path: Path) -> None:
    """As torchrun does with its ranks: the child starts a process in a session of its own and exits."""
    pid_file = tmp_path / "grandchild.pid"
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                      start_new_session=True)
        open({str(pid_file)!r}, "w").write(str(grandchild.pid))
        time.sleep(300)
    """)
    child = Child(role="trainer", attempt=1, argv=[sys.executable, "-c", script], log_path=tmp_path / "child.log")
    child.start()
    try:
        wait_for(lambda: pid_file.is_file() and pid_file.read_text().isdigit(), 30, what="the grandchild")
        grandchild = int(pid_file.read_text())
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)  # the leader dies first, as a killed launcher does
        wait_for(lambda: child.poll() is not None, 10, what="the leader's exit")
        assert not child.group_alive(), "the grandchild left the group: a group signal cannot reach it"
        assert alive(grandchild)
        assert child.alive(), "the child has not ended while a process it started lives"
        child.kill()
        assert not alive(grandchild) and not child.alive()
    finally:
        child.kill()


def test_a_trainer_process_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """$GRPO_PARENT_PID ties a process to its parent: killed outright, the parent takes it along."""
    pid_file = tmp_path / "tied.pid"
    tied = ("from grpo_trainer.launch import die_with_parent\nimport time\ndie_with_parent()\n"
            f"open({str(pid_file)!r}, 'w').write(str(__import__('os').getpid()))\ntime.sleep(300)\n")
    starts_it = ("import os, subprocess, sys, time\n"
                 f"subprocess.Popen([sys.executable, '-c', {tied!r}],\n"
                 "                 env={**os.environ, 'GRPO_PARENT_PID': str(os.getpid())})\n"
                 "time.sleep(300)\n")
    parent = subprocess.Popen([sys.executable, "-c", starts_it], cwd=ROOT)
    try:
        wait_for(lambda: pid_file.is_file() and pid_file.read_text().isdigit(), 60, what="the tied process")
        pid = int(pid_file.read_text())
        assert alive(pid)
        parent.kill()
        parent.wait(10)
        assert gone_within({"tied": pid}, 5) == []
    finally:
        parent.kill()

    # One whose parent is gone before it is tied refuses to start, saying so.
    late = subprocess.run(
        [sys.executable, "-m", "grpo_cli.main", "train"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "GRPO_PARENT_PID": str(parent.pid)},
    )
    assert late.returncode == 1
    assert f"the process that started this one (pid {parent.pid}, $GRPO_PARENT_PID) has ended" in late.stderr


# ---------------------------------------------------------------------- each process of an attempt, killed


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["launcher", "torchrun", "rank 0", "rank 1"])
def test_killing_any_process_of_a_two_process_attempt_ends_all_of_them(
    killed: str, tiny_server: RunningServer, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path,
) -> None:
    """`grpo train` with two processes, run directly as a pod runs it: SIGKILL one of them mid-training and
    every other ends too; the launcher (the pod's main process) exits only once torchrun and the ranks have."""
    # Far more steps than the observation lasts (a step takes a tenth of a second), and no sync before the last:
    # the shared server stays without an adapter for the next case.
    steps = 5000
    _, path = trainer_config(tiny_server, tmp_path, dataset=tiny_dataset, rewards=[token_fraction(tiny_model_dir)],
                             trainer={"numProcPerNode": 2, "perDeviceBatchSize": 4, "maxSteps": steps,
                                      "syncInterval": steps, "checkpointInterval": steps})
    log = (tmp_path / "train.log").open("w")
    launcher = subprocess.Popen(grpo_train(path), env=cli_env(GRPO_ATTEMPT="1"), stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    processes: dict[str, int] = {}
    try:
        wait_for(lambda: (tmp_path / "progress.json").is_file() and launcher.poll() is None, 300, what="training")
        processes = attempt_processes(launcher.pid)
        assert set(processes) == {"launcher", "torchrun", "rank 0", "rank 1"}, processes
        os.kill(processes[killed], signal.SIGKILL)
        if killed != "launcher":
            launcher.wait(90)
            left = [name for name, pid in processes.items() if name != "launcher" and alive(pid)]
            assert left == [], f"the launcher exited while {left} lived"
            assert launcher.returncode != 0
        assert gone_within(processes, 60) == [], (tmp_path / "train.log").read_text()[-3000:]
    finally:
        for pid in [*processes.values(), *child_pids(launcher.pid)]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(10)
        log.close()


@pytest.mark.slow
def test_grpo_run_starts_the_next_attempt_only_once_every_process_of_the_killed_one_has_ended(
    tmp_path: Path, tiny_model_dir: Path, tiny_dataset: Path,
) -> None:
    """The issue's run: two trainer processes, the launcher killed mid-attempt. No process of attempt 1 is
    alive when attempt 2's server starts, and attempt 2 resumes and finishes the run."""
    run_dir = tmp_path / "run"
    steps = 40  # attempt 1's ranks, left alive, would go on for seconds after the launcher is killed
    path = run_file(tmp_path, tiny_model_dir, tiny_dataset, numProcPerNode=2, perDeviceBatchSize=4, maxSteps=steps,
                    checkpointInterval=2)
    proc = grpo_run(path, run_dir)
    processes: dict[str, int] = {}
    try:
        checkpoints = run_dir / "checkpoints" / "local-test"
        wait_for(lambda: any(checkpoints.glob("checkpoint-*/grpo-complete.json")), 480,
                 what="a complete checkpoint of attempt 1")
        trainer = next(c for c in children(run_dir) if c["role"] == "trainer" and c["attempt"] == 1)
        processes = attempt_processes(trainer["pid"])
        assert set(processes) == {"launcher", "torchrun", "rank 0", "rank 1"}, processes
        os.kill(trainer["pid"], signal.SIGKILL)
        wait_for(lambda: any(c["role"] == "server" and c["attempt"] == 2 for c in children(run_dir)), 300,
                 what="attempt 2's server")
        left = [f"{name} (pid {pid})" for name, pid in processes.items() if alive(pid)]
        assert left == [], f"attempt 2's server started while attempt 1's {left} lived"
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in processes.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["attempts"] == 2 and summary["steps"] == steps, summary
    attempt_2 = (run_dir / "logs" / "trainer-attempt-2.log").read_text()
    assert "resuming from" in attempt_2, attempt_2[-3000:]
