"""back-to-londiste: the way back after import-londiste, while Londiste's schemas are still
there (before drop-londiste), without copying a table again.

Import left every Londiste node as it was at PgQ's last tick P (the root's ticker paused,
every subscriber's worker stopped after applying P).  Going back mirrors the import:

  1. the root, first: one transaction drops pgcascade's capture triggers and makes Londiste's
     again (exactly those import found, kept in pgcascade.londiste_trigger) and resumes PgQ's
     ticker; once every transaction that could still write through pgcascade's triggers has
     ended, a last pgcascade tick B is taken and recorded.  Every change before the swap is in
     pgcascade's queue up to B, every change after it in PgQ's queue after P;
  2. each subscriber, leaves first (a node that feeds pgcascade nodes waits for them), once its
     pgcascade worker has applied B and is stopped: it leaves the set (its registration on the
     provider goes, the root forgets its location) and, in one transaction, its tables take
     Londiste's triggers back.  Its Londiste worker, started again, continues from P;
  3. the root, last: pgcascade's queue and node go.  pgcascade's schema stays (empty), so the
     set can be imported again later.
"""

from __future__ import annotations

import time

import psycopg
from psycopg import sql

from pgcascade.capture import logical
from pgcascade.capture import tables as set_tables
from pgcascade.cascade.admin import leave_set
from pgcascade.cascade.join import announce_at_root
from pgcascade.cascade.londiste import LondisteNode, read_node
from pgcascade.cascade.provider import release_everywhere
from pgcascade.cascade.survey import NOT_A_NODE, connect, find_root, survey
from pgcascade.cascade.waits import Say
from pgcascade.core import catalog
from pgcascade.core.daemonlock import DaemonRole, daemon_state
from pgcascade.core.errors import UserError
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q

ENABLE = {"O": None, "D": "disable", "R": "enable replica", "A": "enable always"}


def imported_ticks(conn: psycopg.Connection, queue: str) -> tuple[int, int | None] | None:
    """(PgQ's last tick P, pgcascade's last tick B or None) of an imported root, or None."""
    return conn.execute(
        "select pgq_final_tick, pgcascade_final_tick from pgcascade.londiste_import where queue_name = %s",
        (queue,),
    ).fetchone()


def londiste_node(conn: psycopg.Connection, queue: str) -> LondisteNode:
    """Londiste's own record of this node, which import left as it was."""
    if not scalar(conn, "select to_regclass('pgq_node.node_info') is not null"):
        raise UserError(
            "Londiste and PgQ are not here any more (drop-londiste): there is nothing to go back to"
        )
    return read_node(conn, queue)


def refuse_running_worker(conn: psycopg.Connection, queue: str) -> None:
    worker = daemon_state(conn, DaemonRole.WORKER, queue)
    if worker.running:
        raise UserError(
            f"the pgcascade worker of this node runs (pid {worker.pid} on {worker.host}, job {worker.job_name}):"
            " stop it first (worker -s)"
        )


def back(conn: psycopg.Connection, queue: str, say: Say) -> str:
    """Run on the root first, then on each subscriber (leaves first), then on the root again."""
    node = nodes.require_node(conn, queue)
    if not node.role.is_root:
        return subscriber_back(conn, node, say)
    ticks = imported_ticks(conn, queue)
    if ticks is None:
        raise UserError(
            f"{queue} was not imported from Londiste here: there is no Londiste set to go back to"
        )
    if ticks[1] is None:
        return root_back(conn, node, say)
    return root_done(conn, node)


def root_back(conn: psycopg.Connection, node: nodes.Node, say: Say) -> str:
    queue = node.queue_name
    lnode = londiste_node(conn, queue)
    if logical.is_logical(conn, queue) or nodes.peers(conn, queue):
        raise UserError(
            f"{queue} captures through a slot or has two-way peers here: back-to-londiste cannot undo that"
        )
    extra = sorted(set(set_tables.set_tables(conn, queue)) - {t.name for t in lnode.tables})
    if extra:
        raise UserError(
            f"pgcascade replicates {', '.join(extra)}, which Londiste does not: remove-table them here first"
            " (or add them to Londiste after going back)"
        )
    with conn.transaction():
        set_tables.stop_capture(conn, queue)  # the trigger DDL waits for the writers in flight
        restore_triggers(conn, lnode)
        conn.execute("select pgq.set_queue_config(%s, 'ticker_paused', 'false')", (queue,))
    say("capture moved back to Londiste; waiting for writers that started before")
    horizon = scalar(conn, "select txid_snapshot_xmax(txid_current_snapshot())")
    while scalar(conn, "select txid_snapshot_xmin(txid_current_snapshot())") < horizon:
        time.sleep(0.05)
    with conn.transaction():
        final = q.ticker(conn, queue)
        conn.execute(
            "update pgcascade.londiste_import set pgcascade_final_tick = %s where queue_name = %s",
            (final, queue),
        )
    return (
        f"{node.node_name}: Londiste captures {queue} again; pgcascade's last tick is {final}: run back-to-londiste"
        " on each subscriber (leaves first) once its pgcascade worker has applied it and is stopped, then here again"
    )


