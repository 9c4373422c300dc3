"""`grpo train`: run one trainer attempt (the trainer image's entrypoint); `grpo prepare`: the run's initializer;
`grpo export`: the run's export step."""

from __future__ import annotations

import sys
from pathlib import Path

import click

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

    Resumes from the latest complete checkpoint when one exists. When the run cannot continue, the reason
    goes to stderr and the termination log. Exit code 0: done; 1: failed (the next attempt may succeed);
    2: a configuration problem no retry fixes (fix the GRPORun). With $GRPO_PARENT_PID set (`grpo run` sets
    it), the trainer ends when that process does.
    """
    from grpo_trainer.errors import TrainingFailed
    from grpo_trainer.launch import die_with_parent

    try:
        die_with_parent()  # first: no process of an attempt outlives the one that started it
    except TrainingFailed as exc:
        print(f"grpo train: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    from grpo_trainer.runner import run_train

    sys.exit(run_train(config_path))


@click.command("prepare")
@config_option
def prepare(config_path: Path | None) -> None:
    """Fetch and check the run's sources once, before any server or trainer starts.

    Writes inline reward modules, downloads hf:// sources (resumably), then checks the model's
    tokenizer, the dataset and the reward functions as the trainer will load them. Progress and the
    result are JSON lines on stdout ({"grpoPrepare": "progress"|"done"|"failed", "message": ...}).
    Exit code 0: ready; 1: transient (retry resumes); 2: permanent (fix the GRPORun).
    """
    from grpo_trainer.prepare.main import run_prepare

    sys.exit(run_prepare(config_path))


@click.command("export")
@config_option
def export(config_path: Path | None) -> None:
    """Upload the run's result to spec.output once its trainer is done (the run's export step).

    Takes the newest adapter version on the run's volume (checked against its manifest), merges it into
    the base model for form merged, uploads it, and prints (and leaves as its termination message) one
    result line: where it went, its digest and size. Exit code 0: exported; 1: transient (a retry may
    succeed); 2: permanent (fix the GRPORun or the destination). Nothing on the volume is deleted.
    """
    from grpo_trainer.export.main import run_export

    sys.exit(run_export(config_path))
