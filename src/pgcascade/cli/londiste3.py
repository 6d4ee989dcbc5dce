"""Moving a Londiste 3 set to pgcascade: import-londiste, then drop-londiste (cascade/londiste.py
does the work)."""

from __future__ import annotations

import configparser
from pathlib import Path

import click

from pgcascade.cascade import londiste
from pgcascade.cli.context import Context, note_secrets, pass_ctx, say
from pgcascade.core import schema
from pgcascade.core.daemon import pid_alive, read_pid
from pgcascade.core.errors import UserError
from pgcascade.core.pgconn import scalar
from pgcascade.pgq.node import NodeType


def read_job(path: Path) -> dict[str, str]:
    """A Londiste 3 job's ini: its one section ([londiste], the service name)."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        if not parser.read(path):
            raise UserError(f"{path}: cannot read the Londiste job file")
    except configparser.Error as e:
        raise UserError(f"{path}: {str(e).splitlines()[0]}") from None
    if not parser.sections():
        raise UserError(f"{path}: no section (a Londiste 3 job file has one, [londiste])")
    job = dict(parser[parser.sections()[0]])
    for key in ("job_name", "db", "queue_name"):
        if not job.get(key):
            raise UserError(f"{path}: {key} is not set")
    return job


@click.command("import-londiste")
@click.argument("londiste_ini", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing.")
@pass_ctx
def import_londiste(ctx: Context, londiste_ini: Path, dry_run: bool) -> None:
    """Make this Londiste 3 node the pgcascade node of the same name, without copying again
    (root first, then each subscriber; docs/migrating-from-londiste.md)."""
    job = read_job(londiste_ini)
    queue = ctx.queue()
    if job["queue_name"] != queue:
        raise UserError(f"{londiste_ini} is for queue {job['queue_name']}, this config for {queue}")
    pidfile = job.get("pidfile")
    pid = read_pid(Path(pidfile)) if pidfile else None
    if pid is not None and pid_alive(pid) and not dry_run:
        raise UserError(f"the Londiste worker {job['job_name']} runs (pid {pid}, {pidfile}): stop it first")
    with ctx.connect() as conn, ctx.connect(connstr=job["db"]) as ldb:
        same = "select system_identifier::text || '/' || current_database() from pg_control_system()"
        if scalar(conn, same) != scalar(ldb, same):
            raise UserError(f"{londiste_ini}'s db and this config's db are not the same database")
        node = londiste.read_node(conn, queue)
        target = (
            "capture moves to pgcascade; a last PgQ tick ends Londiste's queue"
            if node.node_type is NodeType.ROOT
            else "continues from the provider's first pgcascade tick"
        )
        if dry_run:
            for line in londiste.plan(node, target):
                click.echo(line)
            return
        if node.node_type is NodeType.ROOT:
            click.echo(londiste.import_root(conn, node, say))
        else:
            click.echo(londiste.import_subscriber(conn, node, say))
    note_secrets({f"{name}'s location": location for name, (location, _) in node.locations.items()})


@click.command("drop-londiste")
@click.option(
    "--force", is_flag=True, help="Drop PgQ even while some of its consumers have events left to read."
)
@click.option(
    "--pgq-compat", is_flag=True, help="Then create the pgq compatibility schema (PgQ's API on pgcascade)."
)
@pass_ctx
def drop_londiste(ctx: Context, force: bool, pgq_compat: bool) -> None:
    """Drop Londiste 3 and PgQ (the londiste, pgq_node and pgq extensions) from this imported node."""
    with ctx.connect() as conn:
        dropped = londiste.drop_londiste(conn, ctx.queue(), force)
        if pgq_compat:
            schema.install(conn, pgq_compat=True)
    click.echo(f"dropped {', '.join(dropped)}" if dropped else "no Londiste or PgQ here")
    if pgq_compat:
        click.echo("pgq compatibility schema installed (PgQ 3 API on pgcascade's queue)")


COMMANDS = [import_londiste, drop_londiste]
