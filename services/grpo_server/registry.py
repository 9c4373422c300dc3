"""Which adapters are loaded, which one is active, and which requests still use each.

Runs on the event loop only (no locks). A request takes a lease on the adapter its
`model` field names at admission; the lease pins that version until the request
ends, so a trigger can activate a newer version at any time without disturbing
requests already running. Versions beyond `max_loaded` are evicted oldest first,
but only once no lease holds them.

Model names a request may use:
- omitted or the served model name: the active adapter at admission (base if none);
- `policy-v<N>`: version N, which must be loaded;
- `<served>:base`: the base model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from grpo_api.protocol import ActiveAdapter
from grpo_server.engines.base import AdapterHandle

ADAPTER_NAME = re.compile(r"^policy-v(\d+)$")
BASE_SUFFIX = ":base"


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


class ModelNotFound(LookupError):
    """A request named a model or adapter version this server does not have."""


@dataclass
class LoadedAdapter:
    handle: AdapterHandle
    info: ActiveAdapter
    digest: str | None
    leases: int = 0

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

    @property
    def loaded(self) -> list[LoadedAdapter]:
        return list(self._loaded.values())

    def get(self, version: int) -> LoadedAdapter | None:
        return self._loaded.get(version)

    def next_int_id(self) -> int:
        self._last_int_id += 1
        return self._last_int_id

    def next_version(self) -> int:
        """Version for a trigger that carries none (Axolotl's payload)."""
        return self._highest_version + 1

    def add(self, adapter: LoadedAdapter) -> None:
        self._loaded[adapter.version] = adapter
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
        match = ADAPTER_NAME.match(model)
        if match:
            adapter = self._loaded.get(int(match.group(1)))
            if adapter is None:
                raise ModelNotFound(f"model {model}: that adapter version is not loaded (see GET /v1/models)")
            return adapter
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
        return [a.handle.name for a in self._loaded.values()]
