"""Table and sequence verbs.  On the root they change what is captured (pgcascade.capture);
on a subscriber, what is replicated here (pgcascade.replica)."""

from __future__ import annotations

from pathlib import Path

import click
import psycopg

from pgcascade.capture import ddl
from pgcascade.capture import tables as set_tables
from pgcascade.cascade import admin, peers, waits
from pgcascade.cli.context import Context, echo_json, pass_ctx, require_subscriber, say
from pgcascade.core import catalog, privileges
from pgcascade.core.errors import UserError
from pgcascade.monitor import report
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import filters
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import tables as subscriber
from pgcascade.replica.conflicts import ConflictPolicy


def echo_each(verb: str, names: list[str]) -> None:
    for n in names:
        click.echo(f"{verb} {n}")


@click.command("add-table")
@click.argument("tables", nargs=-1)
@click.option(
    "--all", "all_tables", is_flag=True, help="Every table (root: of the database; leaf: of the set)."
)
@click.option("--key", help="Root: key columns of a table without a primary key (COL[,COL...]).")
@click.option(
    "--format",
    "event_format",
    default="json",
    show_default=True,
    help="Root: json or sql (the seed's partial SQL).",
)
@click.option(
    "--conflict", "policy", help="Two-way master: this table's conflict policy (default: the peer's)."
)
@click.option("--expect-sync", is_flag=True, help="Subscriber: the table is in sync already; skip the copy.")
@click.option("--skip-truncate", is_flag=True, help="Subscriber: keep the rows already there when copying.")
@click.option("--force", is_flag=True, help="Subscriber: skip the structure check.")
@click.option(
    "--create", is_flag=True, help="Subscriber: create a missing table from the provider's columns."
)
@click.option(
    "--create-full",
    is_flag=True,
    help="Subscriber: create a missing table with defaults, sequences, constraints, indexes, foreign keys.",
)
@click.option("--dest-table", help="Subscriber: apply to this local table instead.")
@click.option(
    "--allow-local-writes", is_flag=True, help="Subscriber: do not refuse writes of ordinary sessions."
)
@click.option("--copy-node", help="Subscriber: copy the rows from this root or branch, not the provider.")
@click.option(
    "--find-copy-node",
    is_flag=True,
    help="Subscriber: copy from the nearest node upstream that holds the table in sync.",
)
@click.option(
    "--merge-all", is_flag=True, help="Merge-leaf: add the tables for every partition merging into its queue."
)
@click.option("--where", "where", help="Leaf: hold only the rows for which this SQL predicate is true.")
@click.option("--columns", "columns", help="Leaf: apply, copy and compare only these columns (COL[,COL...]).")
@click.option("--wait-sync", is_flag=True, help="Subscriber: return once the tables are copied and in sync.")
@click.option("--no-wait", is_flag=True, help="Subscriber: do not wait for tables just added on the root.")
@click.option(
    "--timeout",
    default=600.0,
    show_default=True,
    help="Subscriber: seconds to wait for them (and --wait-sync).",
)
@pass_ctx
def add_table(
    ctx: Context,
    tables: tuple[str, ...],
    all_tables: bool,
    key: str | None,
    event_format: str,
    policy: str | None,
    find_copy_node: bool,
    merge_all: bool,
    wait_sync: bool,
    no_wait: bool,
    timeout: float,
    where: str | None,
    columns: str | None,
    **opts: object,
) -> None:
    """Replicate tables: on the root, capture them; on a subscriber, subscribe to them."""
    if not tables and not all_tables:
        raise UserError("add-table needs table names (or --all)")
    opts["subset"] = filters.Subset(where, filters.parse_columns(columns) if columns is not None else None)
    if find_copy_node:
        if opts["copy_node"]:
            raise UserError("--copy-node and --find-copy-node exclude each other")
        opts["copy_node"] = subscriber.FIND_COPY_NODE
    queue = ctx.queue()
    with ctx.this_node() as (conn, node):
        if node.role.captures_changes:
            if where is not None or columns is not None:
                raise UserError(
                    "--where/--columns are set on a leaf, for the rows it holds: the root captures whole rows"
                )
            keys = [k.strip() for k in key.split(",")] if key else None
            parsed = ConflictPolicy.parse(policy) if policy else None
            added = set_tables.add_tables(conn, queue, list(tables), all_tables, keys, event_format)
            sources = peers.tables_added(conn, queue, added)
            echo_each("added", added)
            for table, source in sources.items():
                click.echo(f"{table}: rows copied from master {source} by the worker")
            if parsed is not None:
                named = set_tables.set_tables(conn, queue)
                if not all_tables:
                    wanted = {catalog.canonical(conn, t) for t in tables}
                    named = {t: k for t, k in named.items() if t in wanted}
                peers.set_table_policy(conn, queue, list(named), parsed)
                echo_each(f"conflicts: {parsed} for", list(named))
            return
        if policy:
            raise UserError("--conflict is for a two-way master (add-peer)")
        if key or event_format != "json":
            raise UserError("--key and --format are set on the root, where tables are captured")
        if merge_all and not node.combined_queue:
            raise UserError("--merge-all is for a merge-leaf (create-leaf --merge)")
        privileges.require(conn, privileges.replica_role(conn))  # the copies apply with it
        parts = nodes.merged_partitions(conn, node) if merge_all else [node]
        for part in parts:
            with ctx.provider(conn, part) as prov:
                if not no_wait and tables:
                    waits.wait_provider_has_tables(conn, prov, part.queue_name, list(tables), say, timeout)
                added = subscriber.add_tables(
                    conn,
                    prov,
                    part.queue_name,
                    list(tables),
                    all_tables,
                    say=say,
                    **opts,  # type: ignore[arg-type]
                )
                if part.role.copies_events:
                    pass_seqs_on(conn, part.queue_name)
            if all_tables:
                nodes.take_all_tables(conn, part.queue_name)
            if part.combined_queue and added:
                admin.register_merged_tables(conn, part.combined_queue, part.queue_name, added)
            echo_each("added", added if part is node else [f"{t} ({part.queue_name})" for t in added])
        if wait_sync:
            for part in parts:
                with ctx.provider(conn, part) as prov:
                    waits.wait_sync(conn, prov, part, timeout)
            click.echo("in sync")


