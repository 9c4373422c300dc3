"""Server settings derived from the run-config (pure, apart from locating the model directory)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from grpo_api.models import ServerSpec
from grpo_api.runconfig import RunConfig, RunConfigError

#: Largest request body accepted; more is answered 413. Overridable for very large token-id batches.
ENV_MAX_BODY_BYTES = "GRPO_SERVER_MAX_BODY_BYTES"
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: How long SIGTERM waits for in-flight requests before closing them.
GRACEFUL_SHUTDOWN_SECONDS = 20
#: How long a second adapter trigger waits for the first before it is refused.
TRIGGER_WAIT_SECONDS = 120.0


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    model_dir: Path
    adapter_root: Path
    progress_file: Path
    token: str | None
    engine: str  # requested: auto, vllm or transformers
    server: ServerSpec
    host: str
    port: int
    max_body_bytes: int
    run_name: str


def resolve_model_dir(config: RunConfig) -> Path:
    """`spec.model.path` resolved against the run's base dir, else the hub name looked up in the local cache."""
    model = config.spec.model
    if model.path:
        path = config.resolve(model.path)
        if not (path / "config.json").is_file():
            raise RunConfigError(f"spec.model.path: {path} is not a Hugging Face model directory (no config.json)")
        return path
    direct = Path(model.name).expanduser()
    if (direct / "config.json").is_file():
        return direct
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model.name, revision=model.revision, local_files_only=True))
    except Exception as exc:  # huggingface_hub raises several error types for "not cached"
        raise RunConfigError(
            f"spec.model.name: {model.name!r} is neither a model directory nor in the local model cache "
            f"(set spec.model.path, or pre-fill the cache): {exc}"
        ) from exc


def settings_from_config(
    config: RunConfig, *, host: str | None, port: int | None, engine: str | None
) -> ServerSettings:
    server = config.spec.effective_server
    return ServerSettings(
        served_model_name=config.spec.model.name,
        model_dir=resolve_model_dir(config),
        adapter_root=Path(config.paths.adapter_root),
        progress_file=Path(config.paths.progress_file),
        token=config.read_token(),
        engine=engine or str(server.engine),
        server=server,
        host=host or "0.0.0.0",
        port=port or server.port,
        max_body_bytes=int(os.environ.get(ENV_MAX_BODY_BYTES, DEFAULT_MAX_BODY_BYTES)),
        run_name=config.run.name,
    )
