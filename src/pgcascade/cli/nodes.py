"""Verbs that make a database a node: install, create-root, create-branch, create-leaf."""

from __future__ import annotations

import click

from pgcascade.capture import logical
from pgcascade.capture import tables as set_tables
from pgcascade.cascade import join
from pgcascade.cli.context import Context, note_secrets, pass_ctx
from pgcascade.core import schema
from pgcascade.core.errors import UserError
from pgcascade.pgq.node import NodeType

NO_STORED_SECRETS = 12  # the schema version that took passwords out of stored locations


@click.command()
@click.option(
    "--pgq-compat",
    is_flag=True,
    help="Also create the pgq schema: PgQ 3's SQL API on pgcascade's queue (not where PgQ is installed).",
)
@pass_ctx
def install(ctx: Context, pgq_compat: bool) -> None:
    """Install or upgrade pgcascade's schema in the job's database."""
    with ctx.connect() as conn:
        before, after = schema.install(conn, pgq_compat=pgq_compat)
        compat = schema.pgq_schema_owner(conn) == "pgcascade"
    if before == after:
        click.echo(f"pgcascade schema is at version {after}; functions refreshed")
    else:
        click.echo(f"pgcascade schema upgraded from version {before} to {after}")
    if 0 < before < NO_STORED_SECRETS <= after:
        click.echo(
            "node locations no longer carry passwords: the daemons take them from ~/.pgpass, a service"
            ' file or PGPASSWORD on their host (docs/operations.md, "Security")'
        )
    if compat:
        click.echo("pgq compatibility schema installed (PgQ 3 API on pgcascade's queue)")


@click.command("create-root")
@click.argument("node_name")
@click.argument("location", required=False)
@click.option(
    "--capture",
    "capture_mode",
    type=click.Choice(["trigger", "logical"]),
    help="How changes are captured: trigger (default) or logical (a slot read by the capture daemon).",
)
@pass_ctx
def create_root(ctx: Context, node_name: str, location: str | None, capture_mode: str | None) -> None:
    """Make this database the root of the set: install, create the queue."""
    with ctx.connect() as conn:
        wanted = capture_mode == "logical"
        created = join.create_root(conn, ctx.queue(), node_name, location or ctx.db(), logical=wanted)
        is_logical = logical.is_logical(conn, ctx.queue())
        if not created and capture_mode == "logical":  # the root exists: a slot lost is made again
            created = set_tables.use_logical(conn, ctx.queue())
            is_logical = True
        elif not created and capture_mode == "trigger" and is_logical:
            raise UserError(f"root of {ctx.queue()} captures through a slot already (logical)")
    mode = "logical: run the capture daemon" if is_logical else "trigger"
    click.echo(
        f"root {node_name} of {ctx.queue()}: {'created' if created else 'exists already'} (capture {mode})"
    )
    note_secrets({"location": location} if location else {"db (the node's location)": ctx.db()})


def create_subscriber(
    ctx: Context,
    node_type: NodeType,
    node_name: str,
    location: str | None,
    provider: str,
    merge: str | None = None,
) -> bool:
    with ctx.connect() as conn:
        loc = location or ctx.db()
        created = join.create_subscriber(conn, ctx.queue(), node_name, node_type, loc, provider, merge)
        if created and not join.announce_at_root(conn, ctx.queue(), node_name, loc):
            click.echo("the root is unreachable: other nodes learn this node's location later", err=True)
    note_secrets(
        {
            "--provider": provider,
            **({"location": location} if location else {"db (the node's location)": ctx.db()}),
        }
    )
    return created


# Londiste's --sync-watermark makes the listed nodes hold the provider's history until the
# slowest of them has it (pgq_node leaves do not hold it otherwise). Here every subscriber,
# leaves included, reports its watermark up the set, so the option always holds: accepted so
# Londiste command lines run unchanged, its node list checked.
SYNC_WATERMARK = click.option(
    "--sync-watermark",
    metavar="NODES",
    help="Londiste's: keep the provider's events until these nodes have them (always so here).",
)


def sync_watermark_nodes(value: str | None) -> list[str]:
    if value is None:
        return []
    names = [n.strip() for n in value.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise UserError(f"--sync-watermark {value!r}: give node names separated by commas, each once")
    return names


def echo_synced(names: list[str]) -> None:
    if names:
        click.echo(
            f"the provider keeps its events until every subscriber has them ({', '.join(names)} included)"
        )


@click.command("create-branch")
@click.argument("node_name")
@click.argument("location", required=False)
@click.option("--provider", "provider", required=True, help="Connection string of the provider node.")
@SYNC_WATERMARK
@pass_ctx
def create_branch(
    ctx: Context, node_name: str, location: str | None, provider: str, sync_watermark: str | None
) -> None:
    """Make this database a branch: it replays and carries the provider's queue."""
    synced = sync_watermark_nodes(sync_watermark)
    created = create_subscriber(ctx, NodeType.BRANCH, node_name, location, provider)
    click.echo(f"branch {node_name} of {ctx.queue()}: {'created' if created else 'exists already'}")
    echo_synced(synced)


@click.command("create-leaf")
@click.argument("node_name")
@click.argument("location", required=False)
@click.option("--provider", "provider", required=True, help="Connection string of the provider node.")
@click.option(
    "--merge", help="A merge-leaf: also write the changes into this combined queue (a set rooted here)."
)
@SYNC_WATERMARK
@pass_ctx
def create_leaf(
    ctx: Context,
    node_name: str,
    location: str | None,
    provider: str,
    merge: str | None,
    sync_watermark: str | None,
) -> None:
    """Make this database a leaf of the set, fed by the provider."""
    synced = sync_watermark_nodes(sync_watermark)
    created = create_subscriber(ctx, NodeType.LEAF, node_name, location, provider, merge)
    click.echo(f"leaf {node_name} of {ctx.queue()}: {'created' if created else 'exists already'}")
    echo_synced(synced)


COMMANDS = [install, create_root, create_branch, create_leaf]
