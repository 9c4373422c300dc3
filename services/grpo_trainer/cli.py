"""`grpo train`: run one trainer attempt (the trainer image's entrypoint); `grpo prepare`: the run's initializer."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from grpo_api.runconfig import RunConfigError, load_run_config
from grpo_trainer.errors import TrainingFailed

config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Run-config file, or a GRPORun file (default: $GRPO_RUN_CONFIG).",
)


@click.command("train")
@config_option
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


@click.command("prepare")
@config_option
def prepare(config_path: Path | None) -> None:
    """Fetch and check the run's sources once, before any server or trainer starts.

    Writes inline reward modules, downloads hf:// sources (resumably), then checks the model's
    tokenizer, the dataset and the reward functions as the trainer will load them. Progress and the
    result are JSON lines on stdout ({"grpoPrepare": "progress"|"done"|"failed", "message": ...}).
    Exit code 0: ready; 1: transient (retry resumes); 2: permanent (fix the GRPORun).
    """
    from grpo_trainer.prepare import run_prepare

    sys.exit(run_prepare(config_path))
