"""Several trainer processes: `grpo train` launches torchrun, as TRL users launch their trainers.

`spec.trainer.numNodes × numProcPerNode` processes train one policy with DDP (NCCL on GPUs, gloo on
CPU) or FSDP2 (`strategy: fsdp`, CUDA only: Accelerate shards over NCCL; launched even for one
process). On a cluster each of the numNodes pods of the attempt's indexed Job runs `grpo train`, which
starts torchrun for its numProcPerNode processes: its node rank is the pod's completion index
(`JOB_COMPLETION_INDEX`), the rendezvous is pod 0 of the Job through the run's headless Service
(`$GRPO_MASTER_ADDR`, `$GRPO_MASTER_PORT`, set by the operator). Without `$GRPO_MASTER_ADDR` (`grpo
run`, one pod) all numNodes × numProcPerNode processes run on this machine.

Rank 0 alone talks to the server and publishes the adapter (see trl_overrides.ServerGeneration and
session.py). How the attempt ended is rank 0's exit code, passed back through a file, since torchrun
itself only says that a worker failed. Every rank leaves its code: a problem every rank finds (a
configuration error) may end another rank first, and torchrun then stops rank 0 before it writes;
the launcher takes rank 0's code, else the lowest rank's, else torchrun's.

No process outlives the attempt, whichever dies first. torchrun starts each rank in a session of its
own, out of reach of a signal to the launcher's process group, so each process is tied to the one
that started it instead (`die_with_parent`, `$GRPO_PARENT_PID`): the launcher to `grpo run` (when it
started it), torchrun to the launcher (torchrun runs under this module's `__main__`, which ties it
first) and each rank to torchrun. The kernel kills a process whose parent dies (PR_SET_PDEATHSIG), and
a watchdog thread does the same where that is not available. The launcher also adopts what torchrun
leaves (PR_SET_CHILD_SUBREAPER) and kills it before it exits, so when the launcher has exited (the
trainer container's main process, in a pod) every process of its attempt has.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

from grpo_api.models import Strategy, TrainerSpec
from grpo_api.protocol import ENV_PARENT_PID
from grpo_trainer.errors import InvalidSpec, TrainingFailed

ENV_MASTER_ADDR = "GRPO_MASTER_ADDR"
ENV_MASTER_PORT = "GRPO_MASTER_PORT"
#: The folder where each rank leaves its exit code (file `rank-<RANK>`) for the launcher.
ENV_EXIT_DIR = "GRPO_TRAINER_EXIT_DIR"
ENV_NODE_RANK = "JOB_COMPLETION_INDEX"
#: prctl(2) options: the signal a process gets when its parent dies; adopt orphaned descendants.
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: How often the watchdog looks at the parent (where PR_SET_PDEATHSIG is missing, the only guard).
PARENT_POLL_SECONDS = 1.0
#: How long the launcher waits for the processes torchrun left to be gone after SIGKILL.
ORPHAN_REAP_SECONDS = 10.0


def world_size(trainer: TrainerSpec) -> int:
    return trainer.num_nodes * trainer.num_proc_per_node


def rank() -> int:
    """This process's global rank (0 when not launched by torchrun)."""
    return int(os.environ.get("RANK", "0") or "0")


