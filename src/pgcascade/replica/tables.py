"""The tables a subscriber replicates (its sequences: seqs.py), and their checks.

`add_tables` registers provider tables on this node (state NULL: the worker starts a copy;
`--expect-sync`: state ok at once).  Unless `--force`, the local table must have every column
the provider sends, with the same type; the first difference is the error.  `--create` makes
the local table from the provider's columns, `--create-full` from its whole definition
(tabledef.py).  Replicated tables refuse writes from ordinary
sessions (a trigger that does not fire under session_replication_role = replica) unless added
with `allow_local_writes`.  A copy process's last failure on its table is kept with the table
(`record_copy_error`) for `status`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from pgcascade.capture import tables as capture
from pgcascade.core import catalog, pgconn, privileges
from pgcascade.core.errors import UserError
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import filters, seqs
from pgcascade.replica import state as states
from pgcascade.replica.state import TableState
from pgcascade.replica.tabledef import TableDefinition


@dataclass
class SubscriberTable:
    table_name: str
    dest_table: str
    key_columns: list[str]
    state: TableState
    copy_snapshot: str | None
    copy_tick: int | None
    copy_pid: int | None
    skip_truncate: bool
    local_writes: bool
    copy_node: str | None  # copy the rows from this node, not the provider ('?': find one)
    applied_tick: int | None = None  # a parallel apply's lane committed the table up to here
    row_filter: str | None = None  # --where, as the server deparsed it (filters.py)
    column_list: list[str] | None = None  # --columns

    def applied_columns(self, names: list[str]) -> list[str]:
        """Of these column names, those this node applies (its --columns, if any)."""
        return names if self.column_list is None else [c for c in names if c in self.column_list]


def table_from(values: Sequence[Any]) -> SubscriberTable:
    """A table from the values of TABLES_QUERY."""
    name, dest, keys, state, *rest = values
    return SubscriberTable(name, dest, keys, TableState.parse(state), *rest)


def table_rows(cursor: psycopg.Cursor) -> Callable[[Sequence[Any]], SubscriberTable]:
    """The row factory of TABLES_QUERY."""
    return table_from


# the worker sends it with a batch's statements too (replica/inline.py; rows: table_rows)
TABLES_QUERY = (
    "select table_name, dest_table, key_columns, state, copy_snapshot::text, copy_tick, copy_pid,"
    " skip_truncate, local_writes, copy_node, applied_tick, row_filter, column_list"
    " from pgcascade.subscriber_table"
    " where queue_name = %s"
    " order by 1"
)


def tables(conn: psycopg.Connection, queue: str) -> list[SubscriberTable]:
    with conn.cursor(row_factory=table_rows) as cur:
        return cur.execute(TABLES_QUERY, (queue,)).fetchall()


def get_table(conn: psycopg.Connection, queue: str, table: str) -> SubscriberTable | None:
    return next((t for t in tables(conn, queue) if t.table_name == table), None)


def set_state(conn: psycopg.Connection, queue: str, table: str, state: TableState, **extra: object) -> None:
    """Move a table to `state` (and set copy_* columns given as keywords).  A parallel apply's
    mark goes: the rows now come from a copy, at the copy's tick."""
    assigns = [sql.SQL("state = %s, applied_tick = null")] + [
        sql.SQL("{} = %s").format(sql.Identifier(k)) for k in extra
    ]
    conn.execute(
        sql.SQL("update pgcascade.subscriber_table set {} where queue_name = %s and table_name = %s").format(
            sql.SQL(", ").join(assigns)
        ),
        (state.stored(), *extra.values(), queue, table),
    )


def lock_applied_ticks(conn: psycopg.Connection, queue: str, tables: list[str]) -> dict[str, int | None]:
    """Where a parallel apply left each of `tables`, their rows locked until commit."""
    rows = conn.execute(
        "select table_name, applied_tick from pgcascade.subscriber_table"
        " where queue_name = %s and table_name = any(%s) order by table_name for update",
        (queue, tables),
    ).fetchall()
    return dict(rows)


def mark_applied(conn: psycopg.Connection, queue: str, tables: list[str], tick: int) -> None:
    conn.execute(
        "update pgcascade.subscriber_table set applied_tick = %s where queue_name = %s and table_name = any(%s)",
        (tick, queue, tables),
    )


