"""`pgcascade completion bash|zsh|fish`: the shell's completion script for the verbs and their
options.  Load it with `eval "$(pgcascade completion bash)"` (or save it where the shell reads
completions).  The config file comes first, as everywhere: `pgcascade job.ini add-<TAB>`."""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

COMPLETE_VAR = "_PGCASCADE_COMPLETE"


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
@click.pass_context
def completion(cctx: click.Context, shell: str) -> None:
    """Print the completion script of SHELL (bash, zsh or fish)."""
    root = cctx.find_root().command
    cls = get_completion_class(shell)
    assert cls is not None
    click.echo(cls(root, {}, "pgcascade", COMPLETE_VAR).source())


COMMANDS = [completion]
