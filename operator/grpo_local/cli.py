"""`grpo run -f FILE`: run a GRPORun on this machine, with the operator's lifecycle."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import click
from rich.console import Console
from rich.live import Live

from grpo_api.models import TERMINAL_PHASES, Mode, Phase
from grpo_api.runconfig import RunConfigError, load_grporun
from grpo_local.runner import LocalRun, free_port
from grpo_local.view import LiveView, write_summary


class Stop(Exception):
    """SIGINT or SIGTERM arrived: end every child and exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise Stop(signum)


def check_paths(run: LocalRun) -> None:
    """Refuse, before anything starts, a model or dataset path that does not exist and settings only a
    cluster can honour (naming the field). hf:// sources are fetched by the initializer process."""
    try:
        cfg = run.config
    except RunConfigError as exc:
        raise click.ClickException(f"{run.run_file}: {exc}") from exc
    spec = run.run.spec
    for section, env in (("server", spec.effective_server.env), ("trainer", spec.trainer.env)):
        for index, var in enumerate(env):
            if var.value_from is not None:
                raise click.ClickException(
                    f"{run.run_file}: spec.{section}.env[{index}] ({var.name}) reads valueFrom, which only a "
                    "cluster resolves: give a value, or export it before `grpo run` and leave it out"
                )
    if spec.model.source is None and spec.model.path is not None:
        model = cfg.resolve(spec.model.path)
        if not (model / "config.json").is_file():
            raise click.ClickException(
                f"{run.run_file}: spec.model.path: {model} is not a model directory (no config.json)"
            )
    if spec.dataset.source is None and not cfg.dataset_path().exists():
        raise click.ClickException(f"{run.run_file}: spec.dataset.path: {cfg.dataset_path()} not found")


@click.command()
@click.option("-f", "--filename", "run_file", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path), help="The GRPORun YAML file.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory playing the run's volume (default: .grpo/<run name> beside the file).")
@click.option("--port", type=int, default=None, help="Server port (default: a free port).")
@click.option(
    "--fresh", is_flag=True, help="Delete the run directory first (else an interrupted run resumes).",
)
@click.option("--live/--no-live", default=None, help="Live progress view (default: when stdout is a TTY).")
def run(run_file: Path, run_dir: Path | None, port: int | None, fresh: bool, live: bool | None) -> None:
    """Run a GRPORun file on this machine: a server process, then the trainer, as the operator would.

    A fresh server for every attempt, retries up to runPolicy.backoffLimit (the trainer resumes
    from its last checkpoint), serverReadyTimeoutSeconds and activeDeadlineSeconds as on a cluster.
    Logs, adapters, checkpoints, the summary and reward.png land in the run directory. Exit code 0
    means Succeeded.
    """
    try:
        grporun = load_grporun(run_file)
    except RunConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if grporun.spec.mode == Mode.COLOCATE:
        raise click.ClickException(f"{run_file}: spec.mode colocate needs a GPU and vLLM in one process: "
                                   "run `grpo train --config FILE` on a GPU machine instead")
    directory = (run_dir or run_file.resolve().parent / ".grpo" / grporun.metadata.name).resolve()
    local = LocalRun(run=grporun, run_file=run_file.resolve(), run_dir=directory, port=port or free_port())
    check_paths(local)
    status_file = directory / "status.json"
    if fresh and directory.exists():
        shutil.rmtree(directory)
    elif status_file.is_file():
        recorded = json.loads(status_file.read_text()).get("status", {}).get("phase")
        if recorded in {p.value for p in TERMINAL_PHASES}:
            raise click.ClickException(
                f"run {grporun.metadata.name} in {directory} already finished ({recorded}); "
                "pass --fresh to start over"
            )
    directory.mkdir(parents=True, exist_ok=True)

    console = Console()
    use_live = console.is_terminal if live is None else live
    view = LiveView(console, local)
    local.on_event = view.event
    console.print(f"[bold]grpo run[/] {grporun.metadata.name}: run directory {directory}")
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    code = 0
    try:
        if use_live:
            with Live(view.renderable(), console=console, refresh_per_second=4, transient=False) as screen:
                while not local.finished:
                    delay = local.step()
                    screen.update(view.renderable())
                    time.sleep(delay)
                local.step()  # act out the terminal cleanup once more
                screen.update(view.renderable())
        else:
            last = ""
            while not local.finished:
                delay = local.step()
                latest = local.samples[-1] if local.samples else None
                line = f"{local.status.phase} attempt={local.status.attempt}" + (
                    f" step={latest.step}/{latest.max_steps} reward={latest.reward_mean}" if latest else "")
                if line != last:
                    console.print(line)
                    last = line
                time.sleep(delay)
            local.step()
    except Stop as stop:
        console.print(f"[yellow]{stop}: stopping the trainer and the server[/]")
        code = 128 + stop.signum
    finally:
        local.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    write_summary(local, console, started)
    if code:
        sys.exit(code)
    if local.status.phase != Phase.SUCCEEDED:
        console.print(f"[bold red]{local.status.phase}[/]: {local.status.reason}: {local.status.message}")
        sys.exit(1)
