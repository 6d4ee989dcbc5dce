"""The seed's Londiste 2 words: `provider install|add|remove|tables|seqs` act on provider_db,
`subscriber install|add|remove|resync` on subscriber_db (db), `replay` is the worker.  They are
the same verbs as the Londiste 3 ones, invoked on the right database; only the two `install`s
and `provider tables` (names only, as Londiste 2 printed them) have bodies of their own."""

from __future__ import annotations

import click

from pgcascade.capture import tables as set_tables
from pgcascade.cascade import join
from pgcascade.cli import tables as table_verbs
from pgcascade.cli.context import Context, pass_ctx
from pgcascade.cli.daemons import worker
from pgcascade.pgq.node import NodeType


@click.group("provider")
@pass_ctx
def provider_group(ctx: Context) -> None:
    """Londiste 2 provider commands: they act on provider_db."""
    ctx.use_provider_db()


@provider_group.command("install")
@pass_ctx
def provider_install(ctx: Context) -> None:
    """Make provider_db the root of the set (node "provider")."""
    with ctx.connect() as conn:
        created = join.create_root(conn, ctx.queue(), "provider", ctx.db())
    click.echo(f"provider of {ctx.queue()}: {'installed' if created else 'installed already'}")


@provider_group.command("add")
@click.argument("tables", nargs=-1, required=True)
@click.option("--format", "event_format", default="json", show_default=True, help="json or sql.")
@click.pass_context
def provider_add(cctx: click.Context, tables: tuple[str, ...], event_format: str) -> None:
    """Capture changes of TABLES on the provider."""
    cctx.invoke(table_verbs.add_table, tables=tables, event_format=event_format)


@provider_group.command("remove")
@click.argument("tables", nargs=-1, required=True)
@click.pass_context
def provider_remove(cctx: click.Context, tables: tuple[str, ...]) -> None:
    """Stop capturing TABLES (the tables and their rows stay)."""
    cctx.invoke(table_verbs.remove_table, tables=tables)


@provider_group.command("tables")
@pass_ctx
def provider_tables(ctx: Context) -> None:
    """List the tables the provider captures."""
    with ctx.this_node() as (conn, _):
        for t in set_tables.set_tables(conn, ctx.queue()):
            click.echo(t)


@provider_group.command("seqs")
@click.pass_context
def provider_seqs(cctx: click.Context) -> None:
    """List the sequences the provider replicates."""
    cctx.invoke(table_verbs.seqs_cmd)


@click.group("subscriber")
def subscriber_group() -> None:
    """Londiste 2 subscriber commands: they act on subscriber_db."""


@subscriber_group.command("install")
@pass_ctx
def subscriber_install(ctx: Context) -> None:
    """Make subscriber_db a leaf of the set fed by provider_db (node named after job_name)."""
    name = ctx.cfg.job_name
    with ctx.connect() as conn:
        created = join.create_subscriber(conn, ctx.queue(), name, NodeType.LEAF, ctx.db(), ctx.provider_db())
    click.echo(f"subscriber {name} of {ctx.queue()}: {'installed' if created else 'installed already'}")


@subscriber_group.command("add")
@click.argument("tables", nargs=-1, required=True)
@click.option("--expect-sync", is_flag=True, help="The table is in sync already; skip the copy.")
@click.option("--skip-truncate", is_flag=True, help="Keep the rows already there when copying.")
@click.option("--force", is_flag=True, help="Skip the structure check.")
@click.option("--create", is_flag=True, help="Create the table from the provider's definition.")
@click.pass_context
def subscriber_add(cctx: click.Context, tables: tuple[str, ...], **opts: bool) -> None:
    """Replicate TABLES (the provider captures them already) into subscriber_db."""
    cctx.invoke(table_verbs.add_table, tables=tables, **opts)


@subscriber_group.command("remove")
@click.argument("tables", nargs=-1, required=True)
@click.pass_context
def subscriber_remove(cctx: click.Context, tables: tuple[str, ...]) -> None:
    """Stop replicating TABLES (the tables and their rows stay)."""
    cctx.invoke(table_verbs.remove_table, tables=tables)


@subscriber_group.command("resync")
@click.argument("tables", nargs=-1, required=True)
@click.pass_context
def subscriber_resync(cctx: click.Context, tables: tuple[str, ...]) -> None:
    """Copy TABLES again."""
    cctx.invoke(table_verbs.resync, tables=tables)


COMMANDS = [provider_group, subscriber_group]
ALIASES = {"replay": worker}
