"""Which adapters are loaded, which one is active, and which requests still use each.

Runs on the event loop only (no locks). A request takes a lease on the adapter its
`model` field names at admission; the lease pins that version until the request
ends, so a trigger can activate a newer version at any time without disturbing
requests already running. Versions beyond `max_loaded` are evicted oldest first,
but only once no lease holds them.

Within one server boot versions only move forward, and a version number means one
content: a trigger below the highest version accepted so far is stale (there is no
rollback), and a version accepted once stays bound to its manifest digest for the
life of the process, loaded or evicted (the engine name `policy-v<N>` keys vLLM's
prefix cache, so one name must never stand for two sets of weights).

Model names a request may use:
- omitted or the served model name: the active adapter at admission (base if none);
- `policy-v<N>`: version N, which must be loaded;
- the name a client loaded version N under through vLLM's `/v1/load_lora_adapter` (TRL's
  `trl-policy-v<N>`), while it is loaded;
- `<served>:base`: the base model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from grpo_api.protocol import ActiveAdapter
from grpo_server.adapter_checks import AdapterRefusal
from grpo_server.engines.base import AdapterHandle
from grpo_server.errors import ServerError

ADAPTER_NAME = re.compile(r"^policy-v(\d+)$")
#: A client's adapter name that carries its version (`<anything>-v<N>`, TRL's naming).
VERSIONED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,200}-v(\d{1,18})$")
BASE_SUFFIX = ":base"


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


class ModelNotFound(ServerError):
    """A request named a model or adapter version this server does not have (404)."""

    default_status = 404
    default_error = "model_not_found"


@dataclass
class LoadedAdapter:
    handle: AdapterHandle
    info: ActiveAdapter
    digest: str | None
    leases: int = 0
    #: The name the client loaded it under (vLLM's `lora_name`), when not ours.
    alias: str | None = None

    @property
    def version(self) -> int:
        return self.info.version


@dataclass(frozen=True)
class Lease:
    """What one request runs on: an adapter, or the base model (None)."""

    adapter: LoadedAdapter | None

    @property
    def version(self) -> int | None:
        return self.adapter.version if self.adapter is not None else None

    @property
    def handle(self) -> AdapterHandle | None:
        return self.adapter.handle if self.adapter is not None else None


class AdapterRegistry:
    def __init__(self, served_name: str, max_loaded: int) -> None:
        self.served_name = served_name
        self.max_loaded = max_loaded
        self.active: LoadedAdapter | None = None
        self._loaded: dict[int, LoadedAdapter] = {}  # insertion order is load order
        self._last_int_id = 0
        self._highest_version = 0
        #: Every version accepted this boot -> its manifest digest (None: no manifest); never pruned.
        self._bound: dict[int, str | None] = {}

    @property
    def loaded(self) -> list[LoadedAdapter]:
        return list(self._loaded.values())

    def get(self, version: int) -> LoadedAdapter | None:
        return self._loaded.get(version)

    def named(self, name: str) -> LoadedAdapter | None:
        """The loaded version a client's name (its alias, or `policy-v<N>`) stands for."""
        for adapter in self._loaded.values():
            if name in (adapter.alias, adapter.handle.name):
                return adapter
        return None

    def next_int_id(self) -> int:
        self._last_int_id += 1
        return self._last_int_id

    def next_version(self) -> int:
        """Version for a trigger that carries none (Axolotl's payload)."""
        return self._highest_version + 1

    def refuse_out_of_order(self, version: int, digest: str | None) -> None:
        """Refuse a version that may not become active now; nothing is read, so it can run before inspection.

        `digest` is the manifest digest the trigger claims (None: not known yet). A version bound
        to another digest is a conflict, whatever its number; below the highest it is stale, even
        with the same contents; the highest itself with the same contents is an idempotent retry.
        """
        if digest is not None and version in self._bound and self._bound[version] != digest:
            raise AdapterRefusal(
                "adapter_version_conflict",
                f"version {version} was loaded earlier by this server (manifest sha256 {self._bound[version]}) "
                f"and a version's contents never change; publish a new version above {self._highest_version}",
            )
        if version < self._highest_version:
            active = self.active
            now = f"v{active.version} is active" if active is not None else "no adapter is active (cleared)"
            raise AdapterRefusal(
                "adapter_version_stale",
                f"version {version} is older than version {self._highest_version}, the highest this server has "
                f"loaded since it started; {now}. Versions only move forward: publish a version above "
                f"{self._highest_version}",
            )

    def add(self, adapter: LoadedAdapter) -> None:
        """Register a loaded version, bound to its digest from now on (checked by `refuse_out_of_order` first)."""
        if adapter.alias is not None:  # a name stands for one version: the newest loaded under it
            for other in self._loaded.values():
                if other.alias == adapter.alias:
                    other.alias = None
        self._loaded[adapter.version] = adapter
        self._bound[adapter.version] = adapter.digest
        self._highest_version = max(self._highest_version, adapter.version)

    def activate(self, version: int) -> LoadedAdapter:
        self.active = self._loaded[version]
        return self.active

    def clear(self) -> None:
        self.active = None

    def resolve(self, model: str | None) -> LoadedAdapter | None:
        """The adapter a request's `model` field selects (None: the base model)."""
        if model is None or model == self.served_name:
            return self.active
        if model == self.served_name + BASE_SUFFIX:
            return None
        adapter = self.named(model)
        if adapter is not None:
            return adapter
        if ADAPTER_NAME.match(model) or VERSIONED_NAME.match(model):
            raise ModelNotFound(f"model {model}: that adapter version is not loaded (see GET /v1/models)")
        raise ModelNotFound(
            f"model {model!r} is not served here: use {self.served_name!r}, "
            f"'{self.served_name}{BASE_SUFFIX}' or a loaded 'policy-v<N>'"
        )

    @contextmanager
    def lease(self, model: str | None) -> Iterator[Lease]:
        adapter = self.resolve(model)
        if adapter is not None:
            adapter.leases += 1
        try:
            yield Lease(adapter)
        finally:
            if adapter is not None:
                adapter.leases -= 1

    def evictable(self) -> list[LoadedAdapter]:
        """Versions to unload now: beyond max_loaded, oldest first, not active, not leased."""
        excess = len(self._loaded) - self.max_loaded
        chosen: list[LoadedAdapter] = []
        for adapter in self._loaded.values():
            if len(chosen) >= excess:
                break
            if adapter is not self.active and adapter.leases == 0:
                chosen.append(adapter)
        return chosen

    def forget(self, version: int) -> LoadedAdapter | None:
        """Drop a version from the registry; afterwards no request can lease it."""
        return self._loaded.pop(version, None)

    def model_names(self) -> list[str]:
        """The name each loaded version is served under (the client's, when it loaded it under its own)."""
        return [a.alias or a.handle.name for a in self._loaded.values()]
