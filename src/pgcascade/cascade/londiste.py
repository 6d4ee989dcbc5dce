"""import-londiste: a live Londiste 3 node becomes the pgcascade node of the same name and
location, without copying its tables again.

The root goes first, with its Londiste worker stopped (the application keeps writing):
  1. one transaction: pgcascade's queue and root node; pgcascade's capture triggers on the
     set's tables and Londiste's dropped (each table's lock waits for the writers in flight);
     a first pgcascade tick F.  A transaction that writes after it finds pgcascade's triggers;
  2. wait until every transaction that was running at that commit has ended: none can write
     through Londiste's triggers any more;
  3. a final PgQ tick P on Londiste's queue (then its ticker is paused: pgqd has nothing left to
     tick there); every Londiste event is in a batch up to P, every pgcascade event after F;
  4. Londiste's subscribers are registered on pgcascade's queue at F (the queue keeps their
     history until they are imported) and F and P are recorded (pgcascade.londiste_import).

Then each subscriber, provider before subscriber, once its Londiste worker has applied P and
is stopped: one transaction makes it a pgcascade leaf or branch that applied F, with its
tables in state ok (those Londiste had not finished copying start their copy again), the
sequences it followed, and Londiste's triggers on its tables dropped.  A row changed before
the root's swap arrives through Londiste, after it through pgcascade, in that order: nothing
is lost or applied twice.  Londiste's schemas stay (drop-londiste removes them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from pgcascade.capture import tables as set_tables
from pgcascade.cascade.survey import connect
from pgcascade.cascade.waits import Say
from pgcascade.core import schema
from pgcascade.core.errors import RuntimeFailure, UserError
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pgq.node import NodeType
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import state as states
from pgcascade.replica import tables as subscriber


@dataclass
class LondisteTable:
    name: str
    dest: str
    in_sync: bool  # merge_state ok


@dataclass
class LondisteNode:
    """A node of a Londiste 3 set as its database describes it (pgq_node, londiste)."""

    queue: str
    name: str
    node_type: NodeType
    provider: str | None
    provider_location: str | None
    worker_last_tick: int | None  # the last PgQ tick its worker applied
    locations: dict[str, tuple[str, bool]] = field(default_factory=dict)
    tables: list[LondisteTable] = field(default_factory=list)
    seqs: list[str] = field(default_factory=list)
    subscribers: list[str] = field(default_factory=list)

    @property
    def location(self) -> str:
        return self.locations[self.name][0]

    @property
    def to_copy(self) -> list[str]:
        """Tables Londiste had not finished copying: their copy starts again."""
        return [t.name for t in self.tables if not t.in_sync]


def read_node(conn: psycopg.Connection, queue: str) -> LondisteNode:
    if not scalar(conn, "select to_regclass('londiste.table_info') is not null"):
        raise UserError("this database has no Londiste 3 (no londiste schema)")
    row = conn.execute(
        "select node_type, node_name, provider_node, provider_location, worker_last_tick, combined_queue"
        " from pgq_node.get_node_info(%s)",
        (queue,),
    ).fetchone()
    if row is None or row[0] is None:
        raise UserError(f"this database is not a Londiste node of queue {queue!r}")
    node_type, name, provider, provider_location, last_tick, combined = row
    if combined:
        raise UserError(f"{name} is a merge-leaf of {combined}: import-londiste does not move merge sets yet")
    node = LondisteNode(queue, name, NodeType(node_type), provider, provider_location, last_tick)
    for loc_name, location, dead in conn.execute(
        "select node_name, node_location, dead from pgq_node.get_queue_locations(%s)", (queue,)
    ):
        node.locations[loc_name] = (location, dead)
    for table, local, state, dest in conn.execute(
        "select table_name, local, merge_state, dest_table from londiste.get_table_list(%s)", (queue,)
    ):
        if local:
            node.tables.append(LondisteTable(table, dest or table, state == "ok"))
    node.seqs = [
        s
        for s, local in conn.execute("select seq_name, local from londiste.get_seq_list(%s)", (queue,))
        if local
    ]
    if node.node_type is not NodeType.LEAF:
        node.subscribers = [
            r[0] for r in conn.execute("select node_name from pgq_node.get_subscriber_info(%s)", (queue,))
        ]
    return node


def plan(node: LondisteNode, target: str) -> list[str]:
    """What import-londiste would do here (--dry-run)."""
    copies = node.to_copy
    lines = [
        f"node {node.name} ({node.node_type}) of queue {node.queue} becomes a pgcascade {node.node_type}"
        + (f" of {node.provider}" if node.provider else ""),
        f"tables: {len(node.tables)}"
        + (f" ({len(copies)} copied again: {', '.join(copies)})" if copies else ""),
        f"sequences: {', '.join(node.seqs) or 'none'}",
        f"Londiste's triggers dropped on: {', '.join(t.dest for t in node.tables) or 'none'}",
        f"then: {target}",
    ]
    if node.subscribers:
        lines.append(f"subscribers kept for, to import after this node: {', '.join(node.subscribers)}")
    return lines


def copy_locations(conn: psycopg.Connection, node: LondisteNode) -> None:
    for name, (location, dead) in node.locations.items():
        nodes.set_location(conn, node.queue, name, location)
        if dead:
            nodes.mark_dead(conn, node.queue, name)


def londiste_trigger_names(queue: str) -> tuple[str, str]:
    return f"_londiste_{queue}", f"_londiste_{queue}_truncate"


def read_londiste_triggers(conn: psycopg.Connection, node: LondisteNode) -> list[tuple[str, str, str, str]]:
    """(table, trigger, definition, enabled) of Londiste's triggers on the node's tables, every
    name in the definitions qualified: back-to-londiste makes exactly these again."""
    with conn.transaction():
        conn.execute("select set_config('search_path', 'pg_catalog', true)")
        return conn.execute(
            "select t.dest, g.tgname, pg_get_triggerdef(g.oid), g.tgenabled::text"
            "  from unnest(%s::text[]) t(dest) join pg_trigger g on g.tgrelid = t.dest::regclass"
            " where g.tgname = any(%s) order by 1, 2",
            ([t.dest for t in node.tables], list(londiste_trigger_names(node.queue))),
        ).fetchall()


def save_londiste_triggers(
    conn: psycopg.Connection, queue: str, rows: list[tuple[str, str, str, str]]
) -> None:
    for table, trigger, definition, enabled in rows:
        conn.execute(
            "insert into pgcascade.londiste_trigger (queue_name, table_name, trigger_name, definition, enabled)"
            " values (%s, %s, %s, %s, %s) on conflict (queue_name, table_name, trigger_name)"
            " do update set definition = excluded.definition, enabled = excluded.enabled",
            (queue, table, trigger, definition, enabled),
        )


def drop_londiste_triggers(conn: psycopg.Connection, queue: str, table: str) -> None:
    for trigger in londiste_trigger_names(queue):
        conn.execute(
            sql.SQL("drop trigger if exists {} on {}").format(sql.Identifier(trigger), sql.SQL(table))
        )


def install_here(conn: psycopg.Connection, queue: str) -> None:
    """pgcascade's schema, in a database that is no pgcascade node of the set yet."""
    schema.install(conn)
    if nodes.get_node(conn, queue) is not None:
        raise UserError(f"this database is a pgcascade node of {queue} already")