def launched() -> bool:
    """Inside a process torchrun started."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def needs_launch(trainer: TrainerSpec) -> bool:
    """Several processes, or FSDP (which Accelerate applies only to a launched process group, even of one)."""
    return (world_size(trainer) > 1 or trainer.strategy == Strategy.FSDP) and not launched()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env_int(env: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name) or str(default)
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise InvalidSpec(f"${name} must be a whole number from {low} to {high}, got {raw[:40]!r} (trainer.env)")
    return int(raw)


def torchrun_argv(trainer: TrainerSpec, config_path: str | None, env: dict[str, str]) -> list[str]:
    """The torchrun command of this pod (or of this machine, under `grpo run`)."""
    master = env.get(ENV_MASTER_ADDR)
    if master:
        nodes, per_node = trainer.num_nodes, trainer.num_proc_per_node
        node_rank = _env_int(env, ENV_NODE_RANK, 0, 0, trainer.num_nodes - 1)
        port = _env_int(env, ENV_MASTER_PORT, 29500, 1, 65535)
    else:
        nodes, per_node, node_rank = 1, world_size(trainer), 0
        master, port = "127.0.0.1", _env_int(env, ENV_MASTER_PORT, _free_port(), 1, 65535)
    argv = [
        sys.executable, "-m", "grpo_trainer.launch",  # torch.distributed.run, tied to the launcher first
        f"--nnodes={nodes}", f"--nproc-per-node={per_node}", f"--node-rank={node_rank}",
        f"--master-addr={master}", f"--master-port={port}",
        "-m", "grpo_cli.main", "train",
    ]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    return argv


def check_gpus(trainer: TrainerSpec, env: dict[str, str], visible: int) -> None:
    """On a GPU machine every process of this pod (of this machine, under `grpo run`) needs a GPU of its own:
    NCCL refuses two ranks on one device. Refused here, before any process starts, naming the fields;
    a machine without GPUs trains on CPU (gloo) with any number of processes."""
    if visible == 0:
        return
    if env.get(ENV_MASTER_ADDR):
        needed = trainer.num_proc_per_node
        if visible < needed:
            raise InvalidSpec(
                f"trainer.numProcPerNode: {needed} processes per trainer pod need a GPU each, but the pod sees "
                f"{visible}: set trainer.resources.limits (nvidia.com/gpu: {needed}) or lower numProcPerNode")
        return
    needed = world_size(trainer)
    if visible < needed:
        raise InvalidSpec(
            f"trainer.numNodes × trainer.numProcPerNode: `grpo run` starts {needed} trainer processes on this "
            f"machine, which needs a GPU each, but it has {visible} (CUDA_VISIBLE_DEVICES)")


def launch(trainer: TrainerSpec, config_path: str | None) -> int:
    """Run the processes of this pod under torchrun; how they ended (see `attempt_exit_code`)."""
    import torch

    check_gpus(trainer, dict(os.environ), torch.cuda.device_count())
    adopting = _prctl(PR_SET_CHILD_SUBREAPER, 1)  # ranks whose torchrun died become our children
    with tempfile.TemporaryDirectory(prefix="grpo-train-") as tmp:
        env = {**os.environ, ENV_EXIT_DIR: tmp, ENV_PARENT_PID: str(os.getpid())}
        argv = torchrun_argv(trainer, config_path, env)
        print(f"grpo train: {world_size(trainer)} processes ({trainer.num_nodes} node(s) × "
              f"{trainer.num_proc_per_node}): {' '.join(argv[1:])}", flush=True)
        proc = subprocess.Popen(argv, env=env)

        def forward(signum: int, frame: FrameType | None) -> None:
            proc.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = proc.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if adopting:
                ended = end_children()
                if ended:
                    print(f"grpo train: torchrun ended (code {proc.returncode}); killed the processes it left: "
                          f"{', '.join(map(str, ended))}", file=sys.stderr, flush=True)
        return attempt_exit_code(left_codes(Path(tmp)), code)


def end_on_sigterm(pid: int | None = None) -> bool:
    """As a container's PID 1 (`grpo train` is the trainer image's entrypoint), a process that set no SIGTERM
    handler never sees SIGTERM: the kernel drops it, and the pod ends only at its grace period's SIGKILL.
    A preempted or evicted trainer would train on for those 30 s, and finish a short run, as if nothing had
    happened. Here SIGTERM ends the process at once with exit code 143 (128 + SIGTERM), as it would anywhere
    else; the last complete checkpoint is what the next attempt resumes from. True when the handler was set.
    """
    if (os.getpid() if pid is None else pid) != 1:
        return False

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    return True


def _prctl(option: int, value: int) -> bool:
    """prctl(2) on Linux; False where it is missing or refused."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """End this process (SIGKILL) when the process named by $GRPO_PARENT_PID ends; nothing when it is unset.

    It has nobody left to report to, and its attempt is over: left alive, it would train on beside the next
    attempt, against that attempt's server and into its checkpoint folder. Raises TrainingFailed when the
    parent is gone already (it died before the signal was armed)."""
    raw = os.environ.get(ENV_PARENT_PID)
    if not raw:
        return
    if not raw.isdigit():
        raise TrainingFailed(f"${ENV_PARENT_PID} must be a process id, got {raw[:40]!r}")
    parent = int(raw)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        raise TrainingFailed(f"the process that started this one (pid {parent}, ${ENV_PARENT_PID}) has ended: "
                             "its attempt is over")
    threading.Thread(target=_watch_parent, args=(parent,), name="grpo-parent-watchdog", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    print(f"grpo train: the process that started this one (pid {parent}) has ended: ending this one",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _children() -> list[int]:
    """This process's children (Linux: /proc/self/task/*/children)."""
    pids: list[int] = []
    for task in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(pid) for pid in task.read_text().split()]
    return pids


def end_children() -> list[int]:
    """SIGKILL every child left (with PR_SET_CHILD_SUBREAPER: what torchrun left, and what those left) and reap
    them; returns their pids. Bounded: a process that will not die is given up after ORPHAN_REAP_SECONDS."""
    ended: list[int] = []
    deadline = time.monotonic() + ORPHAN_REAP_SECONDS
    while time.monotonic() < deadline:
        children = _children()
        if not children:
            break
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    ended.append(pid)
        time.sleep(0.05)
    return sorted(set(ended))


def left_codes(folder: Path) -> dict[int, int]:
    """The exit codes the ranks of this pod left, by global rank (unreadable files are skipped)."""
    codes: dict[int, int] = {}
    for path in folder.glob("rank-*"):
        number, text = path.name.removeprefix("rank-"), path.read_text().strip()
        if number.isdigit() and text.isdigit():
            codes[int(number)] = int(text)
    return codes


def attempt_exit_code(codes: dict[int, int], torchrun_code: int) -> int:
    """Rank 0's code; else the lowest rank's failure (rank 0 was stopped first); else torchrun's."""
    if 0 in codes:
        return codes[0]
    failures = [codes[r] for r in sorted(codes) if codes[r] != 0]
    return failures[0] if failures else torchrun_code


def report_exit(code: int) -> None:
    """Each rank of a launched run leaves its exit code for the launcher."""
    folder = os.environ.get(ENV_EXIT_DIR)
    if folder and launched():
        (Path(folder) / f"rank-{rank()}").write_text(str(code))


def torchrun_main(argv: list[str]) -> None:
    """torchrun, under the launcher: tied to it first, and the parent its ranks are tied to."""
    try:
        die_with_parent()
    except TrainingFailed as exc:
        print(f"grpo train: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    os.environ[ENV_PARENT_PID] = str(os.getpid())  # the ranks' environment is a copy of ours
    from torch.distributed.run import main

    from grpo_trainer import torchrun_exit

    torchrun_exit.patch()  # node 0's agent leaves the exit barrier last (pytorch/pytorch#69520)
    main(argv)


if __name__ == "__main__":
    torchrun_main(sys.argv[1:])
