"""Server settings derived from the run-config (pure, apart from locating the model directory)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from grpo_api.models import ServerSpec
from grpo_api.runconfig import RunConfig

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


def settings_from_config(
    config: RunConfig, *, host: str | None, port: int | None, engine: str | None
) -> ServerSettings:
    server = config.spec.effective_server
    return ServerSettings(
        served_model_name=config.spec.model.name,
        model_dir=config.model_dir(),
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
