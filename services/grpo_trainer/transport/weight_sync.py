"""Full fine-tuning's sync: push the whole policy into every server replica with vLLM's weight transfer.

Each sync takes a copy of every parameter in the serving dtype (`take`, on the model's device, while
the optimizer waits), then, in the background like an adapter sync, makes it the server's weights:
`/start_weight_update`, `/update_weights` with the tensors' names, dtypes and shapes while the
tensors move, `/finish_weight_update {version}`, and `/health/` on the same boot reporting the
version. The version is the optimizer step the weights were taken at, so staleness in steps is read
straight off each answer's `X-GRPO-Weights-Version`; version 0 is the checkpoint the server read from
disk, which is the policy before the first step.

How the tensors move is the server's choice, read from its `/server_info` (`weight_transfer_config`):

- `ipc` (vLLM, trainer and server on one GPU): CUDA IPC handles of the copies, in the request body;
  the server's workers read the GPU memory directly. No bytes are copied through a socket.
- `nccl` (vLLM, across GPUs and pods): the trainer is rank 0 of a NCCL group and hosts its rendezvous
  on `GRPO_TRAINER_ADDRESS` (the pod's IP on a cluster); each replica joins at rank 1.. with
  `/init_weight_transfer_engine`, once per boot; one broadcast per tensor (vLLM's trainer helper).
- `gloo` (the transformers engine, CPU): the same exchange as nccl over a gloo group.

The latest pushed copy is kept: a replica that restarted (new boot id, its weights back to version 0)
gets it pushed again, in the background, before it gets work again, as an adapter is loaded again
(replicas.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from grpo_api.protocol import HealthResponse
from grpo_api.weight_transfer import GLOO_STORE_PREFIX
from grpo_trainer.errors import TrainingFailed
from grpo_trainer.metrics import TrainerMetrics
from grpo_trainer.transport.adapter_files import snapshot_peft_adapter
from grpo_trainer.transport.adapter_store import AdapterStore
from grpo_trainer.transport.policy_loaders import Unconfirmed, confirm
from grpo_trainer.transport.policy_sync import PolicySync
from grpo_trainer.transport.replicas import ServerPool
from grpo_trainer.transport.server_client import Completions, ServerClient

#: Address the server reaches the trainer's rendezvous at (nccl, gloo); the operator sets the pod's IP.
ENV_TRAINER_ADDRESS = "GRPO_TRAINER_ADDRESS"
DEFAULT_TRAINER_ADDRESS = "127.0.0.1"
#: How long a replica may take to join the group, and a transfer to finish.
RENDEZVOUS_SECONDS = 120.0
#: How long the first update on a group waits for a refusal before it broadcasts.
REFUSAL_WINDOW_SECONDS = 2.0
#: Backends this trainer can push to, as `/server_info` names them.
BACKENDS = ("ipc", "nccl", "gloo")


@dataclass(frozen=True)
class WeightSnapshot:
    """Every parameter of the policy as of one step: detached copies in the serving dtype."""

    tensors: dict[str, Any]

    @property
    def size_bytes(self) -> int:
        return sum(int(t.numel()) * int(t.element_size()) for t in self.tensors.values())


@dataclass(frozen=True)
class PushedWeights:
    """One weights version: the step it was taken at, and its copy (kept to catch restarted replicas up)."""

    version: int
    snapshot: WeightSnapshot = field(repr=False)

    @property
    def label(self) -> str:
        return f"weights v{self.version}"


@dataclass(frozen=True)
class WeightSyncResult:
    weights: PushedWeights
    seconds: float
    attempts: int

    @property
    def version(self) -> int:
        return self.weights.version


#: Where each copy starts in its snapshot's buffer: a multiple of this many bytes (what cudaMalloc aligns to).
ALIGN_BYTES = 256


def packed_copies(sources: list[tuple[str, Any]], dtype: Any) -> dict[str, Any]:
    """Empty tensors shaped like `sources` (name, tensor), in `dtype`, as views of one buffer per device.

    A push over ipc shares each buffer once instead of every tensor: the server's workers open one CUDA IPC
    handle (and wait on one event) per buffer, where separate copies cost an open per tensor, 338 for the
    1.5B model. Each view starts on an `ALIGN_BYTES` boundary; the caller fills them."""
    import torch

    element = torch.empty((), dtype=dtype).element_size()
    align = max(ALIGN_BYTES // element, 1)
    offsets: list[int] = []
    totals: dict[Any, int] = {}
    for _, tensor in sources:
        start = totals.get(tensor.device, 0)
        offsets.append(start)
        totals[tensor.device] = start + -(-tensor.numel() // align) * align
    buffers = {device: torch.empty(total, dtype=dtype, device=device) for device, total in totals.items()}
    return {name: buffers[tensor.device][start:start + tensor.numel()].view(tensor.shape)
            for (name, tensor), start in zip(sources, offsets, strict=True)}


def take_snapshot(model: Any, dtype: str) -> WeightSnapshot:
    """Copies of the model's parameters under their checkpoint names, in `dtype` (the serving dtype), packed
    into one buffer per device (`packed_copies`).

    On a GPU the copies are queued on the current stream; `Channel.push` waits for them first.
    """
    import torch

    params = list(model.named_parameters())
    with torch.no_grad():
        tensors = packed_copies(params, getattr(torch, dtype))
        for name, param in params:
            tensors[name].copy_(param.detach())
    return WeightSnapshot(tensors)


def update_info(snapshot: WeightSnapshot) -> dict[str, Any]:
    """`update_info` of `/update_weights`: the tensors in send order (nccl, gloo)."""
    names = list(snapshot.tensors)
    return {
        "names": names,
        "dtype_names": [str(snapshot.tensors[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(snapshot.tensors[n].shape) for n in names],
        "packed": False,
    }


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host if host != "0.0.0.0" else "", 0))
        return int(sock.getsockname()[1])


@dataclass
class PushPhases:
    """Where one push's time went, as the trainer saw each phase and as the server reported its own share
    (the `seconds` of its answers): the next lever on the push is read off these, not guessed."""

    seen: dict[str, float] = field(default_factory=dict)
    by_server: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seen[phase] = time.monotonic() - started

    def server(self, phase: str, seconds: float) -> None:
        self.by_server[phase] = seconds

    def describe(self) -> str:
        """`health 0.004 s, copies 0.000 s, join 0.000 s, start 0.010 s, send 0.150 s (server 0.140 s), ...`."""
        return ", ".join(
            f"{phase} {seconds:.3f} s" + (f" (server {self.by_server[phase]:.3f} s)" if phase in self.by_server else "")
            for phase, seconds in self.seen.items())


class Channel:
    """How one replica receives a push; `push` returns the server's weights version after finish."""

    backend = ""

    def push(self, client: ServerClient, snapshot: WeightSnapshot, version: int, phases: PushPhases) -> int:
        with phases.timed("copies"):
            _wait_for_copies(snapshot)
        with phases.timed("join"):
            self._prepare(client)
        with phases.timed("start"):
            client.weight_transfer("start_weight_update", {"is_checkpoint_format": True})
        with phases.timed("send"):
            phases.server("send", self._send(client, snapshot))
        with phases.timed("finish"):
            done = client.weight_transfer("finish_weight_update", {"version": version})
        phases.server("finish", done.seconds)
        return done.weights_version

    def _prepare(self, client: ServerClient) -> None:
        """What must precede `/start_weight_update` (joining the group)."""

    def _send(self, client: ServerClient, snapshot: WeightSnapshot) -> float:
        """Move the tensors; the seconds the server spent in its `/update_weights`."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the group (the replica restarted, or a transfer failed): the next push joins again."""

    def close(self) -> None:
        self.reset()


