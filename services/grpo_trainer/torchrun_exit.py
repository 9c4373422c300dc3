"""torchrun's exit barrier, without the race that ends a good multi-node run with a traceback.

When its processes have succeeded, each pod's torchrun agent waits for the agents of the other pods at a
barrier in the rendezvous store (`SimpleElasticAgent._exit_barrier`): it adds itself to a count, the last
one in sets a key, and every agent waits for that key. The store's server lives in node 0's agent. When
node 0 is the last one in, it sets the key, finds it set and exits, taking the server with it, while
another agent may be between its count and its wait: that agent's wait then fails, `DistNetworkError:
Failed to recv, got 0 bytes`, and it logs the error with a traceback under a run that trained to the end
(pytorch/pytorch#69520, open; seen in our scale-out run on a cluster).

The barrier here is torch's, followed by a second count: every agent adds itself once its wait is over,
and the agent that holds the server (node 0's) returns only when every agent has, so no agent talks to a
server that is gone. `patch()` puts it in place of torch's for this process; `grpo_trainer.launch` calls it
before it starts torchrun.
"""

from __future__ import annotations

import logging
import time
from typing import Any

#: The count of agents past torch's exit barrier; the host leaves when it reaches the group's size.
LEFT_KEY = "grpo/agent/left-exit-barrier"
#: How long node 0 waits for the others to be past the barrier once it is: each only has one `add` to do.
LEAVE_SECONDS = 30.0
#: How often node 0 reads the count while it waits.
POLL_SECONDS = 0.02

log = logging.getLogger("grpo_trainer.torchrun_exit")


def exit_barrier(store: Any, group_rank: int, group_world_size: int, timeout: float) -> None:
    """torch's exit barrier for the agent of `group_rank`, then the agent holding the store (group rank 0, the
    static rendezvous's server) waits for every other agent to be past it. Raises what the store raises, and
    TimeoutError naming how many agents left when one never does."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils import store as store_util

    store_util.barrier(store=store, world_size=group_world_size, key_prefix=_TERMINAL_STATE_SYNC_ID,
                       barrier_timeout=timeout)
    left = int(store.add(LEFT_KEY, 1))
    if group_rank != 0:
        return
    deadline = time.monotonic() + min(timeout, LEAVE_SECONDS)
    while left < group_world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{left} of {group_world_size} agents left the exit barrier within "
                               f"{min(timeout, LEAVE_SECONDS):g} s")
        time.sleep(POLL_SECONDS)
        left = int(store.add(LEFT_KEY, 0))


def _agent_exit_barrier(agent: Any) -> None:
    """`SimpleElasticAgent._exit_barrier` with `exit_barrier`; a failure is one warning line, as torch's own
    is a logged error (the processes have succeeded either way), and a signal still ends the agent."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    group = agent._worker_group
    start = time.monotonic()
    try:
        exit_barrier(agent._store, group.group_rank, group.group_world_size, agent._exit_barrier_timeout)
    except SignalException:
        raise
    except Exception as exc:
        log.warning("grpo train: the agents' exit barrier failed after %.1f s (%s: %s); this pod's processes "
                    "had succeeded", time.monotonic() - start, type(exc).__name__, exc)


def patch() -> None:
    """Put `exit_barrier` in place of torch's for the agents this process starts."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    if not hasattr(SimpleElasticAgent, "_exit_barrier"):
        raise RuntimeError("torch's SimpleElasticAgent has no _exit_barrier to replace: check grpo_trainer."
                           "torchrun_exit against this torch version")
    SimpleElasticAgent._exit_barrier = _agent_exit_barrier  # type: ignore[method-assign]
