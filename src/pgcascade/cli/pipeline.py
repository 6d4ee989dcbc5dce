"""The Spark pipeline's verbs: compare, repair, recover-slot, spark-server, sink.  The work is in
pgcascade.pipeline; Spark itself is imported only when a verb needs it."""

from __future__ import annotations

import dataclasses
import sys

import click

from pgcascade.cli.context import Context, control_or_start, daemon_switches, pass_ctx
from pgcascade.core.errors import UserError
from pgcascade.pipeline import commands, connect
from pgcascade.pipeline.sink import Sink


@click.command()
@click.argument("tables", nargs=-1)
@click.option("--count-only", is_flag=True, help="Compare row counts only (the seed's cheap check).")
@click.option("--no-progress", is_flag=True, help="No progress lines on stderr.")
@click.option("--json", "as_json", is_flag=True, help="The result as JSON (docs/monitoring.md).")
@pass_ctx
def compare(
    ctx: Context, tables: tuple[str, ...], count_only: bool, no_progress: bool, as_json: bool
) -> None:
    """Compare TABLES (default: all) with the provider at a sync point; exit 3 when they differ."""
    ctx.db()
    sys.exit(commands.compare(ctx.cfg, list(tables), count_only, not no_progress, as_json))


@click.command()
@click.argument("tables", nargs=-1)
@click.option("--output", "-o", help="Write the fixing SQL to this file ('-' for stdout).")
@click.option("--apply", "apply_fix", is_flag=True, help="Apply the fix in one transaction.")
@click.option("--no-progress", is_flag=True, help="No progress lines on stderr.")
@pass_ctx
def repair(
    ctx: Context, tables: tuple[str, ...], output: str | None, apply_fix: bool, no_progress: bool
) -> None:
    """Make TABLES (default: all) equal to the provider's: SQL to --output and/or --apply."""
    if not output and not apply_fix:
        raise UserError("repair needs --output FILE (write the fix) or --apply (apply it), or both")
    ctx.db()
    sys.exit(commands.repair(ctx.cfg, list(tables), output, apply_fix, not no_progress))


@click.command("recover-slot")
@click.option("--no-progress", is_flag=True, help="No progress lines on stderr.")
@pass_ctx
def recover_slot(ctx: Context, no_progress: bool) -> None:
    """A root whose capture slot was lost: a new slot, and what was lost repaired on every node."""
    ctx.db()
    sys.exit(commands.recover_slot(ctx.cfg, not no_progress))


@click.command("spark-server")
@click.argument("action", type=click.Choice(["start", "stop"]))
@pass_ctx
def spark_server(ctx: Context, action: str) -> None:
    """Start or stop a warm Spark (Spark Connect) that configs with spark_remote attach to."""
    if action == "start":
        click.echo(f"Spark Connect listening at {connect.start(ctx.cfg)}")
    else:
        connect.stop(ctx.cfg)
        click.echo("Spark Connect stopped")


@click.command()
@click.argument("action", required=False, type=click.Choice(["compact"]))
@click.option("--path", "path", help="The lake directory (default: sink_path of the config).")
@daemon_switches
@pass_ctx
def sink(ctx: Context, action: str | None, path: str | None, detach: bool, ctl: str | None) -> None:
    """Write every batch's row changes as Parquet under --path; `sink compact`: current state."""
    if path:
        pipeline = dataclasses.replace(ctx.cfg.pipeline, sink_path=path)
        ctx.cfg = ctx.cfg.with_changes(pipeline=pipeline)
    if action == "compact":
        commands.compact(ctx.cfg)
        return
    control_or_start(ctx, Sink, detach, ctl)


COMMANDS = [compare, repair, spark_server, sink, recover_slot]
