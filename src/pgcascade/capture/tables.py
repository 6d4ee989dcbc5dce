"""Change capture on the root: which tables and sequences the set replicates.

`add_tables` installs the generated statement-level capture triggers (sql/capture) - or, on a
root with logical capture, adds the table to its publication (logical.py) - and registers the
table in `set_table`, with its key: the primary key, or the columns the user names for a table
without one.  Each change of the table list also goes into the queue as a `T` event (the seed's
table-list event), so subscribers see tables leave the set in order.

This module is the only one that reads or writes `set_table` and `set_seq`: the set's tables
as the root captures them, and as every branch keeps them (it may become the root); the
sequences whose values the node passes on (the root's, a branch's it follows itself).
"""

from __future__ import annotations

import psycopg

from pgcascade.capture import logical as walcapture
from pgcascade.core import catalog, privileges
from pgcascade.core.catalog import TableRef
from pgcascade.core.errors import UserError
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import queue as q

EVENT_FORMATS = ("json", "sql")


def use_logical(conn: psycopg.Connection, queue: str) -> bool:
    """The root captures through a slot from now on (create-root --capture=logical); True if
    anything was created.  A root whose triggers capture tables already keeps them."""
    if not walcapture.is_logical(conn, queue) and set_tables(conn, queue):
        raise UserError(
            f"root of {queue} captures with triggers and has tables: remove them first, or keep triggers"
        )
    return walcapture.setup_logical(conn, queue)


def set_tables(conn: psycopg.Connection, queue: str) -> dict[str, list[str]]:
    """table name -> key columns, for the set's tables as this node knows them."""
    return {table: keys for table, keys, _ in set_table_rows(conn, queue)}


SetTableRow = tuple[str, list[str], str]  # (table, key columns, event format)


def set_table_rows(conn: psycopg.Connection, queue: str) -> list[SetTableRow]:
    return conn.execute(
        "select table_name, key_columns, event_format from pgcascade.set_table where queue_name = %s order by 1",
        (queue,),
    ).fetchall()


def event_formats(conn: psycopg.Connection, queue: str) -> dict[str, str]:
    """table name -> the format of its events (json, or the seed's partial sql)."""
    return {table: fmt for table, _, fmt in set_table_rows(conn, queue)}


def emit_table_list(conn: psycopg.Connection, queue: str) -> None:
    q.emit_event(conn, queue, "T", ",".join(set_tables(conn, queue)), None)


def emit_repair(conn: psycopg.Connection, queue: str, table: str, keys: list[str], keyvals: str) -> int:
    """The root's rows of these keys (JSON objects of key text), or their absence, as repair
    events in the queue (sql/capture/96_repair.sql); the caller holds the table's SHARE lock."""
    return int(
        scalar(
            conn,
            "select pgcascade.emit_repair(%s, %s::regclass, %s, %s::json)",
            (queue, table, keys, keyvals),
        )
    )


def mirror_set_tables(conn: psycopg.Connection, queue: str, rows: list[SetTableRow]) -> None:
    """A branch keeps the set's table list as its provider has it: its subscribers choose from
    it, and it captures these tables if it becomes the root."""
    conn.execute("delete from pgcascade.set_table where queue_name = %s", (queue,))
    for table, keys, fmt in rows:
        conn.execute(
            "insert into pgcascade.set_table (queue_name, table_name, key_columns, event_format)"
            " values (%s, %s, %s, %s)",
            (queue, table, keys, fmt),
        )


def add_to_set(conn: psycopg.Connection, queue: str, tables: dict[str, list[str]]) -> None:
    """Tables that join the set from elsewhere (a merge-leaf's), then the table list event."""
    for table, keys in tables.items():
        conn.execute(
            "insert into pgcascade.set_table (queue_name, table_name, key_columns) values (%s, %s, %s)"
            " on conflict do nothing",
            (queue, table, keys),
        )
    emit_table_list(conn, queue)


def refresh_sql_capture(conn: psycopg.Connection, queue: str) -> None:
    """After DDL, the capture functions again: the seed's partial-SQL capture names the columns,
    and a new column's type may need an output setting fixed (capture_output_settings)."""
    conn.execute("select pgcascade.capture_refresh(%s)", (queue,))


