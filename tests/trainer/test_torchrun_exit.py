"""torchrun's exit barrier across pods (grpo_trainer.torchrun_exit): node 0's agent holds the rendezvous store and
must be the last to leave it, or another pod's agent ends a good run with a traceback (pytorch/pytorch#69520)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from grpo_trainer import torchrun_exit
from tests.fixtures.server import free_port
from tests.fixtures.trainer_runs import cli_env

#: Loaded by every process of node 1 (PYTHONPATH): its agent stops between its count at torch's exit barrier and
#: its wait there, the moment at which node 0, last in, used to find the barrier done and take the store away.
SLOW_AGENT = '''
import os, time
import torch.distributed.elastic.utils.store as store_util

_count = store_util._barrier_nonblocking


def _count_then_stall(*args, **kwargs):
    key = _count(*args, **kwargs)
    time.sleep(float(os.environ["STALL_SECONDS"]))
    return key


store_util._barrier_nonblocking = _count_then_stall
'''

#: Each node's one process: node 0's ends last, so its agent is the last one in at the exit barrier.
WORK = "import os, time\ntime.sleep(3.0 if os.environ['GROUP_RANK'] == '0' else 0.0)\n"


def test_two_pods_whose_store_holder_is_last_in_both_end_without_an_error(tmp_path: Path) -> None:
    """The two agents of a two-pod attempt, as on a cluster (static rendezvous on node 0): node 0 reaches the
    exit barrier last while node 1's agent is between its count and its wait. With torch's barrier node 0
    exits at once and node 1 logs `DistNetworkError: Failed to recv ... Traceback` (seen in the scale-out e2e
    run); with ours node 0 waits for node 1 to be past it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_AGENT)
    work = tmp_path / "work.py"
    work.write_text(WORK)
    port = free_port()

    def agent(node: int, **env: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "grpo_trainer.launch", "--nnodes=2", "--nproc-per-node=1",
                f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", str(work)]
        return subprocess.Popen(argv, env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    node0 = agent(0)
    node1 = agent(1, PYTHONPATH=str(site), STALL_SECONDS="2")
    out0, _ = node0.communicate(timeout=240)
    out1, _ = node1.communicate(timeout=240)

    assert (node0.returncode, node1.returncode) == (0, 0), out0[-3000:] + out1[-3000:]
    for out in (out0, out1):
        assert "Traceback" not in out and "exit barrier failed" not in out, out[-3000:]


def test_the_store_holder_returns_only_once_every_agent_is_past_the_barrier() -> None:
    """Node 0 (the store's server) and node 1 at the barrier with real TCPStores: node 1 stalls before its
    wait; node 0 does not return until node 1's last call to the store is answered."""
    port = free_port()
    host = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    client = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    done: dict[int, float] = {}
    errors: list[BaseException] = []

    class Stalling:
        """node 1's store: a second's stall before its wait, as the scheduler may give it."""

        def __getattr__(self, name: str) -> object:
            return getattr(client, name)

        def wait(self, keys: list[str]) -> None:
            time.sleep(1.0)
            client.wait(keys)

    def node(rank: int, store: object) -> None:
        try:
            torchrun_exit.exit_barrier(store, rank, 2, 30.0)
        except BaseException as exc:
            errors.append(exc)
        done[rank] = time.monotonic()

    one = threading.Thread(target=node, args=(1, Stalling()))
    one.start()
    time.sleep(0.3)  # node 1 is in, stalling: node 0 is the last one in
    node(0, host)
    one.join(10)

    assert errors == []
    assert done[0] >= done[1]
    assert host.add(torchrun_exit.LEFT_KEY, 0) == 2


def test_an_agent_that_never_leaves_ends_the_store_holder_s_wait_naming_the_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torchrun_exit, "LEAVE_SECONDS", 0.5)
    port = free_port()
    host = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils import store as store_util

    store_util._barrier_nonblocking(host, 2, _TERMINAL_STATE_SYNC_ID)  # node 1 came in, and then was lost

    with pytest.raises(TimeoutError, match=r"1 of 2 agents left the exit barrier within 0\.5 s"):
        torchrun_exit.exit_barrier(host, 0, 2, 30.0)
