"""`grpo`: one console script, subcommands loaded lazily.

Each image installs only its own extra, so a subcommand's module (and its heavy
imports: torch, vllm, kopf) is imported only when that subcommand runs.
"""

from __future__ import annotations

import importlib
import sys

import click

#: subcommand -> (import path of its click command, extra that provides it, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("grpo_local.cli:run", "local", "Run a GRPORun file on this machine (server + trainer processes)."),
    "serve": ("grpo_server.cli:serve", "server", "Start the generation server (FastAPI + vLLM or transformers)."),
    "train": ("grpo_trainer.cli:train", "trainer", "Run the GRPO trainer of one attempt."),
    "prepare": (
        "grpo_trainer.cli:prepare",
        "trainer",
        "Fetch the run's hf:// sources and check model, dataset and rewards (the run's initializer).",
    ),
    "export": (
        "grpo_trainer.cli:export",
        "trainer",
        "Upload the run's result (adapter or merged model) to spec.output (the run's export step).",
    ),
    "operator": ("grpo_operator.cli:operator", "operator", "Run the Kubernetes operator (kopf)."),
    "stage": (
        "grpo_stage.cli:stage",
        "cli",
        "Copy local files (model, dataset, reward code) onto a PersistentVolumeClaim through the Kubernetes API.",
    ),
    "get": ("grpo_cli.cluster.commands:get", "cli", "List GRPORuns: phase, step, reward, adapter, attempt, age."),
    "status": (
        "grpo_cli.cluster.commands:status",
        "cli",
        "Show a GRPORun: phase, step, reward, adapter version, staleness, conditions, latest events.",
    ),
    "logs": ("grpo_cli.cluster.commands:logs", "cli", "Print (-f: follow) a run's trainer, server or initializer log."),
    "wait": (
        "grpo_cli.cluster.commands:wait",
        "cli",
        "Wait for a run's phase or condition (default Succeeded); the exit code says how it ended.",
    ),
    "pull": (
        "grpo_cli.cluster.commands:pull_command",
        "cli",
        "Copy a run's final adapter from its claim to a local directory, every file checked against its manifest.",
    ),
    "suspend": ("grpo_cli.cluster.commands:suspend", "cli", "Suspend a run (spec.runPolicy.suspend: true)."),
    "resume": ("grpo_cli.cluster.commands:resume", "cli", "Resume a suspended run (spec.runPolicy.suspend: false)."),
    "cancel": ("grpo_cli.cluster.commands:cancel", "cli", "Cancel a run: delete it (after confirmation, or --yes)."),
    "crd": ("grpo_cli.crd:crd", "", "Write or check the GRPORun CRD generated from the API models."),
    "make-model": (
        "grpo_testmodels.cli:make_model",
        "trainer",
        "Write a random-weight Qwen2 test model with a locally trained tokenizer.",
    ),
    "make-dataset": (
        "grpo_testmodels.cli:make_dataset",
        "trainer",
        "Write a toy prompt dataset (jsonl) for a test model.",
    ),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        target, extra, help_text = COMMANDS[cmd_name]
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if ctx.resilient_parsing or ("--help" in sys.argv and cmd_name not in sys.argv):
                return click.Command(cmd_name, help=help_text)
            hint = f" (install the '{extra}' extra: pip install 'grpo-operator[{extra}]')" if extra else ""
            raise click.ClickException(f"grpo {cmd_name} is not available: {exc}{hint}") from exc
        command = getattr(module, attr)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_text) for name, (_, _, help_text) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="grpo-operator")
def cli() -> None:
    """grpo-operator: GRPO post-training of LLMs as one declarative GRPORun object.

    On a cluster the operator reconciles GRPORuns; on one machine `grpo run -f FILE`
    runs the same object as local processes.
    """


def main() -> None:
    cli()


def kubectl_plugin() -> None:
    """`kubectl grpo ...`: kubectl runs `kubectl-grpo` from PATH with the arguments after `grpo`."""
    cli(prog_name="kubectl grpo")


if __name__ == "__main__":
    main()
