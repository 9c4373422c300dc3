"""The server's replicas, used as one server: found, kept in step with the policy, fed in parallel.

- **Found, not listed by hand.** On a cluster the replicas are the A records of the run's headless
  Service (only Ready pods are listed), looked up again whenever the pool needs a replica; `grpo run`
  hands the addresses of the processes it started. A replica that appears later is checked (same
  base model) before it gets any work.
- **Every replica serves the policy.** A policy version (an adapter loaded from the shared volume, or,
  with full fine-tuning, whole weights pushed by vLLM's weight transfer: the pool's `loader`) is made
  active on every replica the pool can reach, each load confirmed by the replica's `/health/` on the
  same boot. Each replica's load runs on its own thread: once one replica confirmed, the others get
  LAGGARD_SECONDS, and a replica that lags already is not waited for at all.
- **A replica that lags gets no work.** One that missed a version (hung, unreachable, restarted, newly
  found) or has not answered a generation request it was sent lags: it gets no work until it serves the
  current version again, and is caught up in the background (one load at a time per replica, with
  backoff), never on a batch's time. `grpo_trainer_server_replica_lagging_since_seconds` and the progress
  file (`lagging_replicas`) name it and say since when. A restarted replica is one whose answers carry a
  new boot id; its batch is thrown away and generated again.
- **A batch is spread, prompts stay whole.** The unique prompts of a batch are split into one
  contiguous group per ready replica; all completions of a prompt come from one replica (they share
  its prefix cache). A group whose replica fails is sent to another; a group that lags far behind
  the others is also sent to a replica that is done, and the first good answer wins. The whole batch
  has the generation timeout, not each attempt; the batch fails only when no replica can serve it.

With one replica this is the single server of before: same requests, same seed, same retries.

`ServerPool` is the composition of its parts, each a module: `replica_set` (the replicas found, their health and
boots, catch-up and laggard bookkeeping: the state the others share), `activation` (a version made active on every
replica, one round per sync), `dispatch` (a batch's generation spread over the ready replicas) and `policy_loaders`
(how one replica loads a version: LoRA's adapter loader, and the protocol full fine-tuning's implements).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo_api.protocol import HealthResponse, LaggingReplica
from grpo_trainer.transport.activation import PolicyActivation
from grpo_trainer.transport.dispatch import GenerationDispatch
from grpo_trainer.transport.policy_loaders import PolicyLoader, PolicyTarget
from grpo_trainer.transport.replica_set import Replica, ReplicaSet
from grpo_trainer.transport.server_client import Completions


class ServerPool:
    """The trainer's view of the run's server replicas: one replica set, its activation rounds and its
    generation dispatch (which hold no state of their own: what they share is the replica set's)."""

    def __init__(self, replica_set: ReplicaSet) -> None:
        self.replica_set = replica_set
        self.activation = PolicyActivation(replica_set)
        self.dispatch = GenerationDispatch(replica_set)

    # ------------------------------------------------------------------------- the replica set's state

    @property
    def replicas(self) -> dict[str, Replica]:
        return self.replica_set.replicas

    @property
    def loader(self) -> PolicyLoader:
        return self.replica_set.loader

    @property
    def base_url(self) -> str:
        """How the replicas are found, for messages (a DNS name, or the addresses)."""
        return self.replica_set.base_url

    @property
    def fingerprint(self) -> str | None:
        """The trainer's base model: a replica that serves another gets no work."""
        return self.replica_set.fingerprint

    @fingerprint.setter
    def fingerprint(self, value: str | None) -> None:
        self.replica_set.fingerprint = value

    @property
    def target(self) -> Any:
        """The policy version every replica should serve (None: the weights they started with)."""
        return self.replica_set.target

    # ------------------------------------------------------------------------------------ the jobs

    def close(self) -> None:
        self.replica_set.close()

    def refresh(self) -> list[Replica]:
        return self.replica_set.refresh()

    def wait_ready(self, timeout: float) -> list[tuple[str, HealthResponse]]:
        return self.replica_set.wait_ready(timeout)

    def activate(self, adapter: PolicyTarget, retry_seconds: float) -> int:
        return self.activation.activate(adapter, retry_seconds)

    def catch_up(self, replica: Replica) -> bool:
        return self.replica_set.catch_up(replica)

    def ready(self) -> list[Replica]:
        return self.replica_set.ready()

    def lagging(self) -> list[LaggingReplica]:
        return self.replica_set.lagging()

    def server_info(self) -> dict[str, Any]:
        return self.replica_set.server_info()

    def completions(
        self, *, model: str, prompts: Sequence[Sequence[int]], n: int, sampling: dict[str, Any]
    ) -> Completions:
        return self.dispatch.completions(model=model, prompts=prompts, n=n, sampling=sampling)
