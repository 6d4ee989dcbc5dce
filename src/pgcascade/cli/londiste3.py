"""Moving a Londiste 3 set to pgcascade: import-londiste, then drop-londiste (cascade/londiste.py
does the work)."""

from __future__ import annotations

import configparser
import socket
from pathlib import Path

import click

from pgcascade.cascade import londiste, londiste_back
from pgcascade.cli.context import Context, note_secrets, pass_ctx, say
from pgcascade.core import schema
from pgcascade.core.daemon import pid_alive
from pgcascade.core.errors import UserError
from pgcascade.core.pgconn import scalar
from pgcascade.pgq.node import NodeType

SERVICE_SECTIONS = ("londiste", "londiste3")  # Londiste 3.8's service name, and earlier 3.x's


def read_job(path: Path) -> dict[str, str]:
    """A Londiste 3 job's ini read as Skytools reads it (skytools.Config): its service section,
    with job_name (the file's name without extension), service_name (the section), host_name,
    config_dir and config_file as defaults that `%(name)s` may use (`${name}` with
    config_format = 2); file names get `~` expanded where they are used."""
    raw = configparser.RawConfigParser()
    try:
        if not raw.read(path):
            raise UserError(f"{path}: cannot read the Londiste job file")
    except configparser.Error as e:
        raise UserError(f"{path}: {str(e).splitlines()[0]}") from None
    section = next((s for s in SERVICE_SECTIONS if raw.has_section(s)), None) or next(
        iter(raw.sections()), None
    )
    if section is None:
        raise UserError(f"{path}: no section (a Londiste 3 job file has one, [londiste])")
    version = raw.get(section, "config_format", fallback="1")
    if version not in ("1", "2"):
        raise UserError(f"{path}: config_format = {version}: Skytools reads 1 or 2")
    interpolation = (
        configparser.BasicInterpolation() if version == "1" else configparser.ExtendedInterpolation()
    )
    parser = configparser.ConfigParser(interpolation=interpolation)
    parser.read(path)
    defaults = {
        "job_name": path.stem,
        "service_name": section,
        "host_name": socket.gethostname(),
        "config_dir": str(path.parent),
        "config_file": str(path),
    }
    for key, value in defaults.items():
        if not parser.has_option(section, key):
            parser.set(section, key, value.replace("%", "%%") if version == "1" else value.replace("$", "$$"))
    try:
        job = dict(parser[section].items())
    except configparser.Error as e:
        raise UserError(f"{path}: {' '.join(str(e).split())}") from None
    for key in ("db", "queue_name"):
        if not job.get(key):
            raise UserError(f"{path}: {key} is not set")
    return job


def check_worker_stopped(job: dict[str, str], ini: Path) -> None:
    """Londiste's worker must not run while its node is imported: its pidfile (as Skytools
    finds it) must name no live process.  Said, never skipped, when it cannot be checked."""
    pidfile = job.get("pidfile")
    if not pidfile:
        say(f"{ini} sets no pidfile: make sure the Londiste worker {job['job_name']} is stopped")
        return
    path = Path(pidfile).expanduser()
    try:
        text = path.read_text()
    except FileNotFoundError:
        say(f"no pidfile {path}: the Londiste worker {job['job_name']} is not running on this host")
        return
    except OSError as e:
        raise UserError(
            f"cannot read the Londiste worker's pidfile {path} ({e.strerror}): run as its user, or stop it and"
            " remove the pidfile"
        ) from None
    pid = int(text.strip()) if text.strip().isdigit() else None
    if pid is not None and pid_alive(pid):
        raise UserError(f"the Londiste worker {job['job_name']} runs (pid {pid}, {path}): stop it first")
    say(f"pidfile {path} names no running process: the Londiste worker {job['job_name']} is stopped")


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
    if not dry_run:
        check_worker_stopped(job, londiste_ini)
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


@click.command("back-to-londiste")
@pass_ctx
def back_to_londiste(ctx: Context) -> None:
    """The way back after import-londiste: on the root, each subscriber (leaves first), the root again."""
    with ctx.connect() as conn:
        click.echo(londiste_back.back(conn, ctx.queue(), say))


COMMANDS = [import_londiste, drop_londiste, back_to_londiste]