def subscriber_back(conn: psycopg.Connection, node: nodes.Node, say: Say) -> str:
    queue = node.queue_name
    lnode = londiste_node(conn, queue)
    root_name, root_loc = find_root(conn, queue)
    with connect(root_loc) as root:
        ticks = imported_ticks(root, queue)
    if ticks is None or ticks[1] is None:
        raise UserError(f"run back-to-londiste on the root {root_name} first")
    final = ticks[1]
    if (node.last_tick or 0) < final:
        raise UserError(
            f"the pgcascade worker of {node.node_name} applied tick {node.last_tick}; it must apply {final}"
            " (pgcascade's last) first: run it until then, then stop it"
        )
    refuse_running_worker(conn, queue)
    fed = [
        m.name for m in survey(conn, queue) if m.node is not None and m.node.provider_node == node.node_name
    ]
    if fed:
        raise UserError(
            f"{node.node_name} still feeds pgcascade nodes: run back-to-londiste on {', '.join(fed)} first"
        )
    release_everywhere(conn, queue, node.node_name)
    announce_at_root(conn, queue, node.node_name, None)
    with conn.transaction():
        leave_set(conn, queue)
        restore_triggers(conn, lnode)
        conn.execute("delete from pgcascade.londiste_import where queue_name = %s", (queue,))
    say(f"{node.node_name} left pgcascade's set {queue}")
    return (
        f"{node.node_name} is a Londiste {lnode.node_type} again: start its Londiste worker, it continues"
        f" from PgQ tick {lnode.worker_last_tick}"
    )


def root_done(conn: psycopg.Connection, node: nodes.Node) -> str:
    """The last step on the root: once no pgcascade node is left below it, its queue goes."""
    queue = node.queue_name
    left = [
        m.name
        for m in survey(conn, queue)
        if m.name != node.node_name and not m.dead and m.error != NOT_A_NODE
    ]
    if left:
        raise UserError(
            f"{', '.join(left)} are still pgcascade nodes, or do not answer: run back-to-londiste there"
            " first (or drop-node a node that is gone)"
        )
    refuse_running_worker(conn, queue)
    with conn.transaction():
        leave_set(conn, queue)
        conn.execute("delete from pgcascade.londiste_import where queue_name = %s", (queue,))
    return f"{node.node_name}: pgcascade's queue {queue} is gone; the set is Londiste's again"


def restore_triggers(conn: psycopg.Connection, lnode: LondisteNode) -> None:
    """Londiste's triggers on the node's tables, as import-londiste found them; for a node
    imported by an earlier release (nothing kept), as Londiste makes them by default."""
    saved = conn.execute(
        "select table_name, trigger_name, definition, enabled from pgcascade.londiste_trigger where queue_name = %s",
        (lnode.queue,),
    ).fetchall()
    kept = {row[0] for row in saved}
    for table, trigger, definition, enabled in saved:
        target = sql.Identifier(*catalog.split_name(conn, table))
        conn.execute(sql.SQL("drop trigger if exists {} on {}").format(sql.Identifier(trigger), target))
        conn.execute(definition.encode())
        how = ENABLE.get(enabled)
        if how:
            conn.execute(
                sql.SQL("alter table {} {} trigger {}").format(target, sql.SQL(how), sql.Identifier(trigger))
            )
    for t in lnode.tables:
        if t.dest not in kept:
            conn.execute(
                "select * from londiste.create_trigger(%s, %s, array[]::text[], %s, %s)",
                (lnode.queue, t.name, t.dest, lnode.node_type.value),
            )
    conn.execute("delete from pgcascade.londiste_trigger where queue_name = %s", (lnode.queue,))