def pass_seqs_on(conn: psycopg.Connection, queue: str) -> None:
    """A branch passes on the values of the sequences it follows (its subscribers read them)."""
    set_tables.follow_seqs(conn, queue, [s for s, _ in subscriber_seqs.seqs(conn, queue)])


@click.command("remove-table")
@click.argument("tables", nargs=-1, required=True)
@pass_ctx
def remove_table(ctx: Context, tables: tuple[str, ...]) -> None:
    """Stop replicating tables (the tables and their rows stay)."""
    with ctx.this_node() as (conn, node):
        owner = set_tables if node.role.captures_changes else subscriber
        echo_each("removed", owner.remove_tables(conn, ctx.queue(), list(tables)))


@click.command("tables")
@click.option("--json", "as_json", is_flag=True, help="As JSON (docs/monitoring.md).")
@pass_ctx
def tables_cmd(ctx: Context, as_json: bool) -> None:
    """List the replicated tables (on a subscriber, with their state)."""
    with ctx.this_node() as (conn, node):
        if as_json:
            echo_json(report.tables_report(conn, node))
            return
        if node.role.captures_changes:
            # a two-way master: each table's state under each peer (ok, or copying from one)
            from_peers = {
                p.provider_node: {t.table_name: t.state for t in subscriber.tables(conn, p.queue_name)}
                for p in nodes.peers(conn, ctx.queue())
            }
            for t, keys in set_tables.set_tables(conn, ctx.queue()).items():
                states = ", ".join(f"from {peer}: {got.get(t, '-')}" for peer, got in from_peers.items())
                click.echo(f"{t}  key: {', '.join(keys)}" + (f"  ({states})" if states else ""))
            setting = ddl.setting(conn, ctx.queue())
            if setting:
                click.echo(f"auto-ddl: {setting.describe()}")
            return
        for st in subscriber.tables(conn, ctx.queue()):
            dest = f" -> {st.dest_table}" if st.dest_table != st.table_name else ""
            subset = f"  where {st.row_filter}" if st.row_filter else ""
            subset += f"  columns {', '.join(st.column_list)}" if st.column_list else ""
            click.echo(f"{st.table_name}{dest}  {st.state}{subset}")


@click.command("missing")
@pass_ctx
def missing(ctx: Context) -> None:
    """List the provider's tables this subscriber does not replicate."""
    with ctx.this_node() as (conn, node):
        require_subscriber(node, "missing")
        with ctx.provider(conn, node) as prov:
            for t in subscriber.missing_tables(conn, prov, ctx.queue()):
                click.echo(t)


@click.command("resync")
@click.argument("tables", nargs=-1, required=True)
@pass_ctx
def resync(ctx: Context, tables: tuple[str, ...]) -> None:
    """Copy tables again (their state goes back to NULL)."""
    with ctx.this_node() as (conn, node):
        require_subscriber(node, "resync")
        echo_each("resync", subscriber.resync_tables(conn, ctx.queue(), list(tables)))


