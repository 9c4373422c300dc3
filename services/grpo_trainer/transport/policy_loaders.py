"""How a policy version is made active on one replica and read back from its `/health/`: the loader protocol,
LoRA's loader (`AdapterLoader`; full fine-tuning's is `weight_sync.WeightLoader`) and the confirmation both use."""

from __future__ import annotations

from typing import Any, Protocol

from grpo_api.protocol import HealthResponse, SetAdapterRequest
from grpo_trainer.transport.adapter_store import PublishedAdapter
from grpo_trainer.transport.server_client import ServerClient


class PolicyTarget(Protocol):
    """A policy version the replicas should serve."""

    @property
    def version(self) -> int: ...

    @property
    def label(self) -> str:
        """How messages name it, e.g. `adapter v3 (/adapters/v3)`."""
        ...


class PolicyLoader(Protocol):
    """How a policy version is made active on one replica, and read back from its `/health/`."""

    #: What messages call the policy's versions ("adapter", "weights").
    kind: str

    def served(self, health: HealthResponse) -> int | None:
        """The policy version a replica's `/health/` reports (None: the weights it started with)."""
        ...

    def load(self, client: ServerClient, target: Any) -> str:
        """Make `target` active on the replica and confirm it by `/health/` on the same boot; the boot id.

        Raises AdapterRefused (the server refused it), Unconfirmed, or httpx errors."""
        ...


class Unconfirmed(Exception):
    """The server did not (yet) report the version just loaded."""


class Unreachable(Unconfirmed):
    """No connection: once another replica has the version, this one is not waited for."""


class AdapterLoader:
    """LoRA: the replica loads the published version from the shared volume (`/set_lora_adapter/`)."""

    kind = "adapter"

    def served(self, health: HealthResponse) -> int | None:
        return health.adapter.version if health.adapter else None

    def load(self, client: ServerClient, target: PublishedAdapter) -> str:
        request = SetAdapterRequest(path=str(target.path), version=target.version, sha256=target.sha256)
        response = client.set_adapter(request)
        if response.adapter.version != target.version:
            raise Unconfirmed(f"load trigger answered version {response.adapter.version}")
        confirm(client, response.boot_id, target.version, self)
        return response.boot_id


def confirm(client: ServerClient, boot_id: str, version: int, loader: PolicyLoader) -> None:
    """The replica's `/health/`, on the boot that answered the load, reports `version`."""
    health = client.health()
    if health.boot_id != boot_id:
        raise Unconfirmed(f"server restarted during the load (boot {health.boot_id})")
    shown = loader.served(health)
    if shown != version:
        raise Unconfirmed(f"/health/ reports {loader.kind} version {shown}")