class IpcChannel(Channel):
    """CUDA IPC: the handles of the copies travel in `/update_weights`; the server reads the GPU memory."""

    backend = "ipc"

    def _send(self, client: ServerClient, snapshot: WeightSnapshot) -> float:
        from grpo_trainer.transport.weight_ipc import ipc_update_info

        # The copies stay alive (the snapshot holds them) until the server answered.
        info = ipc_update_info(list(snapshot.tensors.items()))
        return client.weight_transfer("update_weights", {"update_info": info}, timeout=RENDEZVOUS_SECONDS).seconds


class GroupChannel(Channel):
    """A collective group with the replica (nccl, gloo): joined once per boot, one broadcast per tensor.

    The trainer is rank 0 and hosts the rendezvous; `/init_weight_transfer_engine` returns once the
    replica joined, so it runs on a thread while this side builds its end of the group.
    """

    def __init__(self, address: str, server_workers: int) -> None:
        self.address = address
        self.server_workers = server_workers
        self._group: Any = None
        self._store: Any = None
        #: A push went through on this group: the server accepts these names and shapes.
        self._verified = False

    def _prepare(self, client: ServerClient) -> None:
        if self._group is not None:
            return
        world = 1 + self.server_workers
        try:
            port, listener = self._listen(world)
        except Exception as exc:
            raise Unconfirmed(f"{self.backend} rendezvous on {self.address} could not listen: "
                              f"{type(exc).__name__}: {exc}") from exc
        init = {"master_address": self.address, "master_port": port, "rank_offset": 1, "world_size": world,
                "timeout_seconds": RENDEZVOUS_SECONDS}
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpo-weight-join") as pool:
            joined = pool.submit(client.weight_transfer, "init_weight_transfer_engine", {"init_info": init},
                                 timeout=RENDEZVOUS_SECONDS + 30)
            try:
                self._store, self._group = self._host(listener, port, world)
            except TrainingFailed:
                joined.cancel()
                raise
            except Exception as exc:
                joined.cancel()
                raise Unconfirmed(f"{self.backend} rendezvous on {self.address}:{port} failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
            joined.result()

    def _listen(self, world: int) -> tuple[int, Any]:
        """The rendezvous port the replica is told, and what already listens on it (None: `_host` binds it)."""
        return _free_port(self.address), None

    def _host(self, listener: Any, port: int, world: int) -> tuple[Any, Any]:
        raise NotImplementedError

    def _broadcast(self, tensor: Any) -> None:
        raise NotImplementedError

    def _send(self, client: ServerClient, snapshot: WeightSnapshot) -> float:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grpo-weight-update") as pool:
            answered = pool.submit(client.weight_transfer, "update_weights", {"update_info": update_info(snapshot)},
                                   timeout=RENDEZVOUS_SECONDS)
            if not self._verified:
                # A refusal (a name or shape the server's model lacks) answers before any byte moves, and a
                # broadcast nobody receives would wait forever on nccl: give it a moment to come first.
                try:
                    answered.result(timeout=REFUSAL_WINDOW_SECONDS)
                except concurrent.futures.TimeoutError:
                    pass
                except Exception:
                    self.reset()
                    raise
            try:
                for tensor in snapshot.tensors.values():
                    self._broadcast(tensor)
            except Exception:
                self.reset()  # the group's state is unknown after a failed collective
                raise
            try:
                seconds = answered.result().seconds
            except Exception:
                self.reset()
                raise
        self._verified = True
        return seconds

    def reset(self) -> None:
        self._group, self._store, self._verified = None, None, False


class GlooChannel(GroupChannel):
    """The store listens on a port the kernel picks before the replica is told it: no port is picked, freed
    and bound again later, which another process could take in between."""

    backend = "gloo"

    def _listen(self, world: int) -> tuple[int, Any]:
        import torch.distributed as dist

        limit = dt.timedelta(seconds=RENDEZVOUS_SECONDS)
        store = dist.TCPStore(self.address, 0, world, is_master=True, timeout=limit, wait_for_workers=False)
        return int(store.port), store

    def _host(self, listener: Any, port: int, world: int) -> tuple[Any, Any]:
        import torch.distributed as dist

        limit = dt.timedelta(seconds=RENDEZVOUS_SECONDS)
        group = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_STORE_PREFIX, listener), 0, world, limit)
        return listener, group

    def _broadcast(self, tensor: Any) -> None:
        self._group.broadcast(tensor.cpu() if tensor.is_cuda else tensor, 0).wait()


