"""`grpo train`: run one trainer attempt (the trainer image's entrypoint)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from grpo_api.runconfig import RunConfigError, load_run_config
from grpo_trainer.errors import TrainingFailed


@click.command("train")
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Run-config file, or a GRPORun file (default: $GRPO_RUN_CONFIG).",
)
def train(config_path: Path | None) -> None:
    """Run the GRPO trainer of one attempt ($GRPO_ATTEMPT) against the run's server.

    Resumes from the latest complete checkpoint when one exists. Exits non-zero
    with the reason on stderr when the run cannot continue.
    """
    from grpo_trainer.runner import attempt_from_env, run_training

    try:
        cfg = load_run_config(config_path)
        run_training(cfg, attempt=attempt_from_env())
    except (RunConfigError, TrainingFailed) as exc:
        click.echo(f"grpo train: error: {exc}", err=True)
        sys.exit(1)
