"""The environment every child of a run gets (server, trainer, initializer), in one place for both
executors: the operator writes it into pod specs, the local runner into process environments.

The spec's own `env` of the container comes after these in both, so a user may override ours on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath

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


#: Where the trackers that write files keep them, under the run's volume root: `<root>/tracking/<run>/`.
TRACKING_FOLDER = "tracking"
#: transformers' TensorBoard callback writes its event files here (default: under the Trainer's output_dir).
ENV_TENSORBOARD_DIR = "TENSORBOARD_LOGGING_DIR"
#: W&B keeps its run folders (offline runs, and online ones until synced) in `$WANDB_DIR/wandb/`.
ENV_WANDB_DIR = "WANDB_DIR"
#: trackio keeps its local database here (default: under ~/.cache/huggingface).
ENV_TRACKIO_DIR = "TRACKIO_DIR"
_TRACKER_DIRS = {"tensorboard": (ENV_TENSORBOARD_DIR, "tensorboard"), "wandb": (ENV_WANDB_DIR, ""),
                 "trackio": (ENV_TRACKIO_DIR, "trackio")}
TRACKER_DIR_ENV: tuple[str, ...] = (ENV_TENSORBOARD_DIR, ENV_WANDB_DIR, ENV_TRACKIO_DIR)


def tracking_dir(volume_root: str, run_name: str) -> str:
    """The folder of the run's tracker files on its volume (the local runner's: in its run directory)."""
    return str(PurePosixPath(volume_root) / TRACKING_FOLDER / run_name)


def tracker_environment(report_to: Sequence[str], *, volume_root: str, run_name: str) -> list[tuple[str, str]]:
    """(name, value) of the folders the trackers of spec.trainer.reportTo that write files write into: on the
    run's volume, so they outlive the pod (a container's own files go with it). MLflow's client sends
    everything to its tracking server (MLFLOW_TRACKING_URI), so it gets none."""
    root = PurePosixPath(tracking_dir(volume_root, run_name))
    env = []
    for tracker in report_to:
        if str(tracker) in _TRACKER_DIRS:
            name, sub = _TRACKER_DIRS[str(tracker)]
            env.append((name, str(root / sub) if sub else str(root)))
    return env