def lock_copy_tick(conn: psycopg.Connection, queue: str, table: str) -> int | None:
    """The tick a copy process applied last for this table, the row locked until commit."""
    row = conn.execute(
        "select copy_tick from pgcascade.subscriber_table where queue_name = %s and table_name = %s for update",
        (queue, table),
    ).fetchone()
    return row[0] if row else None


def set_copy_tick(conn: psycopg.Connection, queue: str, table: str, tick: int) -> None:
    conn.execute(
        "update pgcascade.subscriber_table set copy_tick = %s where queue_name = %s and table_name = %s",
        (tick, queue, table),
    )


def record_copy_error(conn: psycopg.Connection, queue: str, table: str, message: str | None) -> None:
    """The copy process's last failure on the table (None: it works again), for `status`."""
    conn.execute(
        "update pgcascade.subscriber_table set last_error = %s, last_error_time = case when %s::text is null"
        " then null else now() end where queue_name = %s and table_name = %s",
        (message, message, queue, table),
    )


def copy_errors(conn: psycopg.Connection, queue: str) -> dict[str, tuple[str, Any]]:
    """table -> (message, time) of the copy processes' last failures."""
    rows = conn.execute(
        "select table_name, last_error, last_error_time from pgcascade.subscriber_table"
        " where queue_name = %s and last_error is not null",
        (queue,),
    ).fetchall()
    return {t: (message, at) for t, message, at in rows}


def busy_tables(conn: psycopg.Connection, queue: str) -> list[str]:
    """Tables between NULL and ok: a copy owns them."""
    return [t.table_name for t in tables(conn, queue) if t.state not in (states.NEW, states.OK)]


def structure_difference(prov_cols: list[catalog.Column], dest_cols: list[catalog.Column]) -> str | None:
    """The first reason the local table cannot take the provider's rows, or None."""
    dest = {c.name: c for c in dest_cols}
    for c in prov_cols:
        if c.generated:
            continue
        d = dest.get(c.name)
        if d is None:
            return f'column "{c.name}" is missing on the subscriber'
        if d.type != c.type:
            return f'column "{c.name}": provider has {c.type}, subscriber has {d.type}'
    prov_names = {c.name for c in prov_cols}
    for d in dest_cols:
        if d.name not in prov_names and d.not_null and not d.has_default and not d.generated:
            return f'column "{d.name}" exists only on the subscriber and is NOT NULL without a default'
    return None


def create_like_provider(
    conn: psycopg.Connection, dest: str, prov_cols: list[catalog.Column], keys: list[str]
) -> None:
    sch, _ = catalog.split_name(conn, dest)
    conn.execute(sql.SQL("create schema if not exists {}").format(sql.Identifier(sch)))
    coldefs = [
        sql.SQL("{} {}{}").format(
            sql.Identifier(c.name), sql.SQL(c.type), sql.SQL(" not null" if c.not_null else "")
        )
        for c in prov_cols
        if not c.generated
    ]
    coldefs.append(sql.SQL("primary key ({})").format(sql.SQL(", ").join(map(sql.Identifier, keys))))
    conn.execute(sql.SQL("create table {} ({})").format(sql.SQL(dest), sql.SQL(", ").join(coldefs)))


def make_full(
    conn: psycopg.Connection,
    src: psycopg.Connection,
    prov: psycopg.Connection,
    queue: str,
    table: str,
    dest: str,
    say: Callable[[str], None],
) -> None:
    """--create-full: the definition `src` has; the sequences its columns own follow the
    provider's values if the provider passes them on (add-seq on the root)."""
    definition = TableDefinition.read(src, table)
    for note in definition.create(conn, dest):
        say(f"{dest}: {note}")
    owned = [s.name for s in definition.sequences if s.owner_column]
    passed_on = set(capture.set_seqs(prov, queue))
    seqs.follow_seqs(conn, queue, [s for s in owned if s in passed_on])
    for s in owned:
        if s not in passed_on:
            say(
                f"{dest}: sequence {s} made at the provider's value; add-seq it on the root to keep it following"
            )


