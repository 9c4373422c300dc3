"""`grpo serve`: the generation server's entry point (also the server image's entrypoint)."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

import click

from grpo_api.exit_codes import EXIT_INVALID_SPEC, clip_final_message, write_termination_message
from grpo_api.protocol import SERVER_KEEP_ALIVE_SECONDS
from grpo_api.runconfig import RunConfigError, load_run_config

log = logging.getLogger("grpo_server")


@click.command("serve")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Run-config or GRPORun file (default: $GRPO_RUN_CONFIG).",
)
@click.option("--host", default=None, help="Listen address (default 127.0.0.1; pods pass 0.0.0.0).")
@click.option("--port", type=int, default=None, help="Listen port (default spec.server.port).")
@click.option(
    "--engine",
    type=click.Choice(["auto", "vllm", "transformers"]),
    default=None,
    help="Inference engine (default spec.server.engine).",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(min=1024),
    default=None,
    help="Largest request body; more is answered 413 (default $GRPO_SERVER_MAX_BODY_BYTES or 32 MiB).",
)
@click.option(
    "--allow-client-chat-templates/--no-allow-client-chat-templates",
    default=None,
    help="Run chat templates sent in requests (Jinja in the server; default off, or "
    "$GRPO_SERVER_ALLOW_CHAT_TEMPLATES=1).",
)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
def serve(
    config_path: Path | None,
    host: str | None,
    port: int | None,
    engine: str | None,
    max_body_bytes: int | None,
    allow_client_chat_templates: bool | None,
    log_level: str,
) -> None:
    """Serve the run's base model and LoRA adapters over HTTP (native + OpenAI-compatible)."""
    import uvicorn

    from grpo_server.app import HealthPathTaken, create_app
    from grpo_server.service import GenerationService
    from grpo_server.settings import GRACEFUL_SHUTDOWN_SECONDS, HTTP_HEAD_BUFFER_BYTES, settings_from_config

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_config(
            load_run_config(config_path),
            host=host,
            port=port,
            engine=engine,
            max_body_bytes=max_body_bytes,
            allow_chat_templates=allow_client_chat_templates,
        )
        service = GenerationService(settings)
    except (RunConfigError, ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    if settings.token is None:
        if settings.server.authenticate_generation:
            raise click.ClickException(
                "server.authenticateGeneration is set but no token is configured ($GRPO_TOKEN or tokenFile)"
            )
        log.warning("no token configured: adapter loads and other mutating endpoints will answer 401")
    try:
        app = create_app(service)
    except HealthPathTaken as exc:
        log.error("%s", exc)
        with contextlib.suppress(OSError):
            write_termination_message(clip_final_message(f"the server cannot run: {exc}"))
        sys.exit(EXIT_INVALID_SPEC)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
            timeout_keep_alive=SERVER_KEEP_ALIVE_SECONDS,
            lifespan="on",
            h11_max_incomplete_event_size=HTTP_HEAD_BUFFER_BYTES,
        )
    )

    def stop_on_fatal() -> None:
        server.should_exit = True

    service.on_fatal = stop_on_fatal
    log.info(
        "serving %s from %s with the %s engine on %s:%d (boot_id %s)",
        settings.served_model_name, settings.model_dir, service.engine_kind, settings.host, settings.port,
        service.boot_id,
    )
    server.run()
    if service.load_error:
        log.error("engine failed to start: %s", service.load_error)
        if service.load_error_permanent:
            # The executors fail the run at once on this code (InvalidSpec), in these words.
            with contextlib.suppress(OSError):
                write_termination_message(clip_final_message(f"the server cannot run: {service.load_error}"))
            sys.exit(EXIT_INVALID_SPEC)
        sys.exit(1)