def run_script(conn: psycopg.Connection, queue: str, text: str, lift_key_triggers: bool) -> None:
    """In the caller's transaction, a DDL script on the root, its capture functions made again
    after it, and its key-change triggers where a trigger it made changes their form
    (92_key_triggers.sql).  `lift_key_triggers`: those triggers off around it, for a script
    that changes a key column's type (which their condition names: PostgreSQL refuses it)."""
    lifted: list[str] = []
    if lift_key_triggers:
        lifted = scalar(conn, "select pgcascade.capture_key_triggers_lift(%s)", (queue,))
    conn.execute(text.encode())
    if lifted:
        conn.execute("select pgcascade.capture_key_triggers_restore(%s, %s)", (queue, lifted))
    conn.execute("select pgcascade.maint_key_triggers(%s)", (queue,))
    refresh_sql_capture(conn, queue)


def blocked_by_key_trigger(e: psycopg.Error) -> bool:
    """Whether PostgreSQL refused a key column's type change because of a key-change trigger."""
    return isinstance(e, psycopg.errors.FeatureNotSupported) and "_pgcascade_capture_key" in (
        e.diag.message_detail or ""
    )


# --- the root changes place (takeover) -------------------------------------------------------------


def start_capture(conn: psycopg.Connection, queue: str, in_sync: set[str]) -> list[str]:
    """This node becomes the root: capture the set's tables it holds in sync (they become
    writable); the others leave the set, and their names return."""
    left_out = []
    for table, keys, fmt in set_table_rows(conn, queue):
        if table not in in_sync or not catalog.table_exists(conn, table):
            left_out.append(table)
            conn.execute(
                "delete from pgcascade.set_table where queue_name = %s and table_name = %s", (queue, table)
            )
            continue
        conn.execute("select pgcascade.protect_table(%s::regclass, false)", (table,))
        conn.execute("select pgcascade.capture_enable(%s, %s::regclass, %s, %s)", (queue, table, keys, fmt))
    return left_out


def stop_capture(conn: psycopg.Connection, queue: str) -> dict[str, list[str]]:
    """This root stops capturing: its tables that exist, with their keys (the trigger DDL waits
    for writers in flight, so after it none is left).  The set's list stays."""
    stopped = {}
    for table, keys in set_tables(conn, queue).items():
        if catalog.table_exists(conn, table):
            conn.execute("select pgcascade.capture_disable(%s::regclass)", (table,))
            stopped[table] = keys
    return stopped


def release_all(conn: psycopg.Connection, queue: str) -> None:
    """The node leaves the set: no capture, and the set's table and sequence lists go."""
    stop_capture(conn, queue)
    conn.execute("delete from pgcascade.set_table where queue_name = %s", (queue,))
    conn.execute("delete from pgcascade.set_seq where queue_name = %s", (queue,))


def add_tables(
    conn: psycopg.Connection,
    queue: str,
    patterns: list[str],
    all_tables: bool = False,
    key: list[str] | None = None,
    event_format: str = "json",
) -> list[str]:
    """Capture changes of the tables; returns the canonical names newly added."""
    if event_format not in EVENT_FORMATS:
        raise UserError(f"unknown event format {event_format!r}: use json or sql")
    tables = catalog.all_tables(conn) if all_tables else catalog.resolve(conn, patterns)
    if not tables:
        raise UserError("no tables to add")
    privileges.require(conn, privileges.owner_of(conn, [t.canonical for t in tables]))
    known = set_tables(conn, queue)
    logical = walcapture.is_logical(conn, queue)
    if logical and event_format != "json":
        raise UserError("logical capture writes json events only: --format=sql needs trigger capture")
    refuse_overlap(conn, [t.canonical for t in tables], known)
    added = []
    with conn.transaction():
        for t in tables:
            keys = key or catalog.primary_key(conn, t.oid)
            if not keys:
                raise UserError(
                    f"table {t.canonical} has no primary key: give the key columns with --key=COL[,COL...]"
                )
            if logical:
                walcapture.add_table(conn, queue, t.canonical, keys)
            else:
                conn.execute(
                    "select pgcascade.capture_enable(%s, %s::regclass, %s, %s)",
                    (queue, t.canonical, keys, event_format),
                )
            conn.execute(
                "insert into pgcascade.set_table (queue_name, table_name, key_columns, event_format)"
                " values (%s, %s, %s, %s) on conflict (queue_name, table_name)"
                " do update set key_columns = excluded.key_columns, event_format = excluded.event_format",
                (queue, t.canonical, keys, event_format),
            )
            if t.canonical not in known:
                added.append(t.canonical)
        emit_table_list(conn, queue)
    return added


