"""The tables and sequences a subscriber replicates, and their checks.

`add_tables` registers provider tables on this node (state NULL: the worker starts a copy;
`--expect-sync`: state ok at once).  Unless `--force`, the local table must have every column
the provider sends, with the same type; the first difference is the error.  `--create` makes
the local table from the provider's definition.  Replicated tables refuse writes from ordinary
sessions (a trigger that does not fire under session_replication_role = replica) unless added
with `allow_local_writes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql
from psycopg.rows import class_row

from pgcascade.capture import tables as capture
from pgcascade.core import catalog
from pgcascade.core.errors import UserError
from pgcascade.pgq.queue import TICK_CHANNEL


@dataclass
class SubscriberTable:
    table_name: str
    dest_table: str
    key_columns: list[str]
    state: str | None
    copy_snapshot: str | None
    copy_tick: int | None
    copy_pid: int | None
    skip_truncate: bool
    local_writes: bool


def tables(conn: psycopg.Connection, queue: str) -> list[SubscriberTable]:
    with conn.cursor(row_factory=class_row(SubscriberTable)) as cur:
        return cur.execute(
            "select table_name, dest_table, key_columns, state, copy_snapshot::text, copy_tick, copy_pid,"
            " skip_truncate, local_writes from pgcascade.subscriber_table where queue_name = %s order by 1",
            (queue,),
        ).fetchall()


def get_table(conn: psycopg.Connection, queue: str, table: str) -> SubscriberTable | None:
    return next((t for t in tables(conn, queue) if t.table_name == table), None)


def set_state(conn: psycopg.Connection, queue: str, table: str, state: str | None, **extra: object) -> None:
    assigns = [sql.SQL("state = %s")] + [sql.SQL("{} = %s").format(sql.Identifier(k)) for k in extra]
    conn.execute(
        sql.SQL("update pgcascade.subscriber_table set {} where queue_name = %s and table_name = %s").format(
            sql.SQL(", ").join(assigns)
        ),
        (state, *extra.values(), queue, table),
    )


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
    dest_table: str | None = None,
    allow_local_writes: bool = False,
) -> list[str]:
    provided = capture.set_tables(prov, queue)
    wanted = list(provided) if all_tables else [catalog.canonical(prov, n) for n in names]
    if dest_table and len(wanted) != 1:
        raise UserError("--dest-table needs exactly one table")
    for t in wanted:
        if t not in provided:
            raise UserError(f"table {t} is not replicated by the provider: add it on the root first")
    if not expect_sync:
        refuse_uncopyable(prov, queue, wanted)
    registered = {t.table_name for t in tables(conn, queue)}
    added = []
    with conn.transaction():
        for t in wanted:
            if t in registered:
                continue
            dest = catalog.canonical(conn, dest_table) if dest_table else t
            prov_cols = catalog.columns(prov, t)
            if not catalog.table_exists(conn, dest):
                if not create:
                    raise UserError(
                        f"table {dest} does not exist on the subscriber (use --create to make it)"
                    )
                create_like_provider(conn, dest, prov_cols, provided[t])
            elif not force:
                diff = structure_difference(prov_cols, catalog.columns(conn, dest))
                if diff:
                    raise UserError(
                        f"table {dest} does not match the provider's {t}: {diff} (--force to skip)"
                    )
            conn.execute(
                "insert into pgcascade.subscriber_table (queue_name, table_name, dest_table, key_columns, state,"
                " skip_truncate, local_writes) values (%s, %s, %s, %s, %s, %s, %s)",
                (
                    queue,
                    t,
                    dest,
                    provided[t],
                    "ok" if expect_sync else None,
                    skip_truncate,
                    allow_local_writes,
                ),
            )
            conn.execute("select pgcascade.protect_table(%s::regclass, %s)", (dest, not allow_local_writes))
            added.append(t)
    if added and not expect_sync:
        # wake the worker (it waits on the provider's tick channel) to start the copies now
        prov.execute("select pg_notify(%s, %s)", (TICK_CHANNEL, queue))
    return added


def provider_lacks(prov: psycopg.Connection, queue: str, wanted: list[str]) -> dict[str, str]:
    """Tables a provider cannot give an initial copy of now, with the reason: a branch carries
    every table's events but holds rows only of the tables it replicates itself, in state ok."""
    if prov.execute(
        "select node_type = 'branch' from pgcascade.node where queue_name = %s", (queue,)
    ).fetchone() != (True,):
        return {}
    held = {t.table_name: t.state for t in tables(prov, queue)}
    return {
        t: "not replicated there" if t not in held else f"state {held[t] or 'NULL'} there"
        for t in wanted
        if held.get(t, "") != "ok"
    }


def refuse_uncopyable(prov: psycopg.Connection, queue: str, wanted: list[str]) -> None:
    """A branch that does not replicate a table at all (a queue-only branch) never can give
    its copy; one still copying it will (the copy process waits)."""
    never = [t for t, why in provider_lacks(prov, queue, wanted).items() if why == "not replicated there"]
    if never:
        raise UserError(
            f"the provider (a branch) does not replicate {', '.join(never)}, so it cannot give the initial"
            " copy: add it there first, or load the rows yourself and use --expect-sync"
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
        set_state(conn, queue, t, None, copy_snapshot=None, copy_tick=None)
        done.append(t)
    return done


def missing_tables(conn: psycopg.Connection, prov: psycopg.Connection, queue: str) -> list[str]:
    registered = {t.table_name for t in tables(conn, queue)}
    return [t for t in capture.set_tables(prov, queue) if t not in registered]


def seqs(conn: psycopg.Connection, queue: str) -> list[tuple[str, str]]:
    return conn.execute(
        "select seq_name, dest_seq from pgcascade.subscriber_seq where queue_name = %s order by 1", (queue,)
    ).fetchall()


def add_seqs(
    conn: psycopg.Connection, prov: psycopg.Connection, queue: str, names: list[str], all_seqs: bool
) -> list[str]:
    provided = capture.set_seqs(prov, queue)
    wanted = provided if all_seqs else [catalog.canonical(prov, n) for n in names]
    for s in wanted:
        if s not in provided:
            raise UserError(f"sequence {s} is not replicated by the provider: add it on the root first")
        if conn.execute("select to_regclass(%s) is null", (s,)).fetchone()[0]:
            raise UserError(f"sequence {s} does not exist on the subscriber")
    with conn.transaction():
        for s in wanted:
            conn.execute(
                "insert into pgcascade.subscriber_seq (queue_name, seq_name, dest_seq) values (%s, %s, %s)"
                " on conflict do nothing",
                (queue, s, s),
            )
    return wanted


def remove_seqs(conn: psycopg.Connection, queue: str, names: list[str]) -> None:
    for n in names:
        cur = conn.execute(
            "delete from pgcascade.subscriber_seq where queue_name = %s and seq_name = %s",
            (queue, catalog.canonical(conn, n)),
        )
        if cur.rowcount == 0:
            raise UserError(f"sequence {n!r} is not replicated here")