def import_root(conn: psycopg.Connection, node: LondisteNode, say: Say) -> str:
    queue = node.queue
    install_here(conn, queue)
    triggers = read_londiste_triggers(conn, node)
    with conn.transaction():
        q.create_queue(conn, queue)
        nodes.insert_node(conn, queue, node.name, NodeType.ROOT)
        copy_locations(conn, node)
        save_londiste_triggers(conn, queue, triggers)
        for t in node.tables:
            drop_londiste_triggers(conn, queue, t.dest)
        if node.tables:
            set_tables.add_tables(conn, queue, [t.name for t in node.tables])
        set_tables.follow_seqs(conn, queue, node.seqs)
        first = q.ticker(conn, queue)
        for sub in node.subscribers:
            q.register_consumer_at(conn, queue, sub, first)
        conn.execute(
            "insert into pgcascade.londiste_import (queue_name, first_tick) values (%s, %s)", (queue, first)
        )
    say(f"capture moved to pgcascade at its tick {first}; waiting for writers that started before")
    horizon = scalar(conn, "select txid_snapshot_xmax(txid_current_snapshot())")
    while scalar(conn, "select txid_snapshot_xmin(txid_current_snapshot())") < horizon:
        time.sleep(0.05)
    final = last_pgq_tick(conn, queue)
    with conn.transaction():
        conn.execute("select pgq.set_queue_config(%s, 'ticker_paused', 'true')", (queue,))
        conn.execute(
            "update pgcascade.londiste_import set pgq_final_tick = %s where queue_name = %s", (final, queue)
        )
    return (
        f"{node.name} is the pgcascade root of {queue} from tick {first}; Londiste's last tick is {final}:"
        " import each subscriber once its Londiste worker has applied it"
    )