def add_tables(
    conn: psycopg.Connection,
    prov: psycopg.Connection,
    queue: str,
    names: list[str],
    all_tables: bool = False,
    expect_sync: bool = False,
    skip_truncate: bool = False,
    force: bool = False,
    create: bool = False,
    create_full: bool = False,
    dest_table: str | None = None,
    allow_local_writes: bool = False,
    copy_node: str | None = None,
    subset: filters.Subset = filters.EVERYTHING,
    say: Callable[[str], None] = lambda _line: None,
) -> list[str]:
    provided = capture.set_tables(prov, queue)
    wanted = list(provided) if all_tables else [catalog.canonical(prov, n) for n in names]
    if dest_table and len(wanted) != 1:
        raise UserError("--dest-table needs exactly one table")
    if subset.given:
        filters.refuse_unusable(nodes.require_node(conn, queue), wanted, capture.event_formats(prov, queue))
    for t in wanted:
        if t not in provided:
            raise UserError(f"table {t} is not replicated by the provider: add it on the root first")
    if copy_node not in (None, FIND_COPY_NODE):
        check_copy_node(conn, queue, copy_node, wanted)
    elif not expect_sync and copy_node is None:
        refuse_uncopyable(prov, queue, wanted)
    registered = {t.table_name: t for t in tables(conn, queue)}
    node = nodes.require_node(conn, queue)
    added = []
    with conn.transaction(), contextlib.ExitStack() as sources:
        for t in wanted:
            if t in registered:
                filters.refuse_change(registered[t].row_filter, registered[t].column_list, t, subset)
                continue
            dest = catalog.canonical(conn, dest_table) if dest_table else t
            # the definition comes from where the rows will (a queue-only branch has neither)
            src = prov
            if copy_node is not None:
                location = copy_source(conn, node, t, copy_node)
                src = sources.enter_context(pgconn.connect(location, autocommit=True))
            prov_cols = catalog.columns(src, t)
            if subset.columns is not None:
                filters.check_columns(t, subset.columns, prov_cols, provided[t])
                prov_cols = [c for c in prov_cols if c.name in subset.columns]
            if not catalog.table_exists(conn, dest):
                if create or create_full:
                    privileges.require(conn, privileges.create_in(conn, catalog.split_name(conn, dest)[0]))
                if create_full:
                    make_full(conn, src, prov, queue, t, dest, say)
                elif create:
                    create_like_provider(conn, dest, prov_cols, provided[t])
                else:
                    raise UserError(
                        f"table {dest} does not exist on the subscriber (--create or --create-full to make it)"
                    )
            elif not force:
                diff = structure_difference(prov_cols, catalog.columns(conn, dest))
                if diff:
                    raise UserError(
                        f"table {dest} does not match the provider's {t}: {diff} (--force to skip)"
                    )
            privileges.require(conn, privileges.owner_of(conn, [dest]))  # copied into, truncated, protected
            row_filter = filters.canonical(conn, dest, subset.where) if subset.where is not None else None
            if row_filter is not None:
                filters.check_on_provider(src, t, row_filter)
            conn.execute(
                "insert into pgcascade.subscriber_table (queue_name, table_name, dest_table, key_columns, state,"
                " skip_truncate, local_writes, copy_node, row_filter, column_list)"
                " values (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    queue,
                    t,
                    dest,
                    provided[t],
                    (states.OK if expect_sync else states.NEW).stored(),
                    skip_truncate,
                    allow_local_writes,
                    copy_node,
                    row_filter,
                    subset.columns,
                ),
            )
            conn.execute("select pgcascade.protect_table(%s::regclass, %s)", (dest, not allow_local_writes))
            added.append(t)
    if added and not expect_sync:
        # wake the worker (it waits on the provider's tick channel) to start the copies now
        q.wake_consumers(prov, queue)
    return added


def subscribe_peer_tables(
    conn: psycopg.Connection, peer_queue: str, tables: dict[str, list[str]], state: TableState = states.OK
) -> None:
    """A master subscribes to its tables in a peer's queue, writable (a master takes local
    writes): in state ok when the masters hold the same rows, NULL to copy them from that peer."""
    for table, keys in tables.items():
        conn.execute(
            "insert into pgcascade.subscriber_table (queue_name, table_name, dest_table, key_columns, state,"
            " local_writes) values (%s, %s, %s, %s, %s, true) on conflict (queue_name, table_name) do nothing",
            (peer_queue, table, table, keys, state.stored()),
        )


