"""Wire protocol shared by the server and its clients (trainer, operator, local runner).

The server answers with these models and the clients parse with them, so the
two sides cannot drift. OpenAI-compatible shapes live in the server; what is
here is the project's own native protocol.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

#: Response headers every generation carries, so a client can tell which policy produced it.
BOOT_ID_HEADER = "X-GRPO-Boot-Id"
ADAPTER_VERSION_HEADER = "X-GRPO-Adapter-Version"
#: Request header our trainer puts on every request: its attempt. A server of a later attempt refuses it (409).
ATTEMPT_HEADER = "X-GRPO-Attempt"

#: How long the server keeps an idle HTTP/1.1 connection open (uvicorn's default, as `vllm serve`'s). A client that
#: pools connections drops an idle one sooner (CLIENT_KEEPALIVE_SECONDS): a request sent on a connection at the moment
#: the server closes it fails with a transport error (httpx.ReadError) rather than being answered, and httpx's own
#: expiry (5 s) equals the server's.
SERVER_KEEP_ALIVE_SECONDS = 5
CLIENT_KEEPALIVE_SECONDS = 2.0

#: Environment variables the containers read (rendered by the operator, set by the local runner).
ENV_RUN_CONFIG = "GRPO_RUN_CONFIG"
ENV_TOKEN_FILE = "GRPO_TOKEN_FILE"
ENV_TOKEN = "GRPO_TOKEN"
ENV_SERVER_URL = "GRPO_SERVER_URL"
ENV_ATTEMPT = "GRPO_ATTEMPT"
#: A trainer process ends when the process of this pid does (set by `grpo run` for `grpo train`, by `grpo train`
#: for its torchrun and by that torchrun for the ranks): no process of an attempt outlives the one that started it.
ENV_PARENT_PID = "GRPO_PARENT_PID"


class WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ActiveAdapter(WireModel):
    """The adapter the server applies to requests that name the policy."""

    name: str = Field(description="Engine-level adapter name, unique per version (policy-v<N>).")
    version: int = Field(description="Adapter version N.")
    sha256: str | None = Field(default=None, description="Digest of the adapter's manifest.")
    path: str = Field(description="Directory it was loaded from.")
    loaded_at: dt.datetime = Field(description="When it became active.")


class LaggingReplica(WireModel):
    """A server replica that does not serve the trainer's current policy version: it gets no work."""

    url: str = Field(description="The replica's address.")
    since: dt.datetime = Field(description="Since when it has not served the current version.")
    reason: str = Field(default="", description="Why, as the trainer last saw it.")


class TrainingProgress(WireModel):
    """The trainer's progress file on the volume (`paths.progressFile`), relayed by the server's health."""

    step: int = Field(default=0, description="Optimizer steps completed.")
    max_steps: int = Field(default=0, description="Optimizer steps to train.")
    reward_mean: float | None = Field(default=None, description="Mean total reward of the latest step.")
    reward_std: float | None = Field(default=None, description="Std of the total reward of the latest step.")
    adapter_version: int | None = Field(default=None, description="Latest published adapter version.")
    sync_seconds: float | None = Field(default=None, description="Latency of the latest adapter sync.")
    attempt: int | None = Field(default=None, description="Attempt of the trainer that wrote it.")
    lagging_replicas: list[LaggingReplica] = Field(
        default_factory=list,
        description="Server replicas that lag (hung, unreachable, restarted, or behind the current version): "
        "they get no work until they serve the current version, and are caught up in the background.",
    )
    done: bool = Field(default=False, description="The trainer finished all steps.")
    updated_at: dt.datetime = Field(description="When it was written.")


class HealthResponse(WireModel):
    """Body of `GET /health/`: 200 only when a generation can be served."""

    status: str = Field(description="ok, or loading while the engine starts.")
    boot_id: str = Field(description="Random per process start; a new value means a fresh server.")
    model: str = Field(description="Served model name.")
    model_fingerprint: str = Field(
        description="Hash of the model's config.json and its weight files' names, sizes and sha256 digests."
    )
    engine: str = Field(description="vllm or transformers.")
    adapter: ActiveAdapter | None = Field(default=None, description="Active adapter, or none.")
    weights_version: int = Field(
        default=0, description="Version of the base weights: 0 as read from disk, then one per weight transfer."
    )
    uptime_seconds: float = Field(description="Seconds since the process started.")
    progress: TrainingProgress | None = Field(
        default=None, description="The trainer's latest progress file, when the server can read it."
    )


def _path_text(value: str) -> str:
    """A path a file system can take: no NUL byte, valid Unicode (no lone surrogates)."""
    if "\x00" in value:
        raise ValueError("must not contain a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text") from None
    return value


#: An adapter directory as a trigger names it (Linux PATH_MAX is 4096 bytes).
AdapterPath = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_path_text)]


class SetAdapterRequest(WireModel):
    """Body of `POST /set_lora_adapter/`: ours ({path, version, sha256}) or Axolotl's."""

    path: AdapterPath | None = Field(default=None, description="Adapter directory (ours).")
    version: int | None = Field(default=None, ge=1, lt=2**63, description="Adapter version (ours).")
    sha256: str | None = Field(default=None, max_length=128, description="Expected manifest digest (ours).")
    lora_name: str | None = Field(default=None, max_length=256, description="Adapter name (Axolotl).")
    lora_int_id: int | None = Field(default=None, ge=1, lt=2**63, description="Adapter id (Axolotl).")
    lora_path: AdapterPath | None = Field(default=None, description="Adapter directory (Axolotl).")
    load_inplace: bool = Field(default=False, description="Ignored: every version gets its own name.")


class SetAdapterResponse(WireModel):
    """Answer of a successful load: the adapter is active for requests that arrive after it."""

    status: str = Field(default="ok", description="ok")
    adapter: ActiveAdapter = Field(description="The now-active adapter.")
    load_seconds: float = Field(description="Time to validate and load it.")
    boot_id: str = Field(description="Server boot id.")


class ErrorResponse(WireModel):
    """Every 4xx/5xx body."""

    error: str = Field(description="Machine-readable reason, e.g. adapter_outside_root.")
    message: str = Field(description="Human-readable detail naming the field or file.")


#: Reasons an adapter load is refused (also the `reason` label of the failure metric).
ADAPTER_REFUSALS = (
    "adapter_outside_root",
    "adapter_missing",
    "adapter_config_invalid",
    "adapter_base_model_mismatch",
    "adapter_rank_too_large",
    "adapter_unsupported",
    "adapter_checksum_mismatch",
    "adapter_load_failed",
    "adapter_load_busy",
    "adapter_version_stale",
    "adapter_version_conflict",
    "adapter_weights_invalid",
)