def last_pgq_tick(conn: psycopg.Connection, queue: str, timeout: float = 60) -> int:
    """A PgQ tick taken from now on (ours, or pgqd's if it ticks first): its snapshot sees
    every transaction that has ended.  pgq.ticker() ticks only when its thresholds say so;
    pgq.force_tick() makes them say so."""
    before = scalar(conn, "select last_tick_id from pgq.get_queue_info(%s)", (queue,))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn.execute("select pgq.force_tick(%s)", (queue,))
        tick = scalar(conn, "select pgq.ticker(%s)", (queue,))
        newest = scalar(conn, "select last_tick_id from pgq.get_queue_info(%s)", (queue,))
        if tick is not None or newest > before:
            return tick or newest
        time.sleep(0.05)
    raise RuntimeFailure(f"PgQ's queue {queue} did not tick in {timeout:.0f}s")


def import_subscriber(conn: psycopg.Connection, node: LondisteNode, say: Say) -> str:
    queue = node.queue
    if node.provider is None or node.provider_location is None:
        raise UserError(f"{node.name} has no provider in Londiste's node info")
    with connect(node.provider_location) as prov:
        pnode = nodes.get_node(prov, queue)
        marks = (
            prov.execute(
                "select first_tick, pgq_final_tick from pgcascade.londiste_import where queue_name = %s",
                (queue,),
            ).fetchone()
            if pnode is not None
            else None
        )
        if pnode is None or marks is None or marks[1] is None:
            raise UserError(
                f"import the provider {node.provider} first (it is not a pgcascade node imported from Londiste)"
            )
        first, final = marks
        if (node.worker_last_tick or 0) < final:
            raise UserError(
                f"the Londiste worker of {node.name} applied PgQ tick {node.worker_last_tick}; it must apply"
                f" {final} (the last one) before the import: run it until then, then stop it"
            )
        rows = set_tables.set_table_rows(prov, queue)
        keys = {table: key for table, key, _ in rows}
        with prov.transaction():
            q.register_consumer_at(prov, queue, node.name, first)
            position = q.consumer_tick(prov, queue, node.name)
            nodes.set_location(prov, queue, node.name, node.location)
        if position is None or position[0] != first:
            raise RuntimeFailure(
                f"{node.provider} no longer has tick {first}: the subscriber cannot continue from it"
            )
    missing = [t.name for t in node.tables if t.name not in keys]
    if missing:
        raise UserError(f"the provider does not replicate {', '.join(missing)}")
    install_here(conn, queue)
    triggers = read_londiste_triggers(conn, node)
    with conn.transaction():
        save_londiste_triggers(conn, queue, triggers)
        if node.node_type is NodeType.BRANCH:
            q.create_branch_queue(conn, queue, *position)
            set_tables.mirror_set_tables(conn, queue, rows)
            for sub in node.subscribers:
                q.register_consumer_at(conn, queue, sub, first)
            conn.execute(
                "insert into pgcascade.londiste_import (queue_name, first_tick, pgq_final_tick) values (%s, %s, %s)",
                (queue, first, final),
            )
        nodes.insert_node(conn, queue, node.name, node.node_type, node.provider, first)
        copy_locations(conn, node)
        for t in node.tables:
            drop_londiste_triggers(conn, queue, t.dest)
            subscriber.adopt_table(
                conn, queue, t.name, t.dest, keys[t.name], states.OK if t.in_sync else states.NEW
            )
        subscriber_seqs.follow_seqs(conn, queue, node.seqs)
        if node.node_type is NodeType.BRANCH:
            set_tables.follow_seqs(conn, queue, node.seqs)
    note = f"; copied again: {', '.join(node.to_copy)}" if node.to_copy else ""
    say(f"{node.name} continues from pgcascade tick {first} on {node.provider}")
    return f"{node.name} is a pgcascade {node.node_type} of {node.provider}, {len(node.tables)} tables{note}"


