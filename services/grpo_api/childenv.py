"""The environment every child of a run gets (server, trainer, initializer), in one place for both
executors: the operator writes it into pod specs, the local runner into process environments.

The spec's own `env` of the container comes after these in both, so a user may override ours on purpose.
"""

from __future__ import annotations

from grpo_api.protocol import ENV_ATTEMPT, ENV_RUN_CONFIG, ENV_SERVER_URL, ENV_TOKEN_FILE


def child_environment(
    *,
    run_config: str,
    attempt: int,
    token_file: str | None = None,
    server_url: str | None = None,
    model_cache: str | None = None,
) -> list[tuple[str, str]]:
    """(name, value) in order: where the run-config is, the attempt, the server's token file and address
    (server mode, for the children that talk to or are the server) and the Hugging Face cache."""
    env = [(ENV_RUN_CONFIG, run_config), (ENV_ATTEMPT, str(attempt))]
    if token_file is not None:
        env.append((ENV_TOKEN_FILE, token_file))
    if server_url is not None:
        env.append((ENV_SERVER_URL, server_url))
    if model_cache is not None:
        env.append(("HF_HOME", model_cache))
    return env