# a snapshot that sees no transaction: a catch-up that skips nothing
SEES_NOTHING = "1:1:"


def catch_up_peer_table(
    conn: psycopg.Connection, peer_queue: str, table: str, keys: list[str], tick: int | None
) -> None:
    """A table just copied here from another master: this peer's changes to it from `tick` on
    (those the copy does not hold) are replayed by a copy process before the worker takes it
    over; with no tick, the worker takes it at once."""
    state = states.CATCHING_UP if tick is not None else states.OK
    conn.execute(
        "insert into pgcascade.subscriber_table (queue_name, table_name, dest_table, key_columns, state,"
        " local_writes, copy_tick, copy_snapshot) values (%s, %s, %s, %s, %s, true, %s, %s)"
        " on conflict (queue_name, table_name) do update set state = excluded.state,"
        " copy_tick = excluded.copy_tick, copy_snapshot = excluded.copy_snapshot, applied_tick = null",
        (peer_queue, table, table, keys, state.stored(), tick, SEES_NOTHING if tick is not None else None),
    )


PEER_POLICIES = (
    "select table_name, conflict_policy from pgcascade.subscriber_table"
    " where queue_name = %s and conflict_policy is not null"
)


def peer_policies(conn: psycopg.Connection, peer_queue: str) -> dict[str, str]:
    """Per-table conflict policies of a peer subscription (the others use the node's)."""
    return dict(conn.execute(PEER_POLICIES, (peer_queue,)).fetchall())


def set_peer_policy(conn: psycopg.Connection, peer_queues: list[str], tables: list[str], policy: str) -> None:
    conn.execute(
        "update pgcascade.subscriber_table set conflict_policy = %s where queue_name = any(%s) and table_name = any(%s)",
        (policy, peer_queues, tables),
    )


def provider_lacks(prov: psycopg.Connection, queue: str, wanted: list[str]) -> dict[str, str]:
    """Tables a provider cannot give an initial copy of now, with the reason: a branch carries
    every table's events but holds rows only of the tables it replicates itself, in state ok."""
    pnode = nodes.get_node(prov, queue)
    if pnode is None or not pnode.role.copies_events:
        return {}
    held = {t.table_name: t.state for t in tables(prov, queue)}
    return {
        t: "not replicated there" if t not in held else f"state {held[t]} there"
        for t in wanted
        if t not in held or not held[t].is_ok
    }


FIND_COPY_NODE = "?"  # Londiste's mark: the nearest node upstream that holds the table


def node_holds(conn: psycopg.Connection, queue: str, table: str) -> str | None:
    """Why this node cannot give a copy of `table` (None: it can - the root, or in sync)."""
    node = nodes.get_node(conn, queue)
    if node is None or not node.role.has_queue:
        return "it is not a root or branch of the set"
    return provider_lacks(conn, queue, [table]).get(table)


def check_copy_node(conn: psycopg.Connection, queue: str, name: str, wanted: list[str]) -> None:
    """--copy-node: a root or branch of the set that holds the tables in sync now."""
    location = nodes.locations(conn, queue).get(name)
    if location is None:
        raise UserError(f"--copy-node: {name} is not a node of set {queue}")
    with pgconn.connect(location[0], autocommit=True) as other:
        for t in wanted:
            why = node_holds(other, queue, t)
            if why:
                raise UserError(f"--copy-node: {name} cannot give the copy of {t}: {why}")


def copy_source(conn: psycopg.Connection, node: nodes.Node, table: str, copy_node: str | None) -> str:
    """The location the table's copy reads: the provider, --copy-node's node, or (find) the
    nearest node upstream that holds the table in sync now, as Londiste's --find-copy-node."""
    if copy_node and copy_node != FIND_COPY_NODE:
        return nodes.node_location(conn, node.queue_name, copy_node)
    location = nodes.provider_location(conn, node)
    if copy_node != FIND_COPY_NODE:
        return location
    for _ in range(64):  # the cascade's depth, with a bound against a loop
        with pgconn.connect(location, autocommit=True) as up:
            here = nodes.require_node(up, node.queue_name)
            if node_holds(up, node.queue_name, table) is None or here.provider_node is None:
                return location
            location = nodes.provider_location(up, here)
    return location