LONDISTE_EXTENSIONS = ("londiste", "pgq_node", "pgq")  # dependents first


def pgq_consumers_behind(conn: psycopg.Connection) -> list[str]:
    """PgQ registrations (queue/consumer) that have not reached their queue's last tick: events
    they have not read yet would go with PgQ.  pgq_node's watermark registrations do not count."""
    rows = conn.execute(
        "select q.queue_name || '/' || c.co_name from pgq.subscription s"
        "  join pgq.queue q on q.queue_id = s.sub_queue join pgq.consumer c on c.co_id = s.sub_consumer"
        " where s.sub_last_tick < (select max(t.tick_id) from pgq.tick t where t.tick_queue = s.sub_queue)"
        "   and c.co_name not like '.%'"  # pgq_node's own watermarks, gone with it
        " order by 1"
    ).fetchall()
    return [r[0] for r in rows]


def drop_londiste(conn: psycopg.Connection, queue: str, force: bool) -> list[str]:
    """Drop Londiste 3's and PgQ's extensions from an imported node; returns what was dropped.

    Refused on a node that was not imported (its replication still runs through Londiste), while
    a PgQ consumer has events left to read (unless `force`), and where Londiste or PgQ were
    installed as plain schemas (their objects are not known well enough to drop them here).
    """
    installed = {
        r[0]
        for r in conn.execute(
            "select extname from pg_extension where extname = any(%s)", (list(LONDISTE_EXTENSIONS),)
        )
    }
    schemas = {
        r[0]
        for r in conn.execute(
            "select nspname from pg_namespace where nspname = any(%s)", (list(LONDISTE_EXTENSIONS),)
        )
    }
    if schema.pgq_schema_owner(conn) == "pgcascade":
        schemas.discard("pgq")  # the compatibility schema: pgcascade's own
    if schemas - installed:
        raise UserError(
            f"schema(s) {', '.join(sorted(schemas - installed))} are not extensions here: drop them by hand"
        )
    if not installed:
        return []
    if nodes.get_node(conn, queue) is None:
        raise UserError(
            f"{queue} was not imported here (import-londiste first): Londiste still replicates it"
        )
    behind = pgq_consumers_behind(conn) if "pgq" in installed else []
    if behind and not force:
        raise UserError(f"PgQ consumers have events left to read: {', '.join(behind)} (--force drops them)")
    try:
        with conn.transaction():
            for ext in LONDISTE_EXTENSIONS:
                if ext == "pgq" and ext in installed:  # its queues' tables are not the extension's
                    conn.execute("select pgq.drop_queue(queue_name, true) from pgq.queue")
                if ext in installed:
                    conn.execute(sql.SQL("drop extension {}").format(sql.Identifier(ext)))
    except psycopg.errors.DependentObjectsStillExist as e:
        detail = "; ".join((e.diag.message_detail or "").splitlines()[:3])
        raise UserError(f"{e.diag.message_primary}: {detail} (drop or move those first)") from None
    return [e for e in LONDISTE_EXTENSIONS if e in installed]