class NcclChannel(GroupChannel):
    """vLLM's own trainer side (`NCCLWeightTransferEngine.trainer_init`, its broadcast): needs vLLM here.

    `trainer_init` binds the port it is given, so the port is picked free first (a clash fails the
    rendezvous, which the pool retries as Unconfirmed)."""

    backend = "nccl"

    def _host(self, listener: Any, port: int, world: int) -> tuple[Any, Any]:
        try:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
        except ImportError as exc:
            raise TrainingFailed(
                "the server takes weights over nccl, whose trainer side is vLLM's (its NCCL group and broadcast): "
                "run the trainer from an image with vLLM (the vllm extra, as colocate mode needs), or put the "
                f"server on the trainer's GPU with server.weightTransfer ipc ({exc})") from exc

        group = NCCLWeightTransferEngine.trainer_init(
            {"master_address": self.address, "master_port": port, "world_size": world})
        return None, group

    def _broadcast(self, tensor: Any) -> None:
        import torch

        self._group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())


def _wait_for_copies(snapshot: WeightSnapshot) -> None:
    """The copies queued by `take_snapshot` on a GPU are complete before another process reads them."""
    first = next(iter(snapshot.tensors.values()), None)
    if first is not None and first.is_cuda:
        import torch

        torch.cuda.synchronize(first.device)