def refuse_overlap(conn: psycopg.Connection, adding: list[str], known: dict[str, list[str]]) -> None:
    """A partitioned table is replicated as itself, with every partition: one of its partitions
    in the set besides it would be captured twice."""
    names = sorted(set(adding) | set(known))
    row = conn.execute(
        "select pgcascade.canonical_name(t.relid), a.name from unnest(%s::text[]) a(name)"
        " cross join lateral pg_partition_tree(to_regclass(a.name)) t"
        " where t.level > 0 and pgcascade.canonical_name(t.relid) = any(%s::text[]) limit 1",
        (names, names),
    ).fetchone()
    if row is not None:
        raise UserError(
            f"{row[0]} is a partition of {row[1]}: a partitioned table is replicated with all its partitions,"
            " add the one or the other"
        )


def make_two_way(conn: psycopg.Connection, table: str, keys: list[str]) -> None:
    """A master's table with peers: its capture triggers fire in the peers' apply too (which tags
    the events with their origin), and local deletes leave tombstones."""
    conn.execute("select pgcascade.two_way_table(%s::regclass, %s, true)", (table, keys))


def remove_tables(conn: psycopg.Connection, queue: str, patterns: list[str]) -> list[str]:
    known = set_tables(conn, queue)
    names = []
    for pat in patterns:
        try:
            refs: list[TableRef] = catalog.resolve(conn, [pat])
            names += [r.canonical for r in refs]
        except UserError:
            names.append(catalog.canonical(conn, pat))  # no longer exists: removable all the same
    missing = [n for n in names if n not in known]
    if missing:
        raise UserError(f"not in the set: {', '.join(missing)}")
    with conn.transaction():
        for n in names:
            if catalog.table_exists(conn, n):
                conn.execute("select pgcascade.capture_disable(%s::regclass)", (n,))
                walcapture.remove_table(conn, queue, n)
            conn.execute(
                "delete from pgcascade.set_table where queue_name = %s and table_name = %s", (queue, n)
            )
        emit_table_list(conn, queue)
    return names


def add_seqs(conn: psycopg.Connection, queue: str, patterns: list[str], all_seqs: bool = False) -> list[str]:
    seqs = (
        catalog.relations(conn, "S")
        if all_seqs
        else catalog.resolve(conn, patterns, kinds="S", what="sequence")
    )
    names = [s.canonical for s in seqs]
    with conn.transaction():
        follow_seqs(conn, queue, names)
    return names


def remove_seqs(conn: psycopg.Connection, queue: str, names: list[str]) -> None:
    for n in names:
        cur = conn.execute(
            "delete from pgcascade.set_seq where queue_name = %s and seq_name = %s",
            (queue, catalog.canonical(conn, n)),
        )
        if cur.rowcount == 0:
            raise UserError(f"sequence {n!r} is not in the set")


def follow_seqs(conn: psycopg.Connection, queue: str, names: list[str]) -> None:
    """Replicate these sequences (add-seq; a new root: those it followed as a subscriber)."""
    for name in names:
        conn.execute(
            "insert into pgcascade.set_seq (queue_name, seq_name) values (%s, %s) on conflict do nothing",
            (queue, name),
        )


def unfollow_seqs(conn: psycopg.Connection, queue: str, names: list[str]) -> None:
    """A branch stops passing these sequences on (remove-seq there)."""
    conn.execute(
        "delete from pgcascade.set_seq where queue_name = %s and seq_name = any(%s)",
        (queue, [catalog.canonical(conn, n) for n in names]),
    )


def set_seqs(conn: psycopg.Connection, queue: str) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "select seq_name from pgcascade.set_seq where queue_name = %s order by 1", (queue,)
        )
    ]
