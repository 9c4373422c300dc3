"""`grpo make-model` and `grpo make-dataset`."""

from __future__ import annotations

from pathlib import Path

import click

from grpo_testmodels.presets import PRESETS

_PRESET_HELP = "\n\n".join(f"{name}: {p.description}" for name, p in PRESETS.items())
_MAKE_MODEL_HELP = f"""Write a random-weight Qwen2 test model to OUT.

The tokenizer is a byte-level BPE trained on this machine's Python standard library
(no model hub). Same preset and seed give byte-identical files.

{_PRESET_HELP}
"""


@click.command("make-model", help=_MAKE_MODEL_HELP)
@click.option(
    "--preset",
    type=click.Choice(list(PRESETS)),
    default="tiny",
    show_default=True,
    help="Model shape (see above).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Weight seed; same seed, same files.")
@click.option("--force", is_flag=True, help="Replace the model files in a non-empty OUT.")
@click.argument("out", type=click.Path(path_type=Path, file_okay=False))
def make_model(preset: str, seed: int, force: bool, out: Path) -> None:
    from grpo_testmodels.model import make_model as build

    if out.is_dir() and any(out.iterdir()) and not force:
        raise click.ClickException(f"{out} is not empty: pass --force to replace the model files in it")
    build(out, preset=preset, seed=seed, overwrite=force)
    click.echo(f"wrote {preset} model (seed {seed}) to {out}")


@click.command("make-dataset", help="Write a toy prompt dataset (jsonl) drawn from a test model's vocabulary.")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="Model directory written by `grpo make-model`.",
)
@click.option(
    "--prompts",
    "n_prompts",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Number of rows.",
)
@click.option("--seed", type=int, default=1234, show_default=True, help="Prompt sampling seed.")
@click.option("--conversational", is_flag=True, help='Rows as [{"role": "user", "content": ...}] prompts.')
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
def make_dataset(model_dir: Path, n_prompts: int, seed: int, conversational: bool, out: Path) -> None:
    from grpo_testmodels.dataset import make_dataset as build

    build(out, model_dir, n_prompts=n_prompts, seed=seed, conversational=conversational)
    click.echo(f"wrote {n_prompts} prompts to {out}")