def make_channel(backend: str, *, server_workers: int) -> Channel:
    if backend == "ipc":
        return IpcChannel()
    address = os.environ.get(ENV_TRAINER_ADDRESS, "").strip() or DEFAULT_TRAINER_ADDRESS
    if backend == "nccl":
        return NcclChannel(address, server_workers)
    if backend == "gloo":
        return GlooChannel(address, server_workers)
    raise TrainingFailed(
        f"the server takes weights over {backend!r}, which this trainer cannot send (it sends {', '.join(BACKENDS)})")


def server_backend(info: dict[str, Any]) -> tuple[str, int]:
    """The weight-transfer backend and worker count a server's `/server_info` reports; TrainingFailed when it
    takes no weights (a server started for LoRA)."""
    config = info.get("weight_transfer_config") or {}
    backend = config.get("backend") if isinstance(config, dict) else None
    if not backend:
        raise TrainingFailed(
            "trainer.tuning is full but the generation server takes no weight updates (its /server_info has no "
            "weight_transfer_config): it was started for LoRA; restart it from this run's spec")
    parallel = info.get("parallel_config") or {}
    workers = int(parallel.get("tensor_parallel_size", 1)) * int(parallel.get("data_parallel_size", 1))
    return str(backend), max(workers, 1)


class WeightLoader:
    """The pool's loader for full fine-tuning: a replica gets a version by a push, one channel per replica."""

    kind = "weights"

    def __init__(self) -> None:
        self._channels: dict[int, tuple[str, Channel]] = {}
        self._lock = threading.Lock()
        #: The phases of the latest push that was confirmed (of any replica).
        self.last_phases: PushPhases | None = None

    def served(self, health: HealthResponse) -> int | None:
        return health.weights_version or None

    def load(self, client: ServerClient, target: PushedWeights) -> str:
        phases = PushPhases()
        with phases.timed("health"):
            boot_id = client.health().boot_id
        channel = self._channel(client, boot_id)
        try:
            version = channel.push(client, target.snapshot, target.version, phases)
        except Exception:
            channel.reset()
            raise
        if version != target.version:
            raise Unconfirmed(f"/finish_weight_update answered weights version {version}")
        with phases.timed("confirm"):
            confirm(client, boot_id, target.version, self)
        with self._lock:
            self.last_phases = phases
        return boot_id

    def _channel(self, client: ServerClient, boot_id: str) -> Channel:
        """The replica's channel; a new one (joining again) when the server behind the client restarted.

        `/server_info` is asked outside the lock: a replica that does not answer holds up no other's push (the
        pool runs one load per replica at a time, so a client's channel is not raced)."""
        with self._lock:
            known = self._channels.get(id(client))
        if known is not None and known[0] == boot_id:
            return known[1]
        if known is not None:
            known[1].close()
        backend, workers = server_backend(client.server_info())
        channel = make_channel(backend, server_workers=workers)
        with self._lock:
            self._channels[id(client)] = (boot_id, channel)
        return channel

    def close(self) -> None:
        with self._lock:
            for _, channel in self._channels.values():
                channel.close()
            self._channels.clear()


class WeightSync(PolicySync[WeightSnapshot, WeightSyncResult]):
    """Full fine-tuning: owns the active weights version, the one the server's replicas serve."""

    kind = "weights"

    def __init__(self, pool: ServerPool | None, metrics: TrainerMetrics, *, retry_seconds: float) -> None:
        super().__init__(metrics)
        self.pool = pool
        self.retry_seconds = retry_seconds
        self.active: PushedWeights | None = None

    def take(self, model: Any, dtype: str) -> WeightSnapshot:
        # Without a server (colocate: TRL moves the weights into its own vLLM) there is nothing to push.
        return take_snapshot(model, dtype) if self.pool is not None else WeightSnapshot({})

    def step_of(self, version: int) -> int | None:
        return version  # a weights version is the step it was taken at

    def version_of(self, result: Completions) -> int | None:
        return result.weights_version or None

    def describe(self, result: WeightSyncResult, step: int, reason: str, note: str) -> str:
        snapshot = result.weights.snapshot
        if self.pool is None:
            return f"weights v{result.version} (step {step}, {reason}): colocate, TRL moves them into its own vLLM"
        phases = self.pool.loader.last_phases if isinstance(self.pool.loader, WeightLoader) else None
        return (f"pushed weights v{result.version} ({len(snapshot.tensors)} tensors, {snapshot.size_bytes} bytes) "
                f"(step {step}, {reason}): {result.seconds:.2f}s {note}"
                + (f"; phases: {phases.describe()}" if phases is not None else ""))

    def _sync(self, snapshot: WeightSnapshot, step: int) -> WeightSyncResult:
        started = time.monotonic()
        if self.active is not None and step <= self.active.version:
            raise TrainingFailed(f"weights of step {step} are not newer than the active v{self.active.version}")
        weights = PushedWeights(version=step, snapshot=snapshot)
        attempts = self.pool.activate(weights, self.retry_seconds) if self.pool is not None else 0
        seconds = time.monotonic() - started
        self.active = weights  # the previous copy is freed: the replicas serve this one now
        self.metrics.sync_seconds.observe(seconds)
        self.metrics.sync_last_bytes.set(snapshot.size_bytes)
        self.metrics.sync_bytes_total.inc(snapshot.size_bytes)
        self.metrics.syncs.inc()
        self.metrics.adapter_version.set(weights.version)
        return WeightSyncResult(weights=weights, seconds=seconds, attempts=attempts)

    def close(self) -> None:
        super().close()
        if self.pool is not None and isinstance(self.pool.loader, WeightLoader):
            self.pool.loader.close()