def refuse_uncopyable(prov: psycopg.Connection, queue: str, wanted: list[str]) -> None:
    """A branch that does not replicate a table at all (a queue-only branch) never can give
    its copy; one still copying it will (the copy process waits)."""
    never = [t for t, why in provider_lacks(prov, queue, wanted).items() if why == "not replicated there"]
    if never:
        raise UserError(
            f"the provider (a branch) does not replicate {', '.join(never)}, so it cannot give the initial"
            " copy: add it there first, copy it from upstream (--find-copy-node), or load the rows yourself"
            " and use --expect-sync"
        )


def remove_tables(conn: psycopg.Connection, queue: str, names: list[str]) -> list[str]:
    registered = {t.table_name: t for t in tables(conn, queue)}
    removed = []
    with conn.transaction():
        for n in names:
            t = catalog.canonical(conn, n)
            if t not in registered:
                raise UserError(f"table {t} is not replicated here")
            conn.execute(
                "delete from pgcascade.subscriber_table where queue_name = %s and table_name = %s", (queue, t)
            )
            if catalog.table_exists(conn, registered[t].dest_table):
                conn.execute(
                    "select pgcascade.protect_table(%s::regclass, false)", (registered[t].dest_table,)
                )
            removed.append(t)
    return removed


def resync_tables(conn: psycopg.Connection, queue: str, names: list[str]) -> list[str]:
    registered = {t.table_name for t in tables(conn, queue)}
    done = []
    for n in names:
        t = catalog.canonical(conn, n)
        if t not in registered:
            raise UserError(f"table {t} is not replicated here")
        set_state(conn, queue, t, states.NEW, copy_snapshot=None, copy_tick=None)
        done.append(t)
    return done


def missing_tables(conn: psycopg.Connection, prov: psycopg.Connection, queue: str) -> list[str]:
    registered = {t.table_name for t in tables(conn, queue)}
    return [t for t in capture.set_tables(prov, queue) if t not in registered]


# --- the node changes role (takeover, resurrect, leaving the set) --------------------------------


def in_sync_tables(conn: psycopg.Connection, queue: str) -> set[str]:
    """Tables this node holds in sync under their own names: what it can capture as the root."""
    return {t.table_name for t in tables(conn, queue) if t.state.is_ok and t.dest_table == t.table_name}


def adopt(conn: psycopg.Connection, queue: str, held: dict[str, list[str]], state: TableState) -> None:
    """Replicate these tables (name -> key columns) under their own names, in `state`: ok for
    an old root's tables (in sync by definition), NULL for tables to copy again."""
    for table, keys in held.items():
        adopt_table(conn, queue, table, table, keys, state)


def adopt_table(
    conn: psycopg.Connection, queue: str, table: str, dest: str, keys: list[str], state: TableState
) -> None:
    """Replicate `table` into `dest` from here on, in `state` (a takeover, an import)."""
    conn.execute("select pgcascade.protect_table(%s::regclass, true)", (dest,))
    conn.execute(
        "insert into pgcascade.subscriber_table (queue_name, table_name, dest_table, key_columns, state)"
        " values (%s, %s, %s, %s, %s)"
        " on conflict (queue_name, table_name) do update set state = excluded.state, applied_tick = null",
        (queue, table, dest, keys, state.stored()),
    )


def release_all(conn: psycopg.Connection, queue: str, unprotect: bool = True) -> list[str]:
    """This node stops replicating: the table and sequence lists go (with `unprotect`, its
    tables take ordinary writes again); the sequences it followed return."""
    for t in tables(conn, queue) if unprotect else ():
        if catalog.table_exists(conn, t.dest_table):
            conn.execute("select pgcascade.protect_table(%s::regclass, false)", (t.dest_table,))
    followed = [s for s, _ in seqs.seqs(conn, queue)]
    conn.execute("delete from pgcascade.subscriber_table where queue_name = %s", (queue,))
    seqs.forget_all(conn, queue)
    return followed
