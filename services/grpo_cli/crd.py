"""`grpo crd`: write the CRD generated from the models, or check the checked-in copy."""

from __future__ import annotations

import difflib
from pathlib import Path

import click

from grpo_api.crd import CRD_FILE, render_crd


@click.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=f"Write the CRD here (default: stdout). The repository's copy is {CRD_FILE}.")
@click.option("--check", "check_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Fail (exit 1, with a diff) if this file differs from the generated CRD.")
def crd(output: Path | None, check_path: Path | None) -> None:
    """Write or check the GRPORun CRD generated from the API models."""
    rendered = render_crd()
    if check_path is not None:
        current = check_path.read_text() if check_path.is_file() else ""
        if current != rendered:
            diff = difflib.unified_diff(
                current.splitlines(keepends=True), rendered.splitlines(keepends=True),
                fromfile=str(check_path), tofile="generated",
            )
            click.echo("".join(diff), err=True)
            raise click.ClickException(
                f"{check_path} is out of date with the models in services/grpo_api/spec/; regenerate it with "
                f"`grpo crd -o {check_path}`"
            )
        click.echo(f"{check_path} matches the models")
        return
    if output is None:
        click.echo(rendered, nl=False)
    else:
        output.write_text(rendered)
        click.echo(f"wrote {output}", err=True)