#: PEFT's prefix of the wrapped model's module names (`PeftModel.base_model.model`).
PEFT_PREFIX = "base_model.model."
#: A LoRA parameter of a PEFT model (A, B, embedding halves, DoRA's magnitude): not a base weight.
LORA_PARAMETER = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


def take_merged_snapshot(model: Any, dtype: str) -> WeightSnapshot:
    """Every base weight under the checkpoint's name, in `dtype`, the LoRA target modules' with the adapter
    merged in (W + scale·BA, PEFT's own delta): what the server must hold to generate as base + adapter does.

    The weights no adapter touches are pushed too: vLLM reloads in place only from a complete set of a
    layer's tensors (a fused qkv given its weights without their biases gets uninitialised biases), and a
    vllm server refuses an update without every tensor (`weight_update_incomplete`). They are ~4% of the
    bytes of an all-linear 1.5B model; the order is the model's, layer by layer."""
    import torch
    from peft.tuners.lora import LoraLayer

    layers: dict[str, Any] = {  # a LoRA Linear: get_delta_weight is PEFT's W += delta of merge()
        f"{name.removeprefix(PEFT_PREFIX)}.weight": module for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and module.active_adapters}
    if not layers:
        raise TrainingFailed("trainer.sync merged found no LoRA layer in the policy to merge")
    params = [(name.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."), param)
              for name, param in model.named_parameters() if not LORA_PARAMETER.search(name)]
    unmatched = set(layers) - {key for key, _ in params}
    if unmatched:  # a merged module whose base weight is not a parameter of the model: a naming bug, never pushed
        raise TrainingFailed(f"trainer.sync merged: no base parameter for {', '.join(sorted(unmatched)[:3])}")
    with torch.no_grad():
        tensors = packed_copies(params, getattr(torch, dtype))
        for key, param in params:
            layer = layers.get(key)
            if layer is None:
                tensors[key].copy_(param.detach())
                continue
            weight = layer.get_base_layer().weight.detach().to(torch.float32)
            for adapter in layer.active_adapters:
                weight = weight + layer.get_delta_weight(adapter).to(torch.float32)
            tensors[key].copy_(weight)
    return WeightSnapshot(tensors)


class MergedSync(WeightSync):
    """LoRA with `trainer.sync: merged`: the target modules' merged weights are pushed as full tuning's are;
    the adapter stays the artifact (in checkpoints, and published to the volume at the end)."""

    kind = "merged weights"

    def __init__(self, pool: ServerPool | None, store: AdapterStore, metrics: TrainerMetrics, *,
                 retry_seconds: float) -> None:
        super().__init__(pool, metrics, retry_seconds=retry_seconds)
        self.store = store

    def take(self, model: Any, dtype: str) -> WeightSnapshot:
        return take_merged_snapshot(model, dtype) if self.pool is not None else WeightSnapshot({})

    def describe(self, result: WeightSyncResult, step: int, reason: str, note: str) -> str:
        return "merged: " + super().describe(result, step, reason, note)

    def publish_final(self, model: Any, dtype: str, step: int) -> str | None:
        adapter = self.store.publish(snapshot_peft_adapter(model, dtype=dtype).write, step)
        return f"published the final adapter as v{adapter.version} ({adapter.path}, not loaded: the server serves " \
               f"the merged weights v{self.active.version if self.active else 0})"