@click.command("add-seq")
@click.argument("seqs", nargs=-1)
@click.option("--all", "all_seqs", is_flag=True, help="Every sequence.")
@click.option(
    "--no-wait", is_flag=True, help="Subscriber: do not wait for the provider to pass the sequences on."
)
@click.option("--timeout", default=600.0, show_default=True, help="Subscriber: seconds to wait for them.")
@pass_ctx
def add_seq(ctx: Context, seqs: tuple[str, ...], all_seqs: bool, no_wait: bool, timeout: float) -> None:
    """Replicate sequences: their values follow the root."""
    if not seqs and not all_seqs:
        raise UserError("add-seq needs sequence names (or --all)")
    queue = ctx.queue()
    with ctx.this_node() as (conn, node):
        if node.role.captures_changes:
            added = set_tables.add_seqs(conn, queue, list(seqs), all_seqs)
            for seq, residue in peers.spread_sequences(conn, queue, added).items():
                click.echo(
                    f"{seq}: this master's values are {residue} modulo {peers.SEQUENCE_STEP} (two-way)"
                )
        else:
            with ctx.provider(conn, node) as prov:
                if not no_wait and seqs:
                    waits.wait_provider_has_seqs(conn, prov, queue, list(seqs), say, timeout)
                with conn.transaction():
                    added = subscriber_seqs.add_seqs(conn, prov, queue, list(seqs), all_seqs)
                    if node.role.copies_events:
                        pass_seqs_on(conn, queue)
    echo_each("added", added)


@click.command("remove-seq")
@click.argument("seqs", nargs=-1, required=True)
@pass_ctx
def remove_seq(ctx: Context, seqs: tuple[str, ...]) -> None:
    """Stop replicating sequences."""
    with ctx.this_node() as (conn, node), conn.transaction():
        owner = set_tables if node.role.captures_changes else subscriber_seqs
        owner.remove_seqs(conn, ctx.queue(), list(seqs))
        if node.role.copies_events and not node.role.captures_changes:
            set_tables.unfollow_seqs(conn, ctx.queue(), list(seqs))
    click.echo("removed " + ", ".join(seqs))


@click.command("seqs")
@pass_ctx
def seqs_cmd(ctx: Context) -> None:
    """List the replicated sequences."""
    with ctx.this_node() as (conn, node):
        if node.role.captures_changes:
            names = set_tables.set_seqs(conn, ctx.queue())
        else:
            names = [s for s, _ in subscriber_seqs.seqs(conn, ctx.queue())]
    for n in names:
        click.echo(n)


@click.command("execute")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@pass_ctx
def execute(ctx: Context, files: tuple[str, ...]) -> None:
    """Run SQL scripts on the root and, at the same position of the stream, on every subscriber."""
    with ctx.this_node() as (conn, node):
        if not node.role.captures_changes:
            raise UserError("execute runs on the root: its subscribers replay the script from the queue")
        for f in files:
            text = Path(f).read_text()
            try:
                execute_script(conn, ctx.queue(), text, Path(f).name, lift_key_triggers=False)
            except psycopg.Error as e:
                if not set_tables.blocked_by_key_trigger(e):
                    raise
                say(f"{f} changes a key column's type: the set's key-change triggers are off around it")
                execute_script(conn, ctx.queue(), text, Path(f).name, lift_key_triggers=True)
            click.echo(f"executed {f}")


def execute_script(
    conn: psycopg.Connection, queue: str, text: str, name: str, lift_key_triggers: bool
) -> None:
    """One script of `execute`, run here and queued for every node, in one transaction."""
    with conn.transaction():
        set_tables.run_script(conn, queue, text, lift_key_triggers)
        # with logical capture, through the WAL: in order with the changes around it
        q.emit_event(conn, queue, "EXECUTE", text, name)


@click.command("wait-sync")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds to wait at most.")
@pass_ctx
def wait_sync(ctx: Context, timeout: float) -> None:
    """Wait until every table is ok and this node has applied everything committed before now
    (a two-way master: on every peer; a delayed leaf: after its apply_delay; a root: at once)."""
    with ctx.this_node() as (conn, node):
        if node.role.is_root:
            waits.wait_sync_peers(conn, node, timeout)
        else:
            if node.apply_delay:
                say(
                    f"{node.node_name} applies changes {node.apply_delay.total_seconds():g} s late"
                    " (apply_delay): waiting for that"
                )
            with ctx.provider(conn, node) as prov:
                waits.wait_sync(conn, prov, node, timeout)
    click.echo("in sync")


COMMANDS = [
    add_table,
    remove_table,
    tables_cmd,
    missing,
    resync,
    add_seq,
    remove_seq,
    seqs_cmd,
    execute,
    wait_sync,
]
